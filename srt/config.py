"""The one configuration pattern every script uses: argparse defaults that work, `--preset NAME`
applied with `parser.set_defaults(**PRESETS[NAME])` so that flags given on the command line win,
every numeric flag checked against its range, and the resolved configuration written next to the
outputs.

A numeric flag takes its range as its argparse `type`: `type=at_least(1)`, `type=positive(float)`,
`type=in_range(0.0, 1.0)`. argparse then rejects a bad value with one line that names the flag
(`error: argument --lr: must be > 0, got -1.0`), and `parse_config` applies the same check to the
values a preset sets, which argparse never converts.

Every script claims its --out before any work (`claim_out`): a folder it can write, holding no run
of another script, and an earlier run of its own only under --resume (continue it) or --overwrite
(replace it). config.json names the script that wrote it.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import re
import sys
import tempfile
from pathlib import Path

from srt.data_io import write_json


class Bounded:
    """An argparse `type`: parse with `kind`, then require low <= value (or low < value when
    `strict`) and value <= high. A non-finite float (nan, inf) is always refused."""

    def __init__(self, kind=int, low=None, high=None, strict=False):
        self.kind, self.low, self.high, self.strict = kind, low, high, strict
        self.__name__ = kind.__name__  # argparse names the type in its "invalid int value" message

    def describe(self) -> str:
        if self.low is not None and self.high is not None:
            return f"in {'(' if self.strict else '['}{self.low}, {self.high}]"
        if self.low is not None:
            return f"> {self.low}" if self.strict else f">= {self.low}"
        return f"<= {self.high}"

    def check(self, value):
        if self.kind is float and not math.isfinite(value):
            raise argparse.ArgumentTypeError(f"must be a finite number, got {value}")
        too_low = self.low is not None and (value <= self.low if self.strict else value < self.low)
        too_high = self.high is not None and value > self.high
        if too_low or too_high:
            raise argparse.ArgumentTypeError(f"must be {self.describe()}, got {value}")
        return value

    def __call__(self, text: str):
        return self.check(self.kind(text))


def at_least(low, kind=int) -> Bounded:
    return Bounded(kind, low=low)


def positive(kind=float) -> Bounded:
    return Bounded(kind, low=0, strict=True)


def in_range(low, high, kind=float) -> Bounded:
    return Bounded(kind, low=low, high=high)


# Presets are named for what they serve: cpu-table2 is `make table2`'s, cpu-lesson `make demo`'s.
RENAMED_PRESETS = {"cpu-demo": "cpu-table2"}


def parse_config(parser: argparse.ArgumentParser, presets: dict, argv=None) -> argparse.Namespace:
    """Parse `argv` with `--preset` applied: argparse default < preset < explicit flag. Every
    bounded flag's final value is checked, a preset's included."""
    parser.add_argument(
        "--preset",
        choices=sorted(presets),
        help="a named set of defaults (explicit flags win): " + ", ".join(sorted(presets)),
    )
    argv = sys.argv[1:] if argv is None else list(argv)
    for old, new in RENAMED_PRESETS.items():  # a former name still works, and says what it is now
        if old in argv and argv[argv.index(old) - 1] == "--preset" and new in presets:
            print(f"note: --preset {old} is now called {new}", file=sys.stderr)
            argv[argv.index(old)] = new
        elif f"--preset={old}" in argv and new in presets:
            print(f"note: --preset {old} is now called {new}", file=sys.stderr)
            argv[argv.index(f"--preset={old}")] = f"--preset={new}"
    known, _ = parser.parse_known_args(argv)
    if known.preset:
        dests = {action.dest for action in parser._actions}
        unknown = sorted(set(presets[known.preset]) - dests)
        if unknown:  # a typo in a preset would otherwise be silently ignored
            raise ValueError(f"preset {known.preset!r} sets unknown options {unknown}")
        parser.set_defaults(**presets[known.preset])
    config = parser.parse_args(argv)
    for action in parser._actions:
        value = getattr(config, action.dest, None)
        if isinstance(action.type, Bounded) and value is not None:
            try:
                action.type.check(value)
            except argparse.ArgumentTypeError as e:
                parser.error(f"argument {'/'.join(action.option_strings)}: {e}")
    return config


def require(condition: bool, message: str) -> None:
    """A one-line error for a bad combination of flags, before any work is done."""
    if not condition:
        sys.exit(f"error: {message}")


def env_var_name(text: str) -> str:
    """argparse type of --api-key-env: the NAME of the variable that holds the key. A value that
    looks like the key itself (sk-..., or long and not UPPER_SNAKE) is refused without being shown,
    so it is never echoed nor written to config.json."""
    looks_like_a_name = re.fullmatch(r"[A-Za-z_][A-Za-z0-9_]*", text) and (
        len(text) < 32 or re.fullmatch(r"[A-Z0-9_]+", text)
    )
    if not looks_like_a_name or text.startswith(("sk_", "hf_")):  # OpenAI's, Hugging Face's
        raise argparse.ArgumentTypeError(
            "takes the name of an environment variable that holds the key (e.g. OPENAI_API_KEY), not "
            "the key itself; the value given looks like a key and is neither shown nor saved"
        )
    return text


# A key that only one script's config.json holds: it names the writer of a config.json written
# before config.json recorded its "script".
SCRIPT_SIGNATURES = {
    "stage0_build.py": "dedup_jaccard",
    "stage1_sft.py": "phase1_fraction",
    "stage2_grpo.py": "num_generations",
    "evaluate.py": "variants",
    "cuemem.py": "links_per_cue",
    "reward.py": "completions",
}


def run_in(out) -> str | None:
    """Who wrote the run in folder `out`: a script's name, "a model (save_pretrained)", "a config.json
    of another program", or None when there is no config.json."""
    path = Path(out) / "config.json"
    if not path.is_file():
        return None
    try:
        config = json.loads(path.read_bytes())
    except (OSError, ValueError):
        return "a config.json of another program"
    if not isinstance(config, dict):
        return "a config.json of another program"
    if isinstance(config.get("script"), str):
        return config["script"]
    if "model_type" in config or "architectures" in config:
        return "a model (save_pretrained)"
    return next(
        (s for s, key in SCRIPT_SIGNATURES.items() if key in config), "a config.json of another program"
    )


def claim_out(
    out, script: str, resume: bool = False, overwrite: bool = False, resumable: bool = True
) -> Path:
    """Check --out before any work is done, and exit with one line if it will not do: a file, a
    folder that cannot be created or written, a folder holding another script's run (or a model),
    or one holding an earlier run of `script` when neither --resume (continue it; a `resumable`
    script's) nor --overwrite (replace it) is given. Creates the folder; writes nothing in it."""
    out = Path(out)
    if out.exists() and not out.is_dir():
        sys.exit(f"error: --out {out} is a file, not a folder")
    writer = run_in(out)
    if writer is not None and writer != script:
        held = f"a run of {writer} (its config.json)" if writer.endswith(".py") else writer
        sys.exit(f"error: --out {out} holds {held}; give {script} a folder of its own")
    if writer == script and not (resume or overwrite):
        again = "--resume continues it, --overwrite replaces it" if resumable else "--overwrite replaces it"
        sys.exit(f"error: --out {out} already holds a run of {script} (its config.json); {again}")
    try:
        out.mkdir(parents=True, exist_ok=True)
        fd, probe = tempfile.mkstemp(dir=out, prefix=".write-check.")
        os.close(fd)
        os.unlink(probe)
    except OSError as e:
        sys.exit(f"error: --out {out} is not a folder this run can write ({e.strerror})")
    return out


def write_config(out, config, script: str | None = None) -> Path:
    """<out>/config.json: the resolved configuration of this run (argparse.Namespace or dict), and
    the script that wrote it (what claim_out reads)."""
    path = Path(out) / "config.json"
    config = dict(vars(config)) if isinstance(config, argparse.Namespace) else dict(config)
    write_json(path, {**({"script": script} if script else {}), **config})
    return path
