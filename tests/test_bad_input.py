"""Ordinary mistakes through the six scripts' `main(argv)`: each is a one-line `error:` (no
traceback), refused before any work, and an output folder that held an earlier run is left as it
was (its files' sha256 before and after). Also: every numeric flag of every script is bounded,
stage 0 writes its outputs as one commit, and a resumed run must train on the same data."""

import hashlib
import json
import os
import re
import shutil
import signal
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
from srt.config import LOCK_NAME, Bounded
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
    """sha256 of every file under `folder`, by relative path; not the lock file, which names the
    process of the last run that claimed the folder (a refused one too)."""
    folder = Path(folder)
    return {
        str(p.relative_to(folder)): hashlib.sha256(p.read_bytes()).hexdigest()
        for p in sorted(folder.rglob("*"))
        if p.is_file() and p.name != LOCK_NAME
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


def test_no_traceback_reaches_the_terminal(tmp_path):
    """The same probes as a user runs them: one line on stderr, exit status 1."""
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    for argv in (
        ["cuemem.py", "--data", "/no/such/test.jsonl", "--retrieval-only"],
        ["reward.py", "--data", "/no/such/test.jsonl"],
    ):
        proc = subprocess.run([sys.executable, *argv], cwd=REPO, env=env, capture_output=True, text=True)
        assert proc.returncode == 1 and "Traceback" not in proc.stderr, proc.stderr
        assert proc.stderr.strip() == "error: /no/such/test.jsonl: no such file"
    # a lock file that is a folder, once an IsADirectoryError
    out = tmp_path / "cm"
    (out / LOCK_NAME).mkdir(parents=True)
    argv = ["cuemem.py", "--data", records_file(tmp_path / "d.jsonl"), "--retrieval-only", "--out", str(out)]
    proc = subprocess.run([sys.executable, *argv], cwd=REPO, env=env, capture_output=True, text=True)
    assert proc.returncode == 1 and "Traceback" not in proc.stderr, proc.stderr
    assert (
        proc.stderr.strip()
        == f"error: --out {out}: its lock file {LOCK_NAME} is a folder; remove it, or give another --out"
    )


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
    with pytest.raises(SystemExit) as stop:  # Ctrl-C: one line, exit status 130
        s0.main(stage0_args(out, "--seed", "2", "--overwrite"))
    assert stop.value.code == 130
    assert fingerprint(out) == before  # the earlier build, whole; no temporary folder left
    monkeypatch.setattr(s0, "write_jsonl", real_write)
    capsys.readouterr()
    s0.main(stage0_args(out, "--seed", "2", "--overwrite"))  # --resume would refuse the other seed
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
    with pytest.raises(SystemExit):
        s0.main(stage0_args(out, "--seed", "3", "--overwrite"))
    monkeypatch.setattr(s0.os, "replace", real_replace)
    assert not (out / "config.json").exists()
    s0.main(stage0_args(out, "--seed", "2", "--resume"))
    assert "already built" not in capsys.readouterr().out
    splits = {name: {json.loads(line)["meta"]["dialogue_id"] for line in open(out / f"{name}.jsonl")}
              for name in ("train", "dev", "test")}  # fmt: skip
    assert not (splits["train"] & splits["test"]) and not (splits["train"] & splits["dev"])
    assert json.loads((out / "config.json").read_text())["seed"] == 2
    assert [p.name for p in out.iterdir() if p.name.startswith(".")] == [LOCK_NAME]  # no temporary left


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


# ================================================================================================
# A run folder belongs to one run, a --resume refuses what it cannot continue (naming what
# differs), no silent nonsense, and no ordinary mistake ends in a traceback.
# ================================================================================================
def holding_the_lock(out, script="stage1_sft.py", pid=4242):
    """Another run's hold on `out`: its lock file, flocked on a descriptor of its own (a flock
    belongs to an open file, so this process's own claim must fail against it). -> the descriptor."""
    import fcntl

    out.mkdir(parents=True, exist_ok=True)
    fd = os.open(out / LOCK_NAME, os.O_RDWR | os.O_CREAT)
    fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    os.write(fd, json.dumps({"script": script, "pid": pid}).encode())
    return fd


# ---- --out holds one run at a time ---------------------------------------------------------------
@pytest.mark.parametrize("script", sorted(SCRIPTS))
def test_a_folder_of_the_users_own_files_is_refused_without_overwrite(capsys, tmp_path, script):
    data = records_file(tmp_path / "d.jsonl")
    write_jsonl(tmp_path / "c.jsonl", [{"index": 0, "completion": "x"}])
    out = tmp_path / "mine"
    out.mkdir()
    (out / "train.jsonl").write_text("the user's own\n")
    (out / ".DS_Store").write_text("hidden: no output is named so")
    message = error_of(capsys, SCRIPTS[script].main, usage_argv(script, data, out))
    assert f"--out {out} holds files no run of {script} wrote (train.jsonl)" in message
    assert "--overwrite" in message and (out / "train.jsonl").read_text() == "the user's own\n"
    assert not (out / "config.json").exists()


def test_overwrite_writes_into_a_folder_of_other_files_and_it_is_the_runs_from_then_on(tmp_path):
    out = tmp_path / "mine"
    out.mkdir()
    (out / "notes.txt").write_text("kept\n")
    s0.main(stage0_args(out, "--overwrite"))
    assert (out / "notes.txt").read_text() == "kept\n" and (out / "train.jsonl").exists()
    s0.main(stage0_args(out, "--resume"))  # the folder is stage 0's now: its lock file says so


@pytest.mark.parametrize("script", ["stage0_build.py", "stage1_sft.py", "evaluate.py"])
def test_a_second_run_into_a_folder_in_use_is_refused(capsys, tmp_path, script):
    data = records_file(tmp_path / "d.jsonl")
    out = tmp_path / "busy"
    fd = holding_the_lock(out, script)
    try:
        message = error_of(capsys, SCRIPTS[script].main, usage_argv(script, data, out))
    finally:
        os.close(fd)
    assert f"--out {out} is in use by another run ({script}, process 4242)" in message
    assert sorted(p.name for p in out.iterdir()) == [LOCK_NAME]  # nothing written beside it
    SCRIPTS[script].main(usage_argv(script, data, out))  # the other run ended: its lock is gone


def test_a_lock_file_left_by_a_dead_run_is_no_obstacle(tmp_path):
    """The kernel drops a flock with its process (kill -9 too): a lock file naming a process that is
    gone is not held, and the next run takes it."""
    data = records_file(tmp_path / "d.jsonl")
    out = tmp_path / "sft"
    out.mkdir()
    (out / LOCK_NAME).write_text(json.dumps({"script": "stage1_sft.py", "pid": 999_999_999}))
    stage1_sft.main(stage1_args(data, out))
    assert json.loads((out / LOCK_NAME).read_text()) == {"script": "stage1_sft.py", "pid": os.getpid()}


def test_two_concurrent_sft_runs_into_one_folder_one_is_refused(tmp_path):
    """Two SFT processes started together into one --out. One trains; the other is refused in one
    line (or, started after the first ended, is refused as a second run without --resume): never
    two runs writing one folder."""
    data = records_file(tmp_path / "d.jsonl")
    out = tmp_path / "c"
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    procs = [
        subprocess.Popen(
            [
                sys.executable,
                "stage1_sft.py",
                *stage1_args(data, out, "--seed", str(seed)),
                "--max-steps",
                "6",
            ],
            cwd=REPO,
            env=env,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.PIPE,
            text=True,
        )  # fmt: skip
        for seed in (0, 1)
    ]
    results = [(p.wait(timeout=600), p.stderr.read()) for p in procs]
    assert sorted(code for code, _ in results) == [0, 1], results
    refused = next(err for code, err in results if code == 1)
    assert "Traceback" not in refused and (
        "is in use by another run (stage1_sft.py" in refused
        or "already holds a run of stage1_sft.py" in refused
    )
    seed = json.loads((out / "config.json").read_text())["seed"]
    assert json.loads((out / "checkpoint" / "trainer_state.json").read_text())["config"]["seed"] == seed


# ---- every --resume refuses what it cannot continue ------------------------------------------------
def test_evaluate_resume_with_other_data_is_refused(capsys, tmp_path):
    data = records_file(tmp_path / "d.jsonl")
    other = records_file(tmp_path / "other.jsonl", n=2)
    out = tmp_path / "eval"
    evaluate.main(usage_argv("evaluate.py", data, out))
    before = fingerprint(out)
    message = error_of(capsys, evaluate.main, [*usage_argv("evaluate.py", other, out), "--resume"])
    assert message.startswith(f"error: --resume with other --data than the evaluation in {out}: data (")
    assert f"'{data}' there, '{other}' now" in message and "--overwrite" in message
    assert fingerprint(out) == before
    # the same file corrected in place goes on (the changed records are answered again), with a note
    write_jsonl(data, [hand_record(i, price=99) for i in range(3)])
    capsys.readouterr()
    evaluate.main([*usage_argv("evaluate.py", data, out), "--resume"])
    assert f"note: {data} changed since the evaluation in {out}" in capsys.readouterr().out


def test_stage0_resume_with_another_config_is_refused(capsys, tmp_path):
    out = tmp_path / "data"
    s0.main(stage0_args(out, "--seed", "1"))
    before = fingerprint(out)
    message = error_of(capsys, s0.main, stage0_args(out, "--seed", "2", "--resume"))
    assert message == (
        f"error: --resume with another config than the build in {out}: seed (1 there, 2 now); "
        "--overwrite replaces that build"
    )
    assert fingerprint(out) == before
    s0.main(stage0_args(out, "--seed", "1", "--resume"))  # the same config: nothing to do
    assert "already built" in capsys.readouterr().out


def test_stage0_resume_takes_the_build_under_another_spelling_of_its_folder(capsys, tmp_path, monkeypatch):
    out = tmp_path / "data"
    s0.main(stage0_args(out, "--seed", "1"))
    before = fingerprint(out)
    monkeypatch.chdir(tmp_path)
    moved = tmp_path / "moved"
    for spelling in (f"{out}/", "./data", "data/.", None):
        if spelling is None:  # the folder moved since it was built
            out.rename(moved)
            spelling = str(moved)
        capsys.readouterr()
        s0.main(stage0_args(spelling, "--seed", "1", "--resume"))
        assert "already built with this config (--resume), nothing to do" in capsys.readouterr().out
    assert fingerprint(moved) == before


def test_stage1_resume_on_a_damaged_checkpoint_is_refused(capsys, tmp_path):
    data = records_file(tmp_path / "d.jsonl")
    out = tmp_path / "sft"
    stage1_sft.main(stage1_args(data, out, "--max-steps", "1"))
    state = (out / "checkpoint" / "trainer_state.pt").read_bytes()
    (out / "checkpoint" / "trainer_state.pt").unlink()
    before = fingerprint(out)
    message = error_of(capsys, stage1_sft.main, [*stage1_args(data, out), "--resume"])
    assert f"the checkpoint in {out / 'checkpoint'} is damaged (trainer_state.pt missing)" in message
    assert fingerprint(out) == before  # final/ is not rewritten by a run started afresh
    # garbage where the trainer state was: one line, and torch's advice (weights_only=False, which
    # would unpickle code) is not passed on
    (out / "checkpoint" / "trainer_state.pt").write_bytes(b"\x80\x04garbage, not a checkpoint")
    message = error_of(capsys, stage1_sft.main, [*stage1_args(data, out), "--resume"])
    assert f"{out / 'checkpoint' / 'trainer_state.pt'} cannot be read (" in message
    assert "damaged" in message and "weights_only" not in message
    (out / "checkpoint" / "trainer_state.json").write_text("{not json")
    message = error_of(capsys, stage1_sft.main, [*stage1_args(data, out), "--resume"])
    assert "trainer_state.json cannot be read (JSONDecodeError)" in message
    # put back, the run continues
    (out / "checkpoint" / "trainer_state.pt").write_bytes(state)
    (out / "checkpoint").rename(tmp_path / "kept")
    stage1_sft.main([*stage1_args(data, out), "--resume"])  # no checkpoint at all: starts afresh, as before


def tiny_model_folder(path, scale=None) -> Path:
    """tiny-random saved as a model folder; `scale` multiplies its weights (other weights, same path)."""
    import torch

    from srt.loading import load_model_and_tokenizer

    model, tokenizer = load_model_and_tokenizer("tiny-random", dtype="float32")
    if scale is not None:
        with torch.no_grad():
            for p in model.parameters():
                p.mul_(scale)
    model.save_pretrained(path, safe_serialization=True)
    tokenizer.save_pretrained(path)
    return Path(path)


def test_stage2_resume_checks_the_model_by_its_files_not_its_path(capsys, tmp_path):
    data = records_file(tmp_path / "d.jsonl")
    model = tiny_model_folder(tmp_path / "sft-final")
    out = tmp_path / "grpo"
    argv = [*stage2_args(data, out), "--model", str(model)]
    stage2_grpo.main(argv)
    recorded = json.loads((out / "config.json").read_text())["model_sha256"]
    assert isinstance(recorded, str) and len(recorded) == 64
    tiny_model_folder(model, scale=1.5)  # other weights at the same path
    before = fingerprint(out)
    message = error_of(capsys, stage2_grpo.main, [*argv, "--max-steps", "2", "--resume"])
    assert message.startswith("error: --resume with another model (--model, by path or by its files' sha256)")
    assert f"than the checkpoint in {out / 'checkpoint'}: model_sha256 ({recorded[:12]}... there" in message
    assert fingerprint(out) == before


def test_stage2_resume_after_a_log_was_deleted_is_refused(capsys, tmp_path):
    data = records_file(tmp_path / "d.jsonl")
    out = tmp_path / "grpo"
    stage2_grpo.main(stage2_args(data, out, "--sample-every", "1"))
    assert (out / "samples.jsonl").read_text()
    (out / "samples.jsonl").unlink()
    before = fingerprint(out)
    message = error_of(capsys, stage2_grpo.main, [*stage2_args(data, out, "--sample-every", "1"),
                                                  "--max-steps", "2", "--resume"])  # fmt: skip
    assert (
        f"--resume: {out / 'samples.jsonl'} is gone, but the checkpoint in {out / 'checkpoint'} is at step 1"
        in message
    )
    assert fingerprint(out) == before


# ---- silent on nonsense --------------------------------------------------------------------------
def test_stage0_drops_a_record_whose_evidence_turn_holds_a_marker_and_counts_it(tmp_path):
    """A turn of H* is copied verbatim into the target's <HIS> tag: a '</think>' or '<HIS>' in it
    makes the record's own reference fail the format check (Eq. (5))."""
    from srt.completion import is_valid_format
    from srt.prompt import format_target

    dialogues = generate_synthetic(24, seed=0)
    marked = 0
    for d, marker in zip(dialogues[::2], ["</think>", "<HIS>", "</HIS>"] * 12):
        for r in d["rounds"]:
            for label in (r.get("gold") or {}).get("recall", []):
                side = "user" if label[0] == "Q" else "assistant"
                rnd = d["rounds"][int(label[1:]) - 1]
                if marker not in rnd[side]:
                    rnd[side] += f" (see {marker} here)"
                    marked += 1
    assert marked
    raw = tmp_path / "raw.jsonl"
    write_jsonl(raw, dialogues)
    out = tmp_path / "s0"
    s0.main(["--source", "jsonl", "--input", str(raw), *stage0_args(out)])
    records = [json.loads(line) for name in ("train", "dev", "test") for line in open(out / f"{name}.jsonl")]
    assert records and all(is_valid_format(format_target(r)) for r in records)
    dropped = json.loads((out / "stats.json").read_text())["dropped"]
    assert dropped.get("verification:markup_in_target", 0) >= 1


def test_a_negated_answer_earns_no_keys_reward_and_no_accuracy():
    from srt.metrics import accuracy
    from srt.prompt import format_target

    record = hand_record(0)  # answer "$20", keys ["$20"]

    def keys_reward(answer):
        completion = format_target({**record, "answer": answer})
        return reward.compute_rewards([completion], [record], "keys")[0]

    for negated in ("The hiking backpack was not $20.", "It wasn't $20.", "It is never $20", "No $20 fee"):
        scored = keys_reward(negated)
        assert scored["answer"] == -1.0 and scored["keys_present"] == [False], negated
        assert accuracy(negated, record) == 0.0
    for affirmed in (
        "The hiking backpack was $20.",
        "No, it was $20.",
        "Not much: $20.",
        "It is $20, not more.",
    ):
        assert keys_reward(affirmed)["answer"] == 1.0, affirmed
        assert accuracy(affirmed, record) == 1.0
    # a reference that denies the key itself lets the answer deny it too
    denied = {**record, "answer": "The store is not open on Friday.", "answer_keys": ["Friday"]}
    assert accuracy("It is not open on Friday.", denied) == 1.0


@pytest.mark.parametrize(
    "options, says",
    [
        ('{"capcity": 4}', "unknown cuemem option 'capcity'; the known ones: extractor, window"),
        ('{"capacity": 0}', "cuemem option capacity must be an integer >= 1 or null, got 0"),
        ('{"capacity": -1}', "cuemem option capacity must be an integer >= 1 or null, got -1"),
        ('{"max_age": 0}', "cuemem option max_age must be an integer >= 1 or null, got 0"),
        ('{"top_k": "8"}', 'cuemem option top_k must be an integer >= 1, got "8"'),
        ('{"temporal_decay": 2}', "cuemem option temporal_decay must be a number in [0.0, 1.0], got 2"),
        ('{"use_graph": 1}', "cuemem option use_graph must be true or false, got 1"),
    ],
)
def test_cuemem_options_are_checked(capsys, tmp_path, options, says):
    out = tmp_path / "e"
    argv = ["--compare", "cm=cuemem:tiny-random", "--variant-options", f'cm={{"cuemem": {options}}}']
    message = error_of(capsys, evaluate.main, [*argv, "--out", str(out)])
    assert says in message
    message = error_of(capsys, evaluate.main, ["--cuemem-options", options, "--out", str(out)])
    assert message.startswith("error: --cuemem-options: ") and says in message
    assert not out.exists()


@pytest.mark.parametrize(
    "script, argv, says",
    [
        ("stage1_sft.py", ["--max-steps", str(10**11)], "--max-steps: must be <= 1000000, got 100000000000"),
        ("stage2_grpo.py", ["--max-steps", "100000000000"], "--max-steps: must be <= 1000000"),
        ("stage0_build.py", ["--num-dialogues", str(10**20)], "--num-dialogues: must be <= 100000"),
        ("stage0_build.py", ["--num-dialogues", "1e20"], "--num-dialogues: invalid int value: '1e20'"),
        ("stage1_sft.py", ["--batch-size", "100000"], "--batch-size: must be <= 1024, got 100000"),
        ("stage1_sft.py", ["--epochs", "100000000"], "--epochs: must be <= 1000"),
        ("evaluate.py", ["--batch-size", "100000"], "--batch-size: must be <= 1024, got 100000"),
        ("evaluate.py", ["--max-new-tokens", "1000000000"], "--max-new-tokens: must be <= 32768"),
        ("stage2_grpo.py", ["--max-new-tokens", "1000000000"], "--max-new-tokens: must be <= 32768"),
        ("cuemem.py", ["--max-new-tokens", "1000000000"], "--max-new-tokens: must be <= 32768"),
        ("cuemem.py", ["--max-age", "0"], "argument --max-age: must be >= 1, got 0"),
        ("stage1_sft.py", ["--seed", str(2**40)], "argument --seed: must be <= 4294967295"),
    ],
)  # fmt: skip
def test_sizes_without_an_upper_bound_are_refused_with_the_figure(capsys, tmp_path, script, argv, says):
    out = tmp_path / "out"
    assert says in error_of(capsys, SCRIPTS[script].main, [*argv, "--out", str(out)])
    assert not out.exists()


def test_stage1_epochs_that_make_too_many_steps_are_refused(capsys, tmp_path):
    """--epochs has its own ceiling, but 1,000 epochs of enough records still pass it."""
    data = records_file(tmp_path / "d.jsonl", n=600)
    argv = ["--model", "tiny-random", "--data", data, "--out", str(tmp_path / "sft"), "--batch-size", "1"]
    message = error_of(capsys, stage1_sft.main, [*argv, "--epochs", "1000"])
    assert (
        "--epochs 1000 of 600 records in batches of 1 make 1,200,000 steps, more than the 1,000,000"
        in message
    )


# ---- tracebacks turned into one line ------------------------------------------------------------
@pytest.mark.parametrize("script", ["stage0_build.py", "evaluate.py", "cuemem.py"])
def test_a_device_this_machine_lacks_is_one_line(capsys, tmp_path, monkeypatch, script):
    import torch

    out = tmp_path / "out"
    message = error_of(capsys, SCRIPTS[script].main, ["--device", "banana", "--out", str(out)])
    assert "argument --device: 'banana' is not a device: use cpu, cuda, cuda:N or mps" in message
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)  # a CPU-only torch
    message = error_of(capsys, SCRIPTS[script].main, ["--device", "cuda", "--out", str(out)])
    assert (
        "argument --device: cuda: this torch" in message and "sees no CUDA GPU; use --device cpu" in message
    )
    assert not out.exists()


def test_a_truncated_safetensors_is_one_line(capsys, tmp_path):
    model = tiny_model_folder(tmp_path / "model")
    weights = model / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[: weights.stat().st_size // 2])
    data = records_file(tmp_path / "d.jsonl")
    argv = [*usage_argv("evaluate.py", data, tmp_path / "e"), "--model", str(model)]
    message = error_of(capsys, evaluate.main, argv)
    assert f"error: model {model}: its *.safetensors cannot be read (" in message and "cut short" in message
    message = error_of(capsys, stage2_grpo.main, [*stage2_args(data, tmp_path / "g"), "--model", str(model)])
    assert "its *.safetensors cannot be read" in message


def test_answer_keys_that_are_not_strings_and_a_meta_that_is_not_an_object_name_file_line_field(
    capsys, tmp_path
):
    data = tmp_path / "d.jsonl"
    write_jsonl(data, [hand_record(0), {**hand_record(1), "answer_keys": [21]}])
    for script in ("evaluate.py", "reward.py", "stage1_sft.py", "cuemem.py"):
        argv = (
            ["--data", str(data)]
            if script == "reward.py"
            else usage_argv(script, str(data), tmp_path / script)
        )
        message = error_of(capsys, SCRIPTS[script].main, argv)
        assert f"{data}:2: field 'answer_keys[0]' must be a string, got int" in message, script
    raw = tmp_path / "raw.jsonl"
    dialogues = generate_synthetic(3, seed=0)
    for bad, says in (
        ({"meta": 5}, "field 'meta' must be an object, got int"),
        ("answer_keys", "field 'rounds[{k}].gold.answer_keys[0]' must be a string"),
    ):
        rows = [dict(d) for d in dialogues]
        if bad == "answer_keys":
            k = next(k for k, r in enumerate(rows[1]["rounds"]) if "gold" in r)
            rows[1]["rounds"] = [dict(r) for r in rows[1]["rounds"]]
            rows[1]["rounds"][k] = {
                **rows[1]["rounds"][k],
                "gold": {**rows[1]["rounds"][k]["gold"], "answer_keys": [106]},
            }
            says = says.format(k=k)
        else:
            rows[1] = {**rows[1], **bad}
        write_jsonl(raw, rows)
        message = error_of(
            capsys, s0.main, ["--source", "jsonl", "--input", str(raw), *stage0_args(tmp_path / "s0")]
        )
        assert f"{raw}:2: {says}" in message


def bench_script(name):
    """The benchmark script called `name`, as a module. Its helpers import from bench/
    (bench/measure.py), which only the script's own run puts on sys.path: without this, the test
    passed only after another had."""
    import importlib.util

    if str(REPO / "bench") not in sys.path:
        sys.path.insert(0, str(REPO / "bench"))
    spec = importlib.util.spec_from_file_location(f"bench_{name}", REPO / "bench" / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.mark.parametrize(
    "name, argv",
    [
        ("pair_evals", ["a.jsonl", "b.jsonl"]),
        ("pool_replicates", ["result.json"]),
        ("grpo_seeds", ["--eval", "e", "--sft", "sft"]),
        ("sft_step", ["--model", "tiny-random", "--data", "d.jsonl"]),
        ("precision", ["--data", "d.jsonl"]),
        ("rollout_speed", ["--synthetic", "3"]),
        ("sampler_mismatch", ["--synthetic", "3"]),
        ("eval_latency", ["--synthetic", "3"]),
    ],
)
def test_a_bench_out_that_is_a_file_is_refused_before_the_benchmark_runs(tmp_path, monkeypatch, name, argv):
    module = bench_script(name)
    out = tmp_path / "taken"
    out.write_text("precious\n")
    monkeypatch.chdir(
        tmp_path
    )  # the inputs named above do not exist: a check after reading them would say so
    with pytest.raises(SystemExit) as stop:
        module.main([*argv, "--out", str(out)])
    assert stop.value.code == f"error: --out {out} is a file, not a folder"
    assert out.read_text() == "precious\n"


# ---- Ctrl-C: one line saying what is saved and how to go on, exit status 130 ----------------------
def interrupt(*args, **kwargs):
    raise KeyboardInterrupt


def interrupted_line(capsys, main, argv) -> str:
    with pytest.raises(SystemExit) as stop:
        main(argv)
    assert stop.value.code == 130
    err = capsys.readouterr().err
    last = err.strip().splitlines()[-1]  # after the progress bars
    assert "Traceback" not in err and last.startswith("interrupted: "), err
    return last


def test_ctrl_c_in_every_stage_is_one_line_saying_how_to_go_on(capsys, tmp_path, monkeypatch):
    data = records_file(tmp_path / "d.jsonl")
    write_jsonl(tmp_path / "c.jsonl", [{"index": 0, "completion": "x"}])

    monkeypatch.setattr(s0, "annotate_dialogues", interrupt)
    line = interrupted_line(capsys, s0.main, stage0_args(tmp_path / "s0"))
    assert "run the same command again" in line

    real_loss, calls = stage1_sft.sft_loss_sums, []

    def loss_then_interrupt(*args, **kwargs):  # the second step is interrupted, after step 1's save
        calls.append(1)
        if len(calls) > 1:
            raise KeyboardInterrupt
        return real_loss(*args, **kwargs)

    monkeypatch.setattr(stage1_sft, "sft_loss_sums", loss_then_interrupt)
    sft = tmp_path / "sft"
    line = interrupted_line(capsys, stage1_sft.main, stage1_args(data, sft, "--save-every", "1"))
    assert line == (
        f"interrupted: {sft / 'checkpoint'} holds step 1; the same command with --resume continues from there"
    )
    monkeypatch.setattr(stage1_sft, "sft_loss_sums", real_loss)
    stage1_sft.main([*stage1_args(data, sft), "--resume"])  # and it does (the lock was released)

    monkeypatch.setattr(stage2_grpo, "grpo_step", interrupt)
    grpo = tmp_path / "grpo"
    line = interrupted_line(capsys, stage2_grpo.main, stage2_args(data, grpo))
    assert f"no checkpoint in {grpo / 'checkpoint'} yet" in line and "--resume starts afresh" in line

    monkeypatch.setattr(evaluate, "generate_batch", interrupt)
    line = interrupted_line(capsys, evaluate.main, usage_argv("evaluate.py", data, tmp_path / "e"))
    assert "<variant>.jsonl" in line and "--resume goes on from them" in line

    monkeypatch.setattr(cuemem, "recall_metrics", interrupt)
    line = interrupted_line(capsys, cuemem.main, usage_argv("cuemem.py", data, tmp_path / "cm"))
    assert "predictions.jsonl" in line and (tmp_path / "cm" / "predictions.jsonl").exists()

    monkeypatch.setattr(reward, "compute_rewards", interrupt)
    line = interrupted_line(capsys, reward.main, usage_argv("reward.py", data, tmp_path / "r"))
    assert "nothing was written" in line


def test_ctrl_c_exits_130_without_a_traceback_in_a_real_process(tmp_path):
    code = (
        "import sys, stage0_build as s\n"
        "def stop(*a, **k): raise KeyboardInterrupt\n"
        "s.read_source = stop\n"
        f"s.main({stage0_args(tmp_path / 'd')!r})\n"
    )
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    proc = subprocess.run([sys.executable, "-c", code], cwd=REPO, env=env, capture_output=True, text=True)
    assert proc.returncode == 130 and "Traceback" not in proc.stderr, proc.stderr
    assert proc.stderr.strip().startswith("interrupted: a build is published whole")


@pytest.mark.parametrize("script", ["stage1_sft.py", "evaluate.py"])
def test_ctrl_c_while_a_script_still_loads_torch_is_one_line(tmp_path, script):
    """The real torch loads for seconds; a stand-in that says so and waits makes the moment certain."""
    from srt import startup

    slow = tmp_path / "slow"
    slow.mkdir()
    (slow / "torch.py").write_text(
        "import sys, time\nprint('loading', file=sys.stderr, flush=True)\ntime.sleep(120)\n"
    )
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(slow)}
    proc = subprocess.Popen(
        [sys.executable, script, "--help"],
        cwd=REPO,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        # a suite started in the background by a shell without job control inherits SIGINT ignored,
        # and Python then never raises KeyboardInterrupt: the child gets the terminal's default back
        preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL),
    )
    try:
        assert proc.stderr.readline() == "loading\n"
        proc.send_signal(signal.SIGINT)
        out, err = proc.communicate(timeout=120)
    finally:
        proc.kill()
    assert proc.returncode == 130 and "Traceback" not in err and not out, err
    assert err.strip() == f"interrupted: {script} was still loading its libraries; it had done nothing"
    assert startup.started_script() is None  # a script imported here (by pytest) changes nothing


# ================================================================================================
# No flag writes outside its run or over the user's files; every input is read as the user meant it
# ================================================================================================
def evaluate_argv(data, out, *extra):
    return [*usage_argv("evaluate.py", str(data), out), *extra]


@pytest.mark.parametrize("name", ["../../victim/full", "sub/full", "x.latency", "", "a b"])
def test_a_compare_name_is_plain_so_its_files_stay_in_out_and_apart(capsys, tmp_path, name):
    """A name is the stem of the variant's files: '../x' would write outside --out, 'a/b' into a
    subfolder, and 'x.latency' onto x.latency.jsonl, variant x's latency rows."""
    out = tmp_path / "e"
    argv = ["--compare", "x=full:tiny-random", f"{name}=full:tiny-random", "--out", str(out)]
    message = error_of(capsys, evaluate.main, argv)
    assert "a name is letters, digits, '-' and '_'" in message or "is not NAME=METHOD:MODEL" in message
    assert not out.exists() and not (tmp_path / "victim").exists()
    assert [
        v["name"] for v in evaluate.resolve_config(["--compare", "grpo-copy_2=srt:tiny-random"]).variants
    ] == ["grpo-copy_2"]


def test_two_records_under_one_id_are_refused_with_both_lines(capsys, tmp_path):
    data = tmp_path / "d.jsonl"
    longer = {**hand_record(0, rounds=8), "id": hand_record(0)["id"]}  # 8 rounds and 6, one id
    write_jsonl(data, [hand_record(0), hand_record(1), longer])
    out = tmp_path / "e"
    message = error_of(capsys, evaluate.main, evaluate_argv(data, out))
    assert f"{data}:3: field 'id' 'hand-000-t06' is also the id of line 1" in message
    assert not out.exists()


@pytest.mark.parametrize(
    "extra, says",
    [
        (["--pairs", "a:a"], "--pairs a:a compares a variant with itself"),
        (["--pairs", "a:b", "a:b"], "--pairs names a:b twice"),
        (["--table2", "SRT=a,SRT=b"], "--table2 names the row 'SRT' twice"),
        (["--table2", "=a"], "--table2 '=a' has no row name"),
        (["--variant-options", 'a={"limit": 1}', 'a={"rag_k": 2}'], "--variant-options names 'a' twice"),
    ],
)
def test_report_options_that_would_drop_or_break_a_row_are_refused_before_the_work(
    capsys, tmp_path, extra, says
):
    data = records_file(tmp_path / "d.jsonl")
    out = tmp_path / "e"
    argv = ["--compare", "a=full:tiny-random", "b=full:tiny-random", *extra]
    assert says in error_of(capsys, evaluate.main, evaluate_argv(data, out, *argv))
    assert not out.exists()


def test_explain_html_replaces_only_a_page_it_wrote(capsys, tmp_path):
    from srt.step_page import GENERATOR

    data = records_file(tmp_path / "dev.jsonl")
    argv = ["--explain", "--model", "tiny-random", "--data", data, "--explain-html"]
    message = error_of(capsys, stage2_grpo.parse_args, [*argv, data])
    assert f"--explain-html {data} holds a file that is not a page --explain wrote" in message
    assert "--overwrite" in message and json.loads(Path(data).read_text().splitlines()[0])
    message = error_of(capsys, stage2_grpo.parse_args, [*argv, str(tmp_path)])
    assert f"--explain-html {tmp_path} is a folder" in message
    stage2_grpo.parse_args([*argv, data, "--overwrite"])  # asked for: replaced
    page = tmp_path / "step.html"
    page.write_text(f"<!DOCTYPE html>\n<html><head>{GENERATOR}</head></html>\n")
    stage2_grpo.parse_args([*argv, str(page)])  # an earlier page: replaced
    page.write_text("<!DOCTYPE html>\n<style>.tok.clipped { outline: 2px solid #000; }</style>\n")
    stage2_grpo.parse_args([*argv, str(page)])  # a page written before the mark: replaced
    page.write_text("<html>the user's own page</html>\n")
    assert "is not a page --explain wrote" in error_of(capsys, stage2_grpo.parse_args, [*argv, str(page)])
    stage2_grpo.parse_args([*argv, str(tmp_path / "new.html")])


def test_a_file_saved_with_a_byte_order_mark_is_read(tmp_path):
    from srt.data_io import read_jsonl

    data = tmp_path / "excel.jsonl"
    data.write_bytes(b"\xef\xbb\xbf" + "".join(json.dumps(hand_record(i)) + "\n" for i in range(2)).encode())
    assert [r["id"] for r in read_jsonl(data)] == ["hand-000-t06", "hand-001-t06"]


@pytest.mark.parametrize(
    "change, says",
    [
        ({"query_turn": -5}, "field 'query_turn' must be >= 1, got -5"),
        ("label", "field 'history[1].label' 'Q1' is the label of an earlier turn"),
    ],
)
def test_a_record_with_an_impossible_turn_is_refused_with_its_field(tmp_path, change, says):
    from srt.data_io import DataError, read_jsonl

    record = hand_record(1)
    if change == "label":
        record["history"][1]["label"] = "Q1"
    else:
        record.update(change)
    data = tmp_path / "d.jsonl"
    write_jsonl(data, [hand_record(0), record])
    with pytest.raises(DataError, match=re.escape(f"{data}:2: {says}")):
        read_jsonl(data)


# ---- every --resume compares the settings that change its outputs --------------------------------
def test_cuemem_resume_with_other_data_or_settings_is_refused_naming_them(capsys, tmp_path):
    data = records_file(tmp_path / "dev.jsonl")
    other = records_file(tmp_path / "other.jsonl", n=4)
    out = tmp_path / "cm"
    cuemem.main(usage_argv("cuemem.py", data, out))
    before = fingerprint(out)
    message = error_of(capsys, cuemem.main, [*usage_argv("cuemem.py", other, out), "--resume"])
    assert f"--resume with different settings than the run in {out}: data (" in message
    message = error_of(capsys, cuemem.main, [*usage_argv("cuemem.py", data, out), "--top-k", "3", "--resume"])
    assert "top_k (8 there, 3 now)" in message and "data" not in message.split(": ", 2)[2]
    same_file = f"{tmp_path}/./dev.jsonl"  # the same bytes, the path spelled otherwise
    message = error_of(capsys, cuemem.main, [*usage_argv("cuemem.py", same_file, out), "--resume"])
    assert f"the files hold the same bytes: give --data as before, {data}, to continue" in message
    assert fingerprint(out) == before
    cuemem.main([*usage_argv("cuemem.py", data, out), "--resume", "--limit", "2"])  # may change


def test_cuemem_refuses_two_records_under_one_id(capsys, tmp_path):
    data = tmp_path / "d.jsonl"
    write_jsonl(data, [hand_record(0), hand_record(0)])
    message = error_of(capsys, cuemem.main, usage_argv("cuemem.py", str(data), tmp_path / "cm"))
    assert f"{data}:2: field 'id' 'hand-000-t06' is also the id of line 1" in message


def test_a_resume_in_another_precision_is_refused(capsys, tmp_path):
    data = records_file(tmp_path / "d.jsonl")
    out = tmp_path / "sft"
    stage1_sft.main(stage1_args(data, out))  # --dtype float32
    before = fingerprint(out)
    message = error_of(capsys, stage1_sft.main, [*stage1_args(data, out, "--dtype", "bfloat16"), "--resume"])
    assert f"--resume with different settings than the checkpoint in {out / 'checkpoint'}" in message
    assert "dtype ('float32' there, 'bfloat16' now)" in message
    respelled = f"{tmp_path}/./d.jsonl"  # the same bytes: the path as the run recorded it goes on
    message = error_of(capsys, stage1_sft.main, [*stage1_args(respelled, out), "--resume"])
    assert f"the files hold the same bytes: give --data as before, {data}, to continue" in message
    # a finished run whose checkpoint was deleted to save disk: its config.json is compared
    shutil.rmtree(out / "checkpoint")
    before = {k: v for k, v in before.items() if not k.startswith("checkpoint/")}
    message = error_of(capsys, stage1_sft.main, [*stage1_args(data, out, "--lr", "1e-2"), "--resume"])
    assert f"--resume with different settings than the finished run in {out} (its config.json" in message
    assert "lr (5e-06 there, 0.01 now)" in message
    assert fingerprint(out) == before
    capsys.readouterr()
    stage1_sft.main([*stage1_args(data, out), "--resume"])  # the same settings: finished, nothing to do
    assert "already holds a finished run" in capsys.readouterr().out


def test_stage2_finished_without_its_checkpoint_compares_its_config(capsys, tmp_path):
    import shutil

    data = records_file(tmp_path / "d.jsonl")
    out = tmp_path / "grpo"
    stage2_grpo.main(stage2_args(data, out))
    shutil.rmtree(out / "checkpoint")
    before = fingerprint(out)
    message = error_of(capsys, stage2_grpo.main, [*stage2_args(data, out, "--beta", "0.5"), "--resume"])
    assert f"than the finished run in {out} (its config.json; its checkpoint is gone): beta (" in message
    assert fingerprint(out) == before


def test_overwrite_clears_the_earlier_runs_checkpoint_before_it_writes(capsys, tmp_path, monkeypatch):
    """An --overwrite stopped before its first save leaves no checkpoint nor summary of the run it
    replaced: the interrupt line says so, and the first command's --resume trains afresh instead of
    calling an emptied run finished."""
    data = records_file(tmp_path / "d.jsonl")
    out = tmp_path / "sft"
    stage1_sft.main(stage1_args(data, out))
    monkeypatch.setattr(stage1_sft, "sft_loss_sums", interrupt)
    line = interrupted_line(capsys, stage1_sft.main, [*stage1_args(data, out, "--lr", "1e-3"), "--overwrite"])
    assert f"no checkpoint in {out / 'checkpoint'} yet" in line
    assert not (out / "checkpoint").exists() and not (out / "summary.json").exists()
    monkeypatch.undo()
    stage1_sft.main([*stage1_args(data, out), "--resume"])
    assert "already holds a finished run" not in capsys.readouterr().out
    config = json.loads((out / "config.json").read_text())
    steps = [json.loads(line)["step"] for line in open(out / "metrics.jsonl")]
    assert config["lr"] == 5e-6 and steps == list(range(1, len(steps) + 1)) and steps[-1] == 2


def test_a_log_that_disagrees_with_its_checkpoint_is_refused(capsys, tmp_path):
    data = records_file(tmp_path / "d.jsonl")
    out = tmp_path / "grpo"
    stage2_grpo.main(stage2_args(data, out))  # step 1, its checkpoint and its metrics line
    metrics = out / "metrics.jsonl"
    kept = metrics.read_text()
    resume = [*stage2_args(data, out), "--max-steps", "2", "--resume"]
    metrics.write_text("")  # emptied
    before = fingerprint(out)
    message = error_of(capsys, stage2_grpo.main, resume)
    assert (
        f"--resume: {metrics} ends at step 0, but the checkpoint in {out / 'checkpoint'} is at step 1"
        in message
    )
    assert fingerprint(out) == before
    metrics.write_text(kept + "{}\n")  # a line added by hand
    message = error_of(capsys, stage2_grpo.main, resume)
    assert f"{metrics}:2: a log line needs an integer field 'step'" in message


def test_stage0_resume_checks_the_builds_files_against_what_it_recorded(capsys, tmp_path):
    out = tmp_path / "data"
    s0.main(stage0_args(out))
    train = out / "train.jsonl"
    train.write_text("".join(train.read_text().splitlines(keepends=True)[:2]))  # cut by hand
    before = fingerprint(out)
    message = error_of(capsys, s0.main, stage0_args(out, "--resume"))
    assert f"--resume: {train} is not the file this build wrote (its sha256 differs" in message
    assert "--overwrite rebuilds it" in message and fingerprint(out) == before
    s0.main(stage0_args(out, "--overwrite"))
    capsys.readouterr()
    s0.main(stage0_args(out, "--resume"))  # the build as it wrote it
    assert "already built with this config" in capsys.readouterr().out


# ---- the last tracebacks ---------------------------------------------------------------------------
def test_a_lock_file_that_is_a_folder_is_one_line(capsys, tmp_path):
    data = records_file(tmp_path / "d.jsonl")
    out = tmp_path / "e"
    (out / LOCK_NAME).mkdir(parents=True)
    message = error_of(capsys, evaluate.main, evaluate_argv(data, out))
    assert f"--out {out}: its lock file {LOCK_NAME} is a folder" in message
    assert sorted(p.name for p in out.iterdir()) == [LOCK_NAME]


def test_bench_loss_family_ends_in_one_line_when_stage2_fails(tmp_path, monkeypatch):
    module = bench_script("loss_family")
    ran = []

    def stage2_fails(command, *args, **kwargs):  # stage 2 printed its own line and exited 1
        ran.append(command)
        return subprocess.CompletedProcess(command, 1)

    monkeypatch.setattr(module.subprocess, "run", stage2_fails)
    with pytest.raises(SystemExit) as stop:
        module.main(
            ["--model", str(tmp_path / "no-model"), "--out", str(tmp_path / "lf"), "--variants", "dapo"]
        )
    assert stop.value.code == "error: stage2_grpo.py of variant dapo failed; its error is above"
    assert len(ran) == 1


def test_bench_sft_step_with_a_folder_as_data_is_one_line(tmp_path, monkeypatch):
    monkeypatch.syspath_prepend(str(REPO / "bench"))  # its helpers (bench/measure.py)
    module = bench_script("sft_step")
    with pytest.raises(SystemExit) as stop:
        module.main(["--model", "tiny-random", "--data", str(tmp_path), "--out", str(tmp_path / "b")])
    assert stop.value.code.startswith(f"error: {tmp_path}: ") and "\n" not in stop.value.code


def test_pool_replicates_refuses_one_replicate_given_twice(tmp_path):
    module = bench_script("pool_replicates")
    per_query = {"ids": ["q0"], "start": {"jaccard": [0.0]}, "grpo": {"jaccard": [0.5]}}
    result = {"seed": 1, "differences": {}, "per_query": per_query}
    first, copy = tmp_path / "r1.json", tmp_path / "r1-copy.json"
    for path in (first, copy):
        path.write_text(json.dumps(result))
    for argv in ([str(first), str(first)], [str(first), f"{tmp_path}/./r1.json"], [str(first), str(copy)]):
        with pytest.raises(SystemExit) as stop:
            module.main([*argv, "--out", str(tmp_path / "pooled")])
        assert (
            stop.value.code == f"error: {argv[0]} and {argv[1]} are one replicate; give each replicate once"
        )
    assert not list((tmp_path / "pooled").glob("pooled.*"))  # nothing pooled


# ---- silent or vague no more -----------------------------------------------------------------------
def test_reward_refuses_an_empty_completions_file_and_a_record_scored_twice(capsys, tmp_path):
    data = records_file(tmp_path / "d.jsonl")
    completions = tmp_path / "c.jsonl"
    completions.write_text("")
    out = tmp_path / "r"
    argv = ["--data", data, "--completions", str(completions), "--out", str(out)]
    assert f"{completions} holds no completions; nothing to score" in error_of(capsys, reward.main, argv)
    assert not (out / "summary.json").exists()
    write_jsonl(completions, [{"id": "hand-001-t06", "completion": "x"}, {"index": 0, "completion": "y"},
                              {"index": 1, "completion": "z"}])  # fmt: skip
    message = error_of(capsys, reward.main, argv)
    assert f"{completions}:3: scores record 'hand-001-t06' again (line 1 did)" in message
    assert not (out / "summary.json").exists()


@pytest.mark.parametrize(
    "argv, says",
    [
        (["demo", "LESSON="], "LESSON is empty, which would put its runs at /"),
        (["table2", "TABLE2="], "TABLE2 is empty"),
        (["table2", "DATA= "], "DATA is empty"),
        (["grpo-replicate", "PLACEBO=yes"], "PLACEBO=yes: 1 adds a placebo run, 0 leaves it out"),
    ],
)
@pytest.mark.skipif(shutil.which("make") is None, reason="no make on this machine")
def test_make_refuses_an_empty_folder_and_an_unknown_placebo(argv, says):
    # make -n as a user types it: under `make test`, an inherited MAKELEVEL would make it a sub-make
    # that prints "Entering directory" on stdout
    env = {k: v for k, v in os.environ.items() if k not in ("MAKEFLAGS", "MAKELEVEL", "MFLAGS")}
    proc = subprocess.run(["make", "-n", *argv], cwd=REPO, capture_output=True, text=True, env=env)
    assert proc.returncode != 0 and says in proc.stderr and not proc.stdout, proc.stderr


@pytest.mark.parametrize(
    "script, argv, says",
    [
        ("stage2_grpo.py", ["-K", "4", "--num-generations", "8"], "-K and --num-generations set one setting"),
        ("stage1_sft.py", ["--target", "full", "--no-cot"], "--target and --no-cot set one setting (target)"),
        ("stage0_build.py", ["--path=a.json", "--input", "b.json"], "--path and --input set one setting"),
    ],
)
def test_one_setting_under_two_spellings_is_refused(capsys, tmp_path, script, argv, says):
    out = tmp_path / "out"
    assert says in error_of(capsys, SCRIPTS[script].main, [*argv, "--out", str(out)])
    assert not out.exists()


def test_a_bench_out_holding_the_users_files_is_refused(tmp_path, monkeypatch):
    monkeypatch.syspath_prepend(str(REPO / "bench"))
    from test_replicate import _result

    module = bench_script("pool_replicates")
    result = tmp_path / "r1.json"
    result.write_text(json.dumps(_result(1, [0.0, 0.25], [0.5, 0.5])))
    mine = tmp_path / "mine"
    mine.mkdir()
    (mine / "pooled.json").write_text("the user's own\n")
    with pytest.raises(SystemExit) as stop:
        module.main([str(result), "--out", str(mine)])
    assert (
        stop.value.code
        == f"error: --out {mine} holds files no benchmark wrote (pooled.json); give a new or empty folder"
    )
    assert (mine / "pooled.json").read_text() == "the user's own\n"
    module.main([str(result), "--out", str(tmp_path / "b")])
    module.main([str(result), "--out", str(tmp_path / "b")])  # its own folder: replaced


# ---- a run never loses what it reads -----------------------------------------------------------
@pytest.mark.parametrize("script", ["stage1_sft.py", "stage2_grpo.py"])
def test_overwrite_refuses_to_delete_the_model_it_trains_from(capsys, tmp_path, script):
    data = records_file(tmp_path / "d.jsonl")
    out = tmp_path / "run"
    args = stage1_args if script == "stage1_sft.py" else stage2_args
    SCRIPTS[script].main(args(data, out))
    before = fingerprint(out)
    for model in (out / "final", f"{out}/./final"):
        message = error_of(
            capsys, SCRIPTS[script].main, [*args(data, out), "--model", str(model), "--overwrite"]
        )
        assert f"--overwrite would delete {out / 'final'}, which holds --model {model}" in message
    assert fingerprint(out) == before


def test_evaluate_resume_with_another_setting_is_refused_naming_it(capsys, tmp_path):
    data = records_file(tmp_path / "d.jsonl")
    out = tmp_path / "e"
    evaluate.main(usage_argv("evaluate.py", data, out))  # --max-new-tokens-direct 2
    before = fingerprint(out)
    for extra, says in (
        (["--max-new-tokens-direct", "5"], "max_new_tokens_direct (2 there, 5 now)"),
        (["--dtype", "bfloat16"], "dtype ('auto' there, 'bfloat16' now)"),
        (["--variant-options", 'full={"recency_k": 2}'], "variant full: recency_k (4 there, 2 now)"),
    ):
        message = error_of(capsys, evaluate.main, [*usage_argv("evaluate.py", data, out), *extra, "--resume"])
        assert f"--resume with different settings than the evaluation in {out}: {says}" in message
        assert "--overwrite replaces its rows" in message
    assert fingerprint(out) == before
    capsys.readouterr()  # what only the report reads may change
    evaluate.main([*usage_argv("evaluate.py", data, out), "--bootstrap", "1000", "--resume"])


def test_evaluate_resume_with_a_smaller_limit_keeps_the_answered_rows(capsys, tmp_path):
    data = records_file(tmp_path / "d.jsonl", n=7)
    out = tmp_path / "e"
    evaluate.main(usage_argv("evaluate.py", data, out))
    before = fingerprint(out)
    message = error_of(
        capsys, evaluate.main, [*usage_argv("evaluate.py", data, out), "--resume", "--limit", "3"]
    )
    assert f"--resume --limit 3: {out / 'full.jsonl'} holds 7 answered rows, 4 of them" in message
    assert fingerprint(out) == before
    small = tmp_path / "small"
    evaluate.main([*usage_argv("evaluate.py", data, small), "--limit", "3"])
    evaluate.main(
        [*usage_argv("evaluate.py", data, small), "--resume", "--limit", "5"]
    )  # a larger one goes on
    assert len((small / "full.jsonl").read_text().splitlines()) == 5


def test_a_model_folder_that_does_not_exist_is_not_read_as_a_hub_id(capsys, tmp_path, monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.chdir(tmp_path)
    data = records_file(tmp_path / "d.jsonl")
    (tmp_path / "out").mkdir()
    for model in ("./nomodel", "out/final", str(tmp_path / "nomodel")):
        message = error_of(capsys, stage1_sft.main, [*stage1_args(data, tmp_path / "s"), "--model", model])
        assert f"error: model folder {model} does not exist" in message and "hf download" not in message
    argv = [*evaluate_argv(data, tmp_path / "e"), "--compare", "s=srt:./nomodel"]
    assert "model folder ./nomodel does not exist" in error_of(capsys, evaluate.main, argv)
    assert not (tmp_path / "e" / "config.json").exists()


def test_exercises_out_at_a_bad_path_is_one_line_and_a_full_disk_leaves_nothing(
    capsys, tmp_path, monkeypatch
):
    from srt import exercises

    (tmp_path / "file").write_text("precious\n")
    (tmp_path / "link").symlink_to(tmp_path / "gone")
    for out, says in (
        (tmp_path / "file", "is a file, not a folder"),
        (tmp_path / "file" / "sub", f"{tmp_path / 'file'} is a file, not a folder"),
        (tmp_path / "link", f"is a link to {tmp_path / 'gone'}, which does not exist"),
        (tmp_path / ("x" * 300), "cannot write there (File name too long)"),
    ):
        assert exercises.main(["--out", str(out)]) == 2
        err = capsys.readouterr().err
        assert err.startswith(f"error: --out {out}") and says in err and err.count("\n") == 1, err
    assert "argument --out: is empty" in error_of(capsys, exercises.main, ["--out", ""])
    assert (tmp_path / "file").read_text() == "precious\n" and not (tmp_path / "gone").exists()
    real_copy, copied = shutil.copy2, []

    def copy_until_the_disk_is_full(src, dst):
        if len(copied) == 30:
            raise OSError(28, "No space left on device", str(dst))
        copied.append(dst)
        return real_copy(src, dst)

    monkeypatch.setattr(exercises.shutil, "copy2", copy_until_the_disk_is_full)
    out = tmp_path / "ex"
    assert exercises.main(["--out", str(out)]) == 2
    assert (
        capsys.readouterr().err
        == f"error: --out {out}: No space left on device; nothing of the copy was kept\n"
    )
    assert sorted(p.name for p in tmp_path.iterdir()) == ["file", "link"]  # no half copy, no staging folder


class FullDisk:
    """srt.data_io's `os`, whose files opened for writing under `folder` fail as on a full disk."""

    def __init__(self, folder):
        self.folder = str(folder)

    def __getattr__(self, name):
        return getattr(os, name)

    def fdopen(self, fd, *args, **kwargs):
        if os.readlink(f"/proc/self/fd/{fd}").startswith(self.folder):
            raise OSError(28, "No space left on device")
        return os.fdopen(fd, *args, **kwargs)


@pytest.mark.parametrize("script", sorted(SCRIPTS))
def test_a_full_disk_is_one_line_naming_the_file(capsys, tmp_path, monkeypatch, script):
    from srt import data_io

    data = records_file(tmp_path / "d.jsonl")
    write_jsonl(tmp_path / "c.jsonl", [{"index": 0, "completion": "x"}])
    out = tmp_path / "out"
    monkeypatch.setattr(data_io, "os", FullDisk(out))
    message = error_of(capsys, SCRIPTS[script].main, usage_argv(script, data, out))
    assert re.match(
        rf"error: {re.escape(str(out))}/[\w./]+: No space left on device; free some space", message
    )
    assert [p.name for p in out.iterdir() if p.name.startswith(".")] == [LOCK_NAME]  # no temporary left


def test_a_full_disk_at_a_checkpoint_leaves_the_one_before_whole(capsys, tmp_path, monkeypatch):
    from srt import data_io

    data = records_file(tmp_path / "d.jsonl")
    out = tmp_path / "sft"
    stage1_sft.main(stage1_args(data, out, "--max-steps", "1"))
    before = fingerprint(out / "checkpoint")
    monkeypatch.setattr(data_io, "os", FullDisk(out))
    message = error_of(capsys, stage1_sft.main, [*stage1_args(data, out, "--max-steps", "2"), "--resume"])
    assert "No space left on device; free some space: " in message
    assert f"{out / 'checkpoint'} holds step 1; the same command with --resume continues" in message
    assert fingerprint(out / "checkpoint") == before


def test_a_reward_in_a_file_not_named_py_is_read_as_python(capsys, tmp_path):
    text = tmp_path / "r.txt"
    shutil.copy(REPO / "docs" / "rewards" / "keyword_answer.py", text)
    capsys.readouterr()
    with pytest.raises(SystemExit) as stop:  # read and judged: keyword_answer loses to attacks (exit 1)
        reward.main(["--gallery", "--reward", str(text)])
    assert stop.value.code == 1
    assert f"compute_rewards of {text} on the reward-hacking gallery" in capsys.readouterr().out


def test_resume_with_another_attention_kernel_is_refused(capsys, tmp_path):
    data = records_file(tmp_path / "d.jsonl")
    out = tmp_path / "sft"
    stage1_sft.main(stage1_args(data, out, "--max-steps", "1"))
    before = fingerprint(out)
    resume = [*stage1_args(data, out, "--attention", "bf16_eager"), "--resume"]
    assert "attention ('sdpa' there, 'bf16_eager' now)" in error_of(capsys, stage1_sft.main, resume)
    shutil.rmtree(out / "checkpoint")  # a finished run: its config.json is compared
    before = {k: v for k, v in before.items() if not k.startswith("checkpoint/")}
    assert "attention ('sdpa' there, 'bf16_eager' now)" in error_of(capsys, stage1_sft.main, resume)
    assert fingerprint(out) == before


@pytest.mark.parametrize("script", ["stage1_sft.py", "stage2_grpo.py"])
def test_a_warmup_longer_than_any_run_is_refused(capsys, tmp_path, script):
    message = error_of(
        capsys, SCRIPTS[script].main, ["--warmup-steps", str(10**20), "--out", str(tmp_path / "o")]
    )
    assert "argument --warmup-steps: must be <= 1000000" in message


@pytest.mark.parametrize("script", sorted(set(SCRIPTS) - {"reward.py"}))  # reward.py has no --resume
def test_resume_and_overwrite_together_are_refused(capsys, tmp_path, script):
    data = records_file(tmp_path / "d.jsonl")
    out = tmp_path / "out"
    message = error_of(
        capsys, SCRIPTS[script].main, [*usage_argv(script, data, out), "--resume", "--overwrite"]
    )
    assert "--resume and --overwrite ask for opposites" in message and not out.exists()


def test_stage1_refuses_two_records_under_one_id(capsys, tmp_path):
    data = tmp_path / "d.jsonl"
    write_jsonl(data, [hand_record(0), hand_record(1), hand_record(0)])
    out = tmp_path / "sft"
    message = error_of(capsys, stage1_sft.main, stage1_args(data, out))
    assert f"{data}:3: field 'id' 'hand-000-t06' is also the id of line 1" in message
    assert not (out / "config.json").exists()


# ---- the benchmarks: their --out, their size, a full disk at their end -----------------------------
def test_a_bench_out_at_a_dangling_link_or_a_long_name_and_too_many_steps_are_one_line(
    capsys, tmp_path, monkeypatch
):
    monkeypatch.syspath_prepend(str(REPO / "bench"))
    module = bench_script("sft_step")
    (tmp_path / "link").symlink_to(tmp_path / "gone")
    long_name = tmp_path / ("x" * 300)
    for out, says in (
        (tmp_path / "link", f" is a link to {tmp_path / 'gone'}, which does not exist"),
        (long_name, ": cannot write there (File name too long)"),
    ):
        with pytest.raises(SystemExit) as stop:
            module.main(["--model", "tiny-random", "--data", "d.jsonl", "--out", str(out)])
        assert stop.value.code == f"error: --out {out}{says}"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["link"]
    argv = ["--data", "d.jsonl", "--steps", "1000000000", "--out", str(tmp_path / "b")]
    assert "argument --steps: must be <= 1000, got 1000000000" in error_of(capsys, module.main, argv)
    assert not (tmp_path / "b").exists()


def test_a_full_disk_at_a_benchmarks_end_prints_its_table_and_keeps_the_earlier_results(
    capsys, tmp_path, monkeypatch
):
    from srt import data_io

    monkeypatch.syspath_prepend(str(REPO / "bench"))
    module = bench_script("sft_step")
    import measure

    data = records_file(tmp_path / "d.jsonl", n=8)
    out = measure.check_out(tmp_path / "b")
    measure.write_results(out, "cpu-lesson-phase2-full", {"earlier": True}, "the earlier table\n")
    before = fingerprint(out)
    monkeypatch.setattr(data_io, "os", FullDisk(out))
    argv = ["--model", "tiny-random", "--data", data, "--steps", "1", "--optimizers", "fused",
            "--dtype", "float32", "--out", str(out)]  # fmt: skip
    with pytest.raises(SystemExit) as stop:
        module.main(argv)
    assert stop.value.code == (
        f"error: {out / 'cpu-lesson-phase2-full.json'}: No space left on device; the results are printed "
        f"above, not saved (what {out} held before is as it was)"
    )
    assert "| AdamW fused, sdpa, logsumexp |" in capsys.readouterr().out
    assert fingerprint(out) == before  # the earlier pair whole, no temporary file beside it


# ---- --explain-html: a folder it cannot write, a full disk ----------------------------------------
def test_explain_html_in_a_read_only_folder_is_refused_before_the_step(capsys, tmp_path, monkeypatch):
    """As root chmod cannot make a folder read-only: a write into it is made to fail instead."""
    import tempfile

    from srt import grpo_explain

    data = records_file(tmp_path / "d.jsonl")
    ro = tmp_path / "ro"
    ro.mkdir()
    real_mkstemp = tempfile.mkstemp

    def refuse_in_ro(*args, dir=None, **kwargs):
        if dir is not None and Path(dir) == ro:
            raise PermissionError(13, "Permission denied")
        return real_mkstemp(*args, dir=dir, **kwargs)

    def the_step(*args, **kwargs):
        raise AssertionError("the step ran before the page's folder was checked")

    monkeypatch.setattr(tempfile, "mkstemp", refuse_in_ro)
    monkeypatch.setattr(grpo_explain, "load_step", the_step)
    page = ro / "step.html"
    argv = ["--explain", "--model", "tiny-random", "--data", data, "--explain-html", str(page)]
    message = error_of(capsys, stage2_grpo.main, argv)
    assert message == f"error: --explain-html {page}: cannot write a page there (Permission denied)"
    assert not list(ro.iterdir())


def test_a_full_disk_at_the_explain_page_is_one_line_and_keeps_the_earlier_page(
    capsys, tmp_path, monkeypatch
):
    from srt import data_io
    from srt.step_page import GENERATOR

    data = records_file(tmp_path / "d.jsonl")
    page = tmp_path / "pages" / "step.html"
    page.parent.mkdir()
    page.write_text(f"<!DOCTYPE html>\n<html><head>{GENERATOR}</head>an earlier step</html>\n")
    before = fingerprint(page.parent)
    monkeypatch.setattr(data_io, "os", FullDisk(page.parent))
    argv = ["--explain", "--model", "tiny-random", "--data", data, "--explain-html", str(page), "-K", "2",
            "--max-new-tokens", "3", "--explain-tries", "1", "--dtype", "float32"]  # fmt: skip
    message = error_of(capsys, stage2_grpo.main, argv)
    assert message == (
        f"error: {page}: No space left on device; free some space: --explain saves no run, and an earlier "
        "page stays until a new one is whole; the same command runs it again"
    )
    assert fingerprint(page.parent) == before


@pytest.mark.parametrize("script", sorted(SCRIPTS))
def test_an_out_whose_name_is_too_long_is_one_line(capsys, tmp_path, script):
    data = records_file(tmp_path / "d.jsonl")
    write_jsonl(tmp_path / "c.jsonl", [{"index": 0, "completion": "x"}])
    out = tmp_path / ("x" * 300)
    message = error_of(capsys, SCRIPTS[script].main, usage_argv(script, data, out))
    assert message == f"error: --out {out}: cannot write there (File name too long)"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["c.jsonl", "d.jsonl"]


# ---- --attention bf16_eager where nothing is bf16 ---------------------------------------------------
def test_bf16_eager_in_an_fp32_run_says_it_is_eager_in_fp32(capsys, tmp_path, monkeypatch):
    data = records_file(tmp_path / "d.jsonl", n=8)
    note = (
        "note: --attention bf16_eager in an fp32 run ({}): nothing runs in bf16, so it is the eager "
        "attention kernel in fp32"
    )
    for dtype, why in (("float32", "--dtype float32"), ("auto", "--dtype auto, which is fp32 here")):
        out = tmp_path / f"sft-{dtype}"
        stage1_sft.main(
            [*stage1_args(data, out, "--attention", "bf16_eager", "--max-steps", "1"), "--dtype", dtype]
        )
        assert note.format(why) in capsys.readouterr().err
    monkeypatch.syspath_prepend(str(REPO / "bench"))
    module = bench_script("sft_step")
    out = tmp_path / "bench"
    module.main(["--model", "tiny-random", "--data", data, "--steps", "1", "--optimizers", "fused",
                 "--attention", "sdpa", "bf16_eager", "--dtype", "float32", "--out", str(out)])  # fmt: skip
    assert note.format("--dtype float32") in capsys.readouterr().err
    results = json.loads((out / "cpu-lesson-phase2-full.json").read_text())["results"]
    assert list(results) == [
        "AdamW fused, sdpa, logsumexp",
        "AdamW fused, bf16_eager in fp32 (no bf16), logsumexp",
    ]
