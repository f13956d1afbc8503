"""Ordinary mistakes through the six scripts' `main(argv)`: each is a one-line `error:` (no
traceback), refused before any work, and an output folder that held an earlier run is left as it
was (its files' sha256 before and after). Also: every numeric flag of every script is bounded,
stage 0 writes its outputs as one commit, and a resumed run must train on the same data."""

import hashlib
import json
import os
import re
import subprocess
import sys
import zlib
from pathlib import Path

import numpy as np
import pytest
from records import hand_record

import cuemem
import evaluate
import reward
import stage0_build as s0
import stage1_sft
import stage2_grpo
from srt.config import Bounded
from srt.data.synthetic import generate_synthetic
from srt.data_io import MAX_UTTERANCE_CHARS, write_jsonl

REPO = Path(__file__).resolve().parents[1]
SCRIPTS = {
    "stage0_build.py": s0,
    "stage1_sft.py": stage1_sft,
    "stage2_grpo.py": stage2_grpo,
    "evaluate.py": evaluate,
    "cuemem.py": cuemem,
    "reward.py": reward,
}

pytestmark = pytest.mark.usefixtures("one_thread")


def hashed_embed(texts, *_, **__):
    """A stand-in for all-MiniLM-L6-v2 in Eq. (2): word hashes, instant and offline."""
    out = np.zeros((len(texts), 64), np.float32)
    for i, text in enumerate(texts):
        for word in re.findall(r"[a-z0-9$]+", text.lower()):
            out[i, zlib.crc32(word.encode()) % 64] += 1.0
    return out / np.maximum(np.linalg.norm(out, axis=1, keepdims=True), 1e-9)


@pytest.fixture(autouse=True)
def no_embedder(monkeypatch):
    monkeypatch.setattr(s0, "embed", hashed_embed)


def fingerprint(folder) -> dict:
    """sha256 of every file under `folder`, by relative path."""
    folder = Path(folder)
    return {
        str(p.relative_to(folder)): hashlib.sha256(p.read_bytes()).hexdigest()
        for p in sorted(folder.rglob("*"))
        if p.is_file()
    }


def error_of(capsys, main, argv) -> str:
    """Run main(argv); it must exit with one `error:` line (its own, or argparse's last line)."""
    with pytest.raises(SystemExit) as e:
        main(argv)
    err = capsys.readouterr().err
    message = e.value.code if isinstance(e.value.code, str) else err.strip().splitlines()[-1]
    assert e.value.code != 0 and "error: " in message and "\n" not in message.strip(), message
    return message


def records_file(path, n=3, **changes) -> str:
    write_jsonl(path, [dict(hand_record(i), **changes) for i in range(n)])
    return str(path)


def latin1_file(path, good_lines=1) -> str:
    """A JSONL export in Latin-1: line `good_lines + 1` holds the byte 0xe9 (é)."""
    lines = [json.dumps(hand_record(i)).encode() for i in range(good_lines)]
    lines.append(json.dumps(hand_record(9)).replace("user line", "caf\u00e9 line").encode("latin-1"))
    Path(path).write_bytes(b"\n".join(lines) + b"\n")
    return str(path)


def stage0_args(out, *extra):
    return ["--num-dialogues", "12", "--min-rounds", "2", "--out", str(out), "--quiet", *extra]


def stage1_args(data, out, *extra):
    return ["--model", "tiny-random", "--data", str(data), "--out", str(out), "--dtype", "float32",
            "--max-steps", "2", "--batch-size", "2", "--warmup-steps", "0", *extra]  # fmt: skip


def stage2_args(data, out, *extra):
    return ["--model", "tiny-random", "--data", str(data), "--out", str(out), "--dtype", "float32",
            "-K", "2", "--max-steps", "1", "--max-new-tokens", "3", "--sample-ratio", "1",
            "--eval-limit", "0", "--sample-every", "0", *extra]  # fmt: skip


def usage_argv(script, data, out) -> list[str]:
    """The smallest valid command line of each script that writes to `out`."""
    return {
        "stage0_build.py": stage0_args(out),
        "stage1_sft.py": stage1_args(data, out),
        "stage2_grpo.py": stage2_args(data, out),
        "evaluate.py": [
            "--method",
            "full",
            "--model",
            "tiny-random",
            "--data",
            data,
            "--out",
            str(out),
            "--max-new-tokens-direct",
            "2",
            "--latency-per-bucket",
            "0",
            "--quiet",
        ],  # fmt: skip
        "cuemem.py": ["--retrieval-only", "--data", data, "--out", str(out)],
        "reward.py": [
            "--data",
            data,
            "--completions",
            str(Path(data).with_name("c.jsonl")),
            "--out",
            str(out),
        ],
    }[script]


# ---- numeric flags ---------------------------------------------------------------------------
@pytest.mark.parametrize("script", sorted(SCRIPTS))
def test_every_numeric_flag_of_every_script_is_range_checked(script):
    """docs/design.md: every numeric flag is checked against its range. A flag of plain int or
    float type would take -1, 0 or nan without a word."""
    parser = SCRIPTS[script].build_parser()
    plain = [a.option_strings for a in parser._actions if a.type in (int, float)]
    assert not plain, f"{script}: numeric flags without a range: {plain}"
    bounded = [a for a in parser._actions if isinstance(a.type, Bounded)]
    assert bounded and all(a.help for a in parser._actions)


@pytest.mark.parametrize(
    "script, argv, says",
    [
        (
            "stage0_build.py",
            ["--dev-fraction", "0.7", "--test-fraction", "0.7"],
            "leave no dialogue for train",
        ),
        ("stage0_build.py", ["--limit", "-1"], "argument --limit: must be >= 1, got -1"),
        ("stage0_build.py", ["--decay", "-5"], "argument --decay: must be >= 0.0, got -5.0"),
        ("stage0_build.py", ["--min-rounds", "9", "--max-rounds", "8"], "is above --max-rounds"),
        ("evaluate.py", ["--limit", "-1"], "argument --limit: must be >= 1, got -1"),
        ("evaluate.py", ["--recency-k", "-2"], "argument --recency-k: must be >= 1, got -2"),
        ("evaluate.py", ["--rag-k", "0"], "argument --rag-k"),
        ("evaluate.py", ["--batch-size", "0"], "argument --batch-size"),
        ("evaluate.py", ["--latency-per-bucket", "-1"], "argument --latency-per-bucket"),
        ("evaluate.py", ["--max-new-tokens-direct", "0"], "argument --max-new-tokens-direct"),
        ("evaluate.py", ["--bootstrap", "100"], "argument --bootstrap: must be >= 1000"),
        ("cuemem.py", ["--capacity", "0"], "argument --capacity: must be >= 1, got 0"),
        ("cuemem.py", ["--temporal-decay", "nan"], "argument --temporal-decay: must be a finite number"),
        ("cuemem.py", ["--top-k", "0"], "argument --top-k: must be >= 1, got 0"),
        ("stage2_grpo.py", ["-K", "1"], "a group of one completion has advantage 0"),
        ("stage2_grpo.py", ["--lr", "0"], "a learning rate of 0 moves no weight"),
        ("stage2_grpo.py", ["--top-p", "0"], "argument --top-p: must be in (0.0, 1.0], got 0.0"),
        ("reward.py", ["--data", "x.jsonl", "--index", "-1"], "argument --index: must be >= 0"),
    ],
)
def test_out_of_range_values_are_one_line_errors(capsys, tmp_path, script, argv, says):
    out = tmp_path / "out"
    assert says in error_of(capsys, SCRIPTS[script].main, [*argv, "--out", str(out)])
    assert not out.exists()  # refused before any work


# ---- the input files ---------------------------------------------------------------------------
@pytest.mark.parametrize(
    "script", ["stage1_sft.py", "stage2_grpo.py", "evaluate.py", "cuemem.py", "reward.py"]
)
def test_a_file_that_is_not_utf8_names_its_file_and_line(capsys, tmp_path, script):
    data = latin1_file(tmp_path / "latin1.jsonl")
    out = tmp_path / "out"
    argv = usage_argv(script, data, out)
    if script == "reward.py":
        argv = ["--data", data]
    message = error_of(capsys, SCRIPTS[script].main, argv)
    assert f"{data}:2: not valid UTF-8 (byte 0xe9" in message
    assert not (out / "config.json").exists()


def test_stage0_skips_an_undecodable_line_with_on_error_skip(capsys, tmp_path):
    raw = tmp_path / "raw.jsonl"
    lines = [json.dumps(d).encode() for d in generate_synthetic(6, seed=0)]
    lines[2] = lines[2].replace(b"I", b"\xc9", 1)  # É in Latin-1
    raw.write_bytes(b"\n".join(lines) + b"\n")
    argv = ["--source", "jsonl", "--input", str(raw), "--min-rounds", "2", "--quiet"]
    message = error_of(capsys, s0.main, [*argv, "--out", str(tmp_path / "a")])
    assert f"{raw}:3: not valid UTF-8 (byte 0xc9" in message
    s0.main([*argv, "--out", str(tmp_path / "b"), "--on-error", "skip"])
    stats = json.loads((tmp_path / "b" / "stats.json").read_text())
    assert stats["dropped"]["malformed"] == 1 and stats["dialogues_in"] == 6


def test_an_empty_file_is_an_error_not_a_report_on_nothing(capsys, tmp_path):
    empty = tmp_path / "empty.jsonl"
    empty.write_text("")
    for script in ("evaluate.py", "cuemem.py"):
        out = tmp_path / script
        message = error_of(capsys, SCRIPTS[script].main, usage_argv(script, str(empty), out))
        assert f"{empty} holds no records" in message
        assert not (out / "config.json").exists()


def test_an_utterance_longer_than_the_limit_is_refused_with_its_field(capsys, tmp_path):
    record = hand_record(0)
    record["history"][1]["text"] = "x" * (MAX_UTTERANCE_CHARS + 1)
    data = tmp_path / "long.jsonl"
    write_jsonl(data, [hand_record(1), record])
    message = error_of(capsys, stage1_sft.main, stage1_args(data, tmp_path / "out"))
    assert f"{data}:2: field 'history[1].text' holds 20,001 characters" in message
    raw = tmp_path / "raw.jsonl"  # stage 0 refuses it in its input already: no build later stages refuse
    dialogues = generate_synthetic(3, seed=0)
    dialogues[1]["rounds"][4]["assistant"] = "y" * (MAX_UTTERANCE_CHARS + 1)
    write_jsonl(raw, dialogues)
    message = error_of(
        capsys, s0.main, ["--source", "jsonl", "--input", str(raw), *stage0_args(tmp_path / "s0")]
    )
    assert f"{raw}:2: field 'rounds[4].assistant' holds 20,001 characters" in message


def test_a_completion_that_looks_like_a_path_is_no_such_file(capsys, tmp_path):
    data = records_file(tmp_path / "d.jsonl")
    for path in ("/no/such/file", "answer.txt"):
        message = error_of(capsys, reward.main, ["--data", data, "--completion", path])
        assert f"--completion {path}: no such file" in message
    reward.main(["--data", data, "--completion", "<think>x</think>\nFinal answer: 1/2"])  # a text: scored


# ---- models ------------------------------------------------------------------------------------
def test_a_model_folder_without_weights_says_what_is_missing(capsys, tmp_path):
    folder = tmp_path / "model"
    folder.mkdir()
    (folder / "config.json").write_text('{"model_type": "llama"}')
    data = records_file(tmp_path / "d.jsonl")
    message = error_of(capsys, stage2_grpo.main, [*stage2_args(data, tmp_path / "g"), "--model", str(folder)])
    assert f"model folder {folder} has no weights (*.safetensors" in message and "tokenizer" in message
    out = tmp_path / "e"
    message = error_of(capsys, evaluate.main, ["--method", "full", "--model", str(folder), "--data", data,
                                               "--out", str(out)])  # fmt: skip
    assert "has no weights" in message and not (out / "config.json").exists()


def test_a_hub_id_offline_and_not_cached_fails_at_once(capsys, tmp_path, monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    data = records_file(tmp_path / "d.jsonl")
    out = tmp_path / "e"
    argv = ["--method", "full", "--model", "srt-tests/no-such-model", "--data", data, "--out", str(out)]
    message = error_of(capsys, evaluate.main, argv)
    assert "--model srt-tests/no-such-model: HF_HUB_OFFLINE is set" in message and "hf download" in message
    assert not (out / "config.json").exists()


# ---- --out -------------------------------------------------------------------------------------
@pytest.mark.parametrize("script", sorted(SCRIPTS))
def test_an_out_that_is_a_file_is_refused_before_any_work(capsys, tmp_path, script):
    data = records_file(tmp_path / "d.jsonl")
    write_jsonl(tmp_path / "c.jsonl", [{"index": 0, "completion": "x"}])
    out = tmp_path / "taken"
    out.write_text("precious\n")
    message = error_of(capsys, SCRIPTS[script].main, usage_argv(script, data, out))
    assert f"--out {out} is a file, not a folder" in message
    assert out.read_text() == "precious\n"


@pytest.mark.parametrize("script", sorted(SCRIPTS))
def test_an_out_that_cannot_be_written_is_refused_before_any_work(capsys, tmp_path, script, monkeypatch):
    """A read-only folder (as root, chmod cannot make one: a write into it is made to fail instead)."""
    import tempfile

    data = records_file(tmp_path / "d.jsonl")
    write_jsonl(tmp_path / "c.jsonl", [{"index": 0, "completion": "x"}])
    out = tmp_path / "ro"
    real_mkstemp = tempfile.mkstemp

    def refuse_in_out(*args, dir=None, **kwargs):
        if dir is not None and Path(dir) == out:
            raise PermissionError(13, "Permission denied")
        return real_mkstemp(*args, dir=dir, **kwargs)

    monkeypatch.setattr(tempfile, "mkstemp", refuse_in_out)
    message = error_of(capsys, SCRIPTS[script].main, usage_argv(script, data, out))
    assert f"--out {out} is not a folder this run can write (Permission denied)" in message
    assert not any(out.iterdir())


@pytest.mark.parametrize("script", sorted(SCRIPTS))
def test_a_folder_holding_an_earlier_run_needs_resume_or_overwrite(capsys, tmp_path, script):
    """An output folder belongs to one run: rerunning into it without --resume (or --overwrite)
    is refused, and nothing in it changes."""
    data = records_file(tmp_path / "d.jsonl")
    write_jsonl(tmp_path / "c.jsonl", [{"index": 0, "completion": "x"}])
    out = tmp_path / "out"
    argv = usage_argv(script, data, out)
    SCRIPTS[script].main(argv)
    assert json.loads((out / "config.json").read_text())["script"] == script
    before = fingerprint(out)
    message = error_of(capsys, SCRIPTS[script].main, argv)
    assert f"--out {out} already holds a run of {script}" in message and "--overwrite replaces it" in message
    assert fingerprint(out) == before
    SCRIPTS[script].main([*argv, "--overwrite"])


def test_a_folder_of_another_stage_is_refused_even_on_resume(capsys, tmp_path):
    data = records_file(tmp_path / "d.jsonl")
    sft = tmp_path / "sft"
    stage1_sft.main(stage1_args(data, sft))
    before = fingerprint(sft)
    message = error_of(capsys, stage2_grpo.main, [*stage2_args(data, sft), "--resume"])
    assert f"--out {sft} holds a run of stage1_sft.py" in message
    # a config.json written before it named its script: told apart by a key only stage 1 writes
    config = json.loads((sft / "config.json").read_text())
    del config["script"]
    (sft / "config.json").write_text(json.dumps(config))
    before["config.json"] = hashlib.sha256((sft / "config.json").read_bytes()).hexdigest()
    assert "holds a run of stage1_sft.py" in error_of(
        capsys, stage2_grpo.main, [*stage2_args(data, sft), "--resume"]
    )
    message = error_of(capsys, evaluate.main, ["--method", "full", "--model", "tiny-random", "--data", data,
                                               "--out", str(sft / "final")])  # fmt: skip
    assert "holds a model (save_pretrained)" in message
    assert fingerprint(sft) == before


def test_an_api_key_given_as_the_variable_name_is_refused_and_never_saved(capsys, tmp_path):
    key = "sk-proj-" + "Ab3" * 16
    for script, argv in (
        ("stage0_build.py", stage0_args(tmp_path / "s0", "--api-key-env", key)),
        ("evaluate.py", ["--api-key-env", key, "--out", str(tmp_path / "e")]),
        ("cuemem.py", ["--api-key-env", key, "--out", str(tmp_path / "c")]),
    ):
        message = error_of(capsys, SCRIPTS[script].main, argv)
        assert "--api-key-env: takes the name of an environment variable" in message and key not in message
    assert not list(tmp_path.rglob("config.json"))
    assert s0.parse_args(["--api-key-env", "MY_PROVIDER_KEY"]).api_key_env == "MY_PROVIDER_KEY"


def test_no_traceback_reaches_the_terminal():
    """The same probes as a user runs them: one line on stderr, exit status 1."""
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    for argv in (
        ["cuemem.py", "--data", "/no/such/test.jsonl", "--retrieval-only"],
        ["reward.py", "--data", "/no/such/test.jsonl"],
    ):
        proc = subprocess.run([sys.executable, *argv], cwd=REPO, env=env, capture_output=True, text=True)
        assert proc.returncode == 1 and "Traceback" not in proc.stderr, proc.stderr
        assert proc.stderr.strip() == "error: /no/such/test.jsonl: no such file"


# ---- stage 0: one commit -----------------------------------------------------------------------
def test_stage0_cut_off_between_files_leaves_the_earlier_build_whole(capsys, tmp_path, monkeypatch):
    out = tmp_path / "data"
    s0.main(stage0_args(out, "--seed", "1"))
    before = fingerprint(out)
    real_write = s0.write_jsonl

    def write_one_then_die(path, records):  # killed after the first file of the new build
        real_write(path, records)
        monkeypatch.setattr(s0, "write_jsonl", die)

    def die(*args):
        raise KeyboardInterrupt

    monkeypatch.setattr(s0, "write_jsonl", write_one_then_die)
    with pytest.raises(KeyboardInterrupt):
        s0.main(stage0_args(out, "--seed", "2", "--overwrite"))
    assert fingerprint(out) == before  # the earlier build, whole; no temporary folder left
    monkeypatch.setattr(s0, "write_jsonl", real_write)
    capsys.readouterr()
    s0.main(stage0_args(out, "--seed", "2", "--resume"))
    assert "already built" not in capsys.readouterr().out
    assert json.loads((out / "config.json").read_text())["seed"] == 2

    # Cut off among the renames that publish a build: config.json, its mark, is gone, so --resume
    # rebuilds instead of taking the mix for a finished build.
    real_replace, moved = os.replace, []

    def replace_one_then_die(src, dst):  # the renames into --out; a file's own atomic write passes
        if Path(dst).parent == out:
            if moved:
                raise KeyboardInterrupt
            moved.append(dst)
        real_replace(src, dst)

    monkeypatch.setattr(s0.os, "replace", replace_one_then_die)
    with pytest.raises(KeyboardInterrupt):
        s0.main(stage0_args(out, "--seed", "3", "--resume"))
    monkeypatch.setattr(s0.os, "replace", real_replace)
    assert not (out / "config.json").exists()
    s0.main(stage0_args(out, "--seed", "2", "--resume"))
    assert "already built" not in capsys.readouterr().out
    splits = {name: {json.loads(line)["meta"]["dialogue_id"] for line in open(out / f"{name}.jsonl")}
              for name in ("train", "dev", "test")}  # fmt: skip
    assert not (splits["train"] & splits["test"]) and not (splits["train"] & splits["dev"])
    assert json.loads((out / "config.json").read_text())["seed"] == 2
    assert [p.name for p in out.iterdir() if p.name.startswith(".")] == []


# ---- --resume must train on the same data ------------------------------------------------------
def test_stage1_resume_with_other_data_is_refused(capsys, tmp_path):
    data = records_file(tmp_path / "train.jsonl")
    other = records_file(tmp_path / "other.jsonl", n=4)
    out = tmp_path / "sft"
    stage1_sft.main(stage1_args(data, out))
    before = fingerprint(out)
    message = error_of(capsys, stage1_sft.main, [*stage1_args(other, out), "--resume"])
    assert message.startswith(f"error: --resume with other training data than the checkpoint in {out}")
    assert "data_sha256" in message
    write_jsonl(data, [hand_record(i, price=99) for i in range(3)])  # other records under the same name
    message = error_of(capsys, stage1_sft.main, [*stage1_args(data, out), "--resume"])
    assert "other training data" in message and "data_sha256" in message and "data ([" not in message
    message = error_of(
        capsys, stage1_sft.main, [*stage1_args(latin1_file(tmp_path / "l.jsonl"), out), "--resume"]
    )
    assert "not valid UTF-8" in message
    assert fingerprint(out) == before


def test_stage2_resume_with_other_data_is_refused(capsys, tmp_path):
    data = records_file(tmp_path / "train.jsonl")
    other = records_file(tmp_path / "other.jsonl", n=4)
    out = tmp_path / "grpo"
    stage2_grpo.main(stage2_args(data, out))
    before = fingerprint(out)
    message = error_of(capsys, stage2_grpo.main, [*stage2_args(other, out), "--resume"])
    assert message.startswith(f"error: --resume with other training data than the checkpoint in {out}")
    assert fingerprint(out) == before
    capsys.readouterr()
    stage2_grpo.main([*stage2_args(data, out), "--resume"])  # the same data: a finished run, left as it is
    assert "already holds a finished run" in capsys.readouterr().out
