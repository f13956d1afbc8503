"""The one configuration pattern every script uses: argparse defaults that work, `--preset NAME`
applied with `parser.set_defaults(**PRESETS[NAME])` so that flags given on the command line win,
every numeric flag checked against its range, and the resolved configuration written next to the
outputs.

A numeric flag takes its range as its argparse `type`: `type=at_least(1)`, `type=positive(float)`,
`type=in_range(0.0, 1.0)`. argparse then rejects a bad value with one line that names the flag
(`error: argument --lr: must be > 0, got -1.0`), and `parse_config` applies the same check to the
values a preset sets, which argparse never converts. A flag several scripts share is added by
one function (add_out, add_seed, add_resume, ... below), so that its type and range are written
once; tests/test_flags.py checks that no flag name is defined twice.

Every script claims its --out before any work (`claim_out`): a folder it can write, holding no run
of another script nor files no run of its own wrote, an earlier run of its own only under --resume
(continue it) or --overwrite (replace it), and no run that is still going: the folder's lock file
(LOCK_NAME) is held by one process at a time. config.json names the script that wrote it.

A script's main runs its work inside `interruptible`: Ctrl-C ends it with one line saying what is
saved and how to go on (exit status 130), not a traceback, and the lock is released.
"""

from __future__ import annotations

import argparse
import contextlib
import errno
import fcntl
import json
import math
import os
import re
import sys
from pathlib import Path

from srt.data_io import data_spec, folder_write_error, write_json
from srt.exercise_list import exercise_that_raised, unfinished_exercise


class Bounded:
    """An argparse `type`: parse with `kind`, then require low <= value (or low < value when
    `strict`) and value <= high. A non-finite float (nan, inf) is always refused."""

    def __init__(self, kind=int, low=None, high=None, strict=False, ceiling=False):
        self.kind, self.low, self.high, self.strict = kind, low, high, strict
        self.ceiling = ceiling  # `high` caps a size: each side is named alone (up_to)
        self.__name__ = kind.__name__  # argparse names the type in its "invalid int value" message

    def describe(self, too_low: bool = False) -> str:
        if self.ceiling:
            return f">= {self.low}" if too_low else f"<= {self.high}"
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
            raise argparse.ArgumentTypeError(f"must be {self.describe(too_low)}, got {value}")
        return value

    def __call__(self, text: str):
        return self.check(self.kind(text))


def at_least(low, kind=int) -> Bounded:
    return Bounded(kind, low=low)


def up_to(high, low=1, kind=int) -> Bounded:
    """A size with a ceiling (the MAX_ values below): `low` <= value <= `high`, each side refused in
    its own words ("must be >= 1, got 0", "must be <= 1024, got 100000")."""
    return Bounded(kind, low=low, high=high, ceiling=True)


# Ceilings of the sizes a user types, each far above what any preset or the paper uses and below
# what ends in an allocation error or a run killed by the kernel: refused in one line with the figure.
MAX_STEPS = 1_000_000  # stage 1 lists a (phase, step) pair per step: 10^11 steps were killed at 24 GB
MAX_EPOCHS = 1_000  # stage 1 without --max-steps: epochs x batches per epoch steps
MAX_DIALOGUES = 100_000  # 20 x the paper preset's 5,000; stage 0 holds and embeds them all at once
MAX_BATCH = 1_024  # sequences in one forward: 1,024 of 1,024 tokens keep hundreds of GB of activations
MAX_NEW_TOKENS = 32_768  # the longest context of the models used here (Qwen2.5); the KV cache is sized by it


def positive(kind=float) -> Bounded:
    return Bounded(kind, low=0, strict=True)


def in_range(low, high, kind=float) -> Bounded:
    return Bounded(kind, low=low, high=high)


def parse_config(parser: argparse.ArgumentParser, presets: dict, argv=None) -> argparse.Namespace:
    """Parse `argv` with `--preset` applied: argparse default < preset < explicit flag. Every
    bounded flag's final value is checked, a preset's included."""
    parser.add_argument(
        "--preset",
        choices=sorted(presets),
        help="a named set of defaults (explicit flags win): " + ", ".join(sorted(presets)),
    )
    argv = sys.argv[1:] if argv is None else list(argv)
    refuse_two_spellings(parser, argv)
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


def refuse_two_spellings(parser: argparse.ArgumentParser, argv: list[str]) -> None:
    """One setting given under two of its spellings (-K and --num-generations, --target and --no-cot,
    --x and --no-x) is refused: argparse keeps the last without a word, whichever the user meant."""
    spellings = {}
    for token in argv:
        action = parser._option_string_actions.get(token.split("=", 1)[0])
        if action is not None and action.dest != "help":
            spellings.setdefault(action.dest, {})[token.split("=", 1)[0]] = None
    for dest, given in spellings.items():
        if len(given) > 1:
            parser.error(f"{' and '.join(given)} set one setting ({dest}); give it once")


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
    try:
        if not path.is_file():
            return None
    except OSError:  # a path that cannot name a file (too long): no run there; claim_out says why
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


# The lock file of an output folder: held (flock) by the run writing there, and naming its script
# and process. The kernel releases a flock when its process ends, however it ends (kill -9
# included), so a lock file left by a dead run is never mistaken for a live one.
LOCK_NAME = ".run.lock"
_HELD: dict[str, int] = {}  # resolved --out -> the open descriptor whose flock this process holds


def lock_owner(out) -> dict:
    """What the lock file of `out` says: {"script", "pid"} of the run that last held it, or {}."""
    try:
        owner = json.loads((Path(out) / LOCK_NAME).read_text())
    except (OSError, ValueError):
        return {}
    return owner if isinstance(owner, dict) else {}


def foreign_files(out: Path, script: str) -> list[str]:
    """The files and folders in `out` that no run of `script` wrote, by name: none when its lock
    file names `script` (a run of it began here: what it left is its own, finished or not).
    Hidden names are left out: no output of a script is one, so a run never replaces them."""
    if not out.is_dir() or lock_owner(out).get("script") == script:
        return []
    return sorted(p.name for p in out.iterdir() if not p.name.startswith("."))


def lock_out(out: Path, script: str) -> None:
    """Take the lock of `out` for this process, or exit with one line naming the run that holds it.
    Under torchrun rank 0 holds it for every rank. Released by release_out, or when the process
    ends; a later claim of the same folder by this process (a test running main twice) takes it anew."""
    if int(os.environ.get("RANK", "0")) != 0:
        return
    key = str(out.resolve())
    if key in _HELD:
        os.close(_HELD.pop(key))
    if (out / LOCK_NAME).is_dir():  # made by hand or another program: no run's lock
        sys.exit(
            f"error: --out {out}: its lock file {LOCK_NAME} is a folder; remove it, or give another --out"
        )
    fd = os.open(out / LOCK_NAME, os.O_RDWR | os.O_CREAT, 0o644)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:  # another process holds it
        os.close(fd)
        owner = lock_owner(out)
        who = f"{owner.get('script', 'a script')}, process {owner.get('pid', '?')}"
        sys.exit(
            f"error: --out {out} is in use by another run ({who}); wait for it to end or give another --out"
        )
    except OSError as e:  # a file system without locks (some network mounts): the run goes on unguarded
        print(f"note: --out {out} cannot be locked ({e.strerror}); nothing stops a second run into it")
    os.ftruncate(fd, 0)
    os.write(fd, json.dumps({"script": script, "pid": os.getpid()}).encode() + b"\n")
    _HELD[key] = fd


def release_out() -> None:
    """Release every --out lock this process holds (the end of a script's main)."""
    while _HELD:
        os.close(_HELD.popitem()[1])


def claim_out(
    out, script: str, resume: bool = False, overwrite: bool = False, resumable: bool = True
) -> Path:
    """Check --out before any work is done, and exit with one line if it will not do: a file, a
    folder that cannot be created or written, a folder holding another script's run (or a model)
    or files no run of `script` wrote (without --overwrite), one holding an earlier run of `script`
    when neither --resume (continue it; a `resumable` script's) nor --overwrite (replace it) is
    given, or one another run is writing to now. Creates the folder and takes its lock (lock_out);
    writes nothing else in it."""
    out = Path(out)
    if resume and overwrite:  # argparse takes both; one of them would be ignored without a word
        sys.exit(
            "error: --resume and --overwrite ask for opposites (continue the run in --out, replace it); "
            "give one"
        )
    try:
        os.stat(out)
    except (FileNotFoundError, NotADirectoryError):  # a folder to make; one under a file fails below
        pass
    except OSError as e:  # a name longer than the file system takes, a loop of links
        sys.exit(f"error: --out {out}: cannot write there ({e.strerror})")
    if out.exists() and not out.is_dir():
        sys.exit(f"error: --out {out} is a file, not a folder")
    writer = run_in(out)
    if writer is not None and writer != script:
        held = f"a run of {writer} (its config.json)" if writer.endswith(".py") else writer
        sys.exit(f"error: --out {out} holds {held}; give {script} a folder of its own")
    if writer == script and not (resume or overwrite):
        again = "--resume continues it, --overwrite replaces it" if resumable else "--overwrite replaces it"
        sys.exit(f"error: --out {out} already holds a run of {script} (its config.json); {again}")
    foreign = [] if writer == script or overwrite else foreign_files(out, script)
    if foreign:  # the user's own files: a run would replace those named like its outputs
        shown = ", ".join(foreign[:3]) + (f" and {len(foreign) - 3} more" if len(foreign) > 3 else "")
        sys.exit(
            f"error: --out {out} holds files no run of {script} wrote ({shown}); give a new or empty "
            "folder, or --overwrite to write into this one (files named like its outputs are replaced)"
        )
    why = folder_write_error(out)
    if why is not None:
        sys.exit(f"error: --out {out} is not a folder this run can write ({why})")
    lock_out(out, script)
    return out


def changed_settings(saved: dict, now: dict, keys=None) -> list[str]:
    """'key (value there, value now)' for each of `keys` (default: every key of either) whose value
    in `saved` (what a run recorded) differs from `now`: what a refused --resume names. A sha256
    is shown by its first 12 digits, a long value cut."""

    def shown(key, value):
        text = repr(value)
        if key.endswith("sha256") and isinstance(value, str):
            return f"{value[:12]}..."
        return text if len(text) <= 200 else text[:197] + "..."  # a path in full, not a long list

    keys = list(dict.fromkeys([*saved, *now])) if keys is None else keys
    return [
        f"{k} ({shown(k, saved.get(k))} there, {shown(k, now.get(k))} now)"
        for k in keys
        if saved.get(k) != now.get(k)
    ]


def same_bytes_hint(saved: dict, now: dict) -> str:
    """What a refused --resume adds when --data names the same bytes by another spelling of its path
    (./d.jsonl, an absolute path, a link): the path as the run recorded it, which goes on."""
    same_bytes = now.get("data_sha256") is not None and saved.get("data_sha256") == now["data_sha256"]
    if same_bytes and saved.get("data") != now.get("data"):
        given = " ".join(saved["data"]) if isinstance(saved["data"], list) else saved["data"]
        return f"; the files hold the same bytes: give --data as before, {given}, to continue"
    return ""


def changed_since(saved: dict, now: dict) -> str | None:
    """What a refused --resume names after its own first words: each key of `now` that `saved` (a
    finished run's config.json) records with another value, and the same-bytes hint; None when they
    agree. A key an older config.json lacks is not compared."""
    changed = [k for k in now if k in saved and saved[k] != now[k]]
    if not changed:
        return None
    return ", ".join(changed_settings(saved, now, changed)) + same_bytes_hint(saved, now)


@contextlib.contextmanager
def interruptible(saved, out=None):
    """The work of a script's main. Ctrl-C (KeyboardInterrupt) ends it with one line, `saved()`:
    what is on disk and how to go on (None: nothing to say, a torchrun rank but the first), and
    exit status 130 (the shell's for SIGINT), instead of a traceback. A full disk ends in one line
    too, naming the file (else `out`) and saying the same. However it ends, the --out lock is
    released. In a student's copy (srt/exercises.py), a blank the command reaches ends in one line
    naming its exercise ("reward.py calls reward.compute_rewards, exercise eq4, which is not done
    yet"), not in a traceback a student could take for a fault of their own code."""
    try:
        yield
    except NotImplementedError as e:
        if exercise_that_raised(e) is None:  # not an exercise's blank: a genuine fault, traceback kept
            raise
        sys.exit(f"error: {Path(sys.argv[0]).name} {unfinished_exercise(e)}")
    except KeyboardInterrupt:
        message = saved()
        if message:
            print(f"\ninterrupted: {message}", file=sys.stderr, flush=True)
        sys.exit(130)
    except OSError as e:
        if e.errno not in DISK_FULL:
            raise
        message = saved()
        sys.exit(
            f"error: {e.filename or out or 'a file'}: {e.strerror}; free some space"
            + (f": {message}" if message else "")
        )
    finally:
        release_out()


DISK_FULL = (errno.ENOSPC, errno.EDQUOT)  # no space left, a quota reached


def write_config(out, config, script: str | None = None) -> Path:
    """<out>/config.json: the resolved configuration of this run (argparse.Namespace or dict), and
    the script that wrote it (what claim_out reads)."""
    path = Path(out) / "config.json"
    config = dict(vars(config)) if isinstance(config, argparse.Namespace) else dict(config)
    write_json(path, {**({"script": script} if script else {}), **config})
    return path


# --------------------------------------------------------------------------------------------
# Flags several scripts share, each defined once here: its type, range and action. A script words
# the help where the flag means something of its own there (what --resume reuses, which records
# --limit takes). Elsewhere: the training scripts' groups in srt/run.py, --device and --dtype in
# srt/precision.py, --recall in srt/recall.py, --answer-reward in reward.py.
# --------------------------------------------------------------------------------------------
MAX_SEED = 2**32 - 1  # the largest seed numpy's legacy seeding takes (training.seed_everything)


def add_out(parser, default, help="output folder", type=None) -> None:
    parser.add_argument("--out", type=type, default=default, help=help)


def add_seed(parser, help="random seed", numpy_range: bool = False) -> None:
    """numpy_range: refuse a seed above MAX_SEED in one line (a script that seeds numpy's legacy
    generator); else any seed >= 0."""
    kind = up_to(MAX_SEED, low=0) if numpy_range else at_least(0)
    parser.add_argument("--seed", type=kind, default=0, help=help)


def add_resume(parser, help) -> None:
    parser.add_argument("--resume", action="store_true", help=help)


def add_overwrite(parser, help) -> None:
    parser.add_argument("--overwrite", action="store_true", help=help)


def add_model(parser, default, help) -> None:
    parser.add_argument("--model", default=default, help=help)


def add_data(parser, default, help, mixture: bool = False) -> None:
    """--data: a JSONL file of stage-0 records; with `mixture` (the training scripts) several files,
    each with a weight (srt/data_io.py mix_sources)."""
    many = dict(nargs="+", type=data_spec, metavar="PATH[:WEIGHT]") if mixture else {}
    mix = (
        "; several files with a weight each train on a mix (srt/data_io.py mix_sources), e.g. "
        "syn/train.jsonl:0.5 locomo/train.jsonl:0.5"
    )
    parser.add_argument("--data", default=default, help=help + (mix if mixture else ""), **many)


def add_limit(parser, help) -> None:
    parser.add_argument("--limit", type=at_least(1), default=None, help=help)


def add_batch_size(parser, default: int, help) -> None:
    parser.add_argument("--batch-size", type=up_to(MAX_BATCH), default=default, help=help)


def add_max_new_tokens(parser, default: int, help) -> None:
    parser.add_argument("--max-new-tokens", type=up_to(MAX_NEW_TOKENS), default=default, help=help)


def add_quiet(parser) -> None:
    parser.add_argument("--quiet", action="store_true", help="no progress bars")


def add_trust_remote_code(parser, help) -> None:
    parser.add_argument("--trust-remote-code", action="store_true", help=help)


def add_api_flags(parser, *, base_default=None, base_help: str, model: bool = True) -> None:
    """--api-base, --api-model (with `model`) and --api-key-env: an OpenAI-compatible endpoint, and
    the name of the variable that holds its key (env_var_name: never the key itself)."""
    parser.add_argument("--api-base", default=base_default, help=base_help)
    if model:
        parser.add_argument("--api-model", default=None, help="model name at --api-base")
    parser.add_argument(
        "--api-key-env",
        type=env_var_name,
        default="OPENAI_API_KEY",
        help="the name of the environment variable that holds the API key (never the key itself)",
    )
