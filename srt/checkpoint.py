"""What a run writes and reads back to resume: atomic folders, random states, save_pretrained
checkpoints with their trainer state, and the JSONL logs that continue where a checkpoint left.

A checkpoint folder holds the weights and the tokenizer in save_pretrained form (safetensors),
plus `trainer_state.json` (step, the settings a resumed run must share) and `trainer_state.pt`
(optimizer, random states, data position), which is read back with weights_only=True: nothing
in it is unpickled as code. A checkpoint of an FSDP run keeps the same two trainer files, but its
weights and optimizer state are sharded (srt/distributed.py: `sharded/`, torch.distributed.checkpoint).
"""

from __future__ import annotations

import json
import os
import random
import shutil
import sys
import tempfile
import warnings
from pathlib import Path

import numpy as np
import torch

from srt.config import changed_settings, same_bytes_hint
from srt.data_io import DataError, read_lines, write_json, write_jsonl


def publish_dir(target: Path, write, replace: bool = True) -> None:
    """write(tmp) into a fresh folder beside `target`, then swap it in, so a kill mid-save keeps
    the previous copy. replace=False keeps a `target` someone else finished first (two ranks
    converting the same cache)."""
    target = Path(target)
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(dir=target.parent, prefix=f".{target.name}.tmp."))
    try:
        write(tmp)
        os.chmod(tmp, 0o755)
        if not replace:
            try:
                os.rename(tmp, target)
            except OSError:
                if not (target / "config.json").exists():
                    raise
            return
        swap_in(tmp, target)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def swap_in(tmp: Path, target: Path) -> None:
    """Replace `target` by the finished folder `tmp` (two renames: a kill leaves one of them)."""
    old = target.parent / f".{target.name}.old"
    shutil.rmtree(old, ignore_errors=True)
    if target.exists():
        os.rename(target, old)
    os.rename(tmp, target)
    shutil.rmtree(old, ignore_errors=True)


def rng_state() -> dict:
    """Python, numpy, torch (and CUDA) random states in types torch.load(weights_only=True) reads."""
    _, keys, pos, has_gauss, cached = np.random.get_state()
    return {
        "python": json.dumps(random.getstate()),
        "torch": torch.get_rng_state(),
        "cuda": torch.cuda.get_rng_state_all() if torch.cuda.is_available() else [],
        "numpy_keys": torch.from_numpy(keys.astype(np.int64)),
        "numpy_rest": [int(pos), int(has_gauss), float(cached)],
    }


def set_rng_state(state: dict) -> None:
    version, internal, gauss = json.loads(state["python"])
    random.setstate((version, tuple(internal), gauss))
    torch.set_rng_state(state["torch"])
    if torch.cuda.is_available() and state["cuda"]:
        torch.cuda.set_rng_state_all(state["cuda"])
    pos, has_gauss, cached = state["numpy_rest"]
    np.random.set_state(("MT19937", state["numpy_keys"].numpy().astype(np.uint32), pos, has_gauss, cached))


def save_model(
    path, model, tokenizer, trainer_state: dict | None = None, resume_config: dict | None = None
) -> None:
    """A save_pretrained folder; with `trainer_state` ({"step": .., "optimizer": .., ...}) also
    the files --resume reads."""

    def write(tmp):
        model.save_pretrained(tmp, safe_serialization=True)
        tokenizer.save_pretrained(tmp)
        if trainer_state is not None:
            torch.save(trainer_state, tmp / "trainer_state.pt")
            write_json(
                tmp / "trainer_state.json", {"step": trainer_state["step"], "config": resume_config or {}}
            )

    publish_dir(Path(path), write)


def has_trainer_state(path) -> bool:
    return (Path(path) / "trainer_state.pt").exists() and (Path(path) / "trainer_state.json").exists()


# Settings checkpoints record only since a later version: one written before lacks them and is
# resumed without that check (a note says so), so a run begun earlier still finishes.
RECORDED_LATER = (
    "data",
    "data_sha256",
    "placebo",
    "model_sha256",
    "dtype",
    "attention",
    "importance_sampling_level",
    "gspo_clip_eps",
    "clip_higher",
    "is_mode",
)


def damaged(path, name: str, e: Exception) -> SystemExit:
    """The one-line exit for a trainer file that cannot be read. Its loader's own message is not
    passed on: torch's suggests weights_only=False, which would run whatever code the file holds."""
    return SystemExit(
        f"error: {Path(path) / name} cannot be read ({type(e).__name__}): the checkpoint is damaged; "
        "put back a good copy, or start afresh with --overwrite"
    )


def check_resume_config(path, resume_config: dict) -> None:
    """Exit with one line unless every setting in `resume_config` (those that fix the data order
    and the meaning of a step, the training data and the model's weights included) equals the one
    the checkpoint in `path` was written with."""
    path = Path(path)
    try:
        saved = json.loads((path / "trainer_state.json").read_text())["config"]
        if not isinstance(saved, dict):
            raise TypeError("its config is not an object")
    except (OSError, ValueError, KeyError, TypeError) as e:
        raise damaged(path, "trainer_state.json", e) from None
    unrecorded = [k for k in RECORDED_LATER if k in resume_config and k not in saved]
    if unrecorded:
        print(
            f"note: the checkpoint in {path} does not record {', '.join(unrecorded)}; not checked", flush=True
        )
    changed = [k for k, v in resume_config.items() if saved.get(k) != v and k not in unrecorded]
    if changed:
        details = ", ".join(changed_settings(saved, resume_config, changed))
        if {"data", "data_sha256"} & set(changed):
            what = "other training data"
        elif {"model", "model_sha256"} & set(changed):
            what = "another model (--model, by path or by its files' sha256)"
        else:
            what = "different settings"
        hint = same_bytes_hint(saved, resume_config)
        sys.exit(f"error: --resume with {what} than the checkpoint in {path}: {details}{hint}")


def load_trainer_state(path, resume_config: dict) -> dict:
    """The trainer state of a checkpoint, after check_resume_config. weights_only=True: tensors and
    plain containers only, nothing unpickled as code; a damaged file is a one-line error."""
    check_resume_config(path, resume_config)
    try:
        with warnings.catch_warnings():  # a foreign pickle's protocol warning would precede the line
            warnings.filterwarnings("ignore", message="Detected pickle protocol")
            return torch.load(Path(path) / "trainer_state.pt", map_location="cpu", weights_only=True)
    except Exception as e:  # UnpicklingError, RuntimeError (a cut zip), EOFError, ...
        raise damaged(path, "trainer_state.pt", e) from None


def log_row(obj, path, line) -> dict:
    """One line of a log a run reads back: an object with an integer "step" (a line added by hand
    without one is named, not a KeyError)."""
    if not isinstance(obj, dict) or type(obj.get("step")) is not int:
        raise DataError(f"{path}:{line}: a log line needs an integer field 'step'")
    return obj


class JsonlLog:
    """metrics.jsonl / samples.jsonl: one JSON object per line, each with a "step". A resumed run
    keeps the lines up to its checkpoint's step (no gaps, no duplicates); every append rewrites the
    file atomically, so a kill never leaves half a line."""

    def __init__(self, path, keep_until_step: int | None = None):
        self.path = Path(path)
        self.rows = []
        if keep_until_step is not None and self.path.exists():
            self.rows = [r for r in read_lines(self.path, log_row) if r["step"] <= keep_until_step]

    def append(self, *rows) -> None:
        self.rows += rows
        self.flush()

    def flush(self) -> None:
        write_jsonl(self.path, self.rows)
