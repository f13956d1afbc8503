"""Exercises generated from the code itself: a student copy of the project in which the functions
that implement the paper's equations have their bodies replaced by `raise NotImplementedError(...)`,
and a grader that runs each exercise's behaviour checks (tests/exercises/) on that copy.

There is no second copy of the code to keep in step: EXERCISES below is the one place that says
which functions are exercises, by "module:function" name, resolved when the copy is written. The
copy keeps each function's signature and docstring (its contract) and replaces only the lines of
its body, located with `ast`. docs/teaching.md gives the exercises in this order, in a class plan.

    python -m srt.exercises --out exercises/     # write the student copy (refuses a folder with files)
    python -m srt.exercises --grade exercises/   # PASS, or FAIL with what was checked and a hint
    python -m srt.exercises --list               # the exercises, in order

`make exercises` and `make grade` run the first two on exercises/.
"""

from __future__ import annotations

import argparse
import ast
import json
import os
import select
import shutil
import signal
import subprocess
import sys
import tempfile
import textwrap
import time
import tokenize
from pathlib import Path

from srt.config import add_out, up_to
from srt.exercise_list import EXERCISES, Exercise

PROJECT = Path(__file__).resolve().parents[1]
CHECKS = PROJECT / "tests" / "exercises"  # the checks always come from this project, never the copy
# An exercise's checks, from the first on, take a few seconds of CPU on tiny models: a minute of CPU
# is a loop that never ends (--time-limit changes it). CPU time, not the clock: on a busy machine (a
# class's shared server, a training run beside it) correct code takes longer by the clock, never by
# the CPU it uses. run_checks.py has the kernel end its process past the limit (RLIMIT_CPU).
TIME_LIMIT_S = 60
# Starting the checks' process and importing an exercise's module: CPU for torch and transformers,
# which are slow to load; only a module whose top level never ends uses it up.
LOAD_LIMIT_S = 300
# By the clock, for code that waits instead of computing (a sleep, a lock), which uses no CPU.
WAIT_LIMIT_S = 600


class ExerciseError(Exception):
    """A declared exercise cannot be found: its module's file or its function is missing."""


# ==== Locating a function's body with ast ====
def find_function(tree: ast.Module, name: str, where: str) -> ast.FunctionDef:
    """The module-level function `name` of `tree` (searched by name, so code moved around inside the
    module is still found)."""
    for node in tree.body:
        if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef) and node.name == name:
            return node
    raise ExerciseError(f"{where} has no function {name}: update EXERCISES in srt/exercises.py")


def body_lines(source: str, name: str, where: str = "the source") -> tuple[int, int, int]:
    """(first, last, indent): the 0-based line range of the function's body after its docstring
    (the lines the blank replaces, comments included) and the body's indentation."""
    node = find_function(ast.parse(source), name, where)
    body = node.body
    has_docstring = isinstance(body[0], ast.Expr) and isinstance(body[0].value, ast.Constant)
    has_docstring = has_docstring and isinstance(body[0].value.value, str)
    if has_docstring and len(body) == 1:
        raise ExerciseError(f"{where}: {name} has a docstring and no body")
    if body[0].lineno == node.lineno:
        raise ExerciseError(f"{where}: {name} is written on one line; give its body lines of its own")
    # The body starts after the docstring, or after the signature's closing ':' (the first ':' outside
    # brackets from the `def` on: a signature may span lines, and hold ':' in annotations and lambdas).
    first = body[0].end_lineno if has_docstring else signature_end(source, node.lineno)
    return first, node.end_lineno - 1, body[1 if has_docstring else 0].col_offset


def signature_end(source: str, def_line: int) -> int:
    """The 1-based line of the ':' that closes the signature of the `def` on line `def_line`."""
    depth = 0
    lines = source.splitlines(keepends=True)[def_line - 1 :]
    for token in tokenize.generate_tokens(iter(lines).__next__):
        if token.type == tokenize.OP and token.string in "([{":
            depth += 1
        elif token.type == tokenize.OP and token.string in ")]}":
            depth -= 1
        elif token.type == tokenize.OP and token.string == ":" and depth == 0:
            return def_line + token.start[0] - 1
    raise ExerciseError(f"no ':' closes the signature on line {def_line}")


def function_body(source: str, name: str) -> str:
    """The body of `name` after its docstring, dedented: what a blank replaces."""
    first, last, _ = body_lines(source, name)
    return textwrap.dedent("\n".join(source.splitlines()[first : last + 1])) + "\n"


def replace_body(source: str, name: str, new_body: str, where: str = "the source") -> str:
    """`source` with the body of function `name` (after its docstring) replaced by `new_body`
    (unindented code), indented to the function's body. Signature and docstring are kept."""
    first, last, indent = body_lines(source, name, where)
    lines = source.splitlines(keepends=True)
    body = textwrap.indent(textwrap.dedent(new_body).strip("\n") + "\n", " " * indent)
    return "".join(lines[:first]) + body + "".join(lines[last + 1 :])


def blank_body(exercise: Exercise) -> str:
    """raise NotImplementedError("Eq. (N), §x.y: hint"), its message cut into lines of the copy's width."""
    pieces = textwrap.wrap(exercise.message(), width=88, drop_whitespace=False)
    return (
        "raise NotImplementedError(\n"
        + "".join(f"    {json.dumps(p, ensure_ascii=False)}\n" for p in pieces)
        + ")\n"
    )


# ==== Writing the student copy ====
def tracked_files(root: Path) -> list[str]:
    """The project's files as git knows them: what a fresh clone holds, without runs/ or .venv/."""
    try:
        listing = subprocess.run(
            ["git", "ls-files", "-z"], cwd=root, capture_output=True, check=True, text=True
        ).stdout
    except (OSError, subprocess.CalledProcessError) as e:
        raise ExerciseError(f"cannot list the project's files with git ls-files in {root}: {e}") from e
    return [name for name in listing.split("\0") if name and (root / name).is_file()]


# Files a student's copy leaves out: they restate a blanked function another way (the k3 of the
# sampler bench and of test_rollout's sampler_mismatch by hand), check the whole project against
# itself (test_references names files the copy leaves out), or are the grader's own tests (they
# patch the solutions into wrong ones). The project's tests that use an exercise function are left
# out too (left_out): they quote its expected values and code, and in the copy the grader's checks
# are its tests.
LEFT_OUT = (
    "bench/sampler_mismatch.py",
    "tests/test_exercises.py",
    "tests/test_references.py",
    "tests/test_rollout.py",
    "tests/test_wrong_solutions.py",
)


def left_out(name: str, root: Path, exercises=EXERCISES) -> bool:
    if name in LEFT_OUT:
        return True
    if not (name.startswith("tests/test_") and name.endswith(".py")):
        return False
    tree = ast.parse((root / name).read_text(encoding="utf-8"))
    return any(uses(tree, e.name) for e in exercises)


def uses(tree: ast.Module, name: str) -> bool:
    """Does the code call, import or reach for (module.name) a function `name`? Its name as a word
    is not enough: a metric's key or a parameter may be spelled "jaccard" too."""
    for node in ast.walk(tree):
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Name):
            found = node.func.id  # jaccard(...); a bare name elsewhere may be a parameter's
        elif isinstance(node, ast.Attribute):
            found = node.attr  # metrics.jaccard
        elif isinstance(node, ast.alias):
            found = node.name  # from srt.metrics import jaccard
        else:
            continue
        if found == name:
            return True
    return False


def write_exercises(out: Path, root: Path = PROJECT, exercises=EXERCISES) -> list[Path]:
    """Copy the project's tracked files to `out`, but those left out (left_out), and blank every
    exercise's body there. The functions are resolved first, so a missing one stops before anything
    is written."""
    sources = {}
    for exercise in exercises:
        path = root / exercise.path
        if not path.is_file():
            raise ExerciseError(
                f"{exercise.key}: no module {exercise.path}: update EXERCISES in srt/exercises.py"
            )
        source = sources.get(path) or path.read_text(encoding="utf-8")
        sources[path] = replace_body(source, exercise.name, blank_body(exercise), str(exercise.path))
    try:
        check_out(out)
        staging = make_staging(out)
    except OSError as e:
        raise ExerciseError(f"--out {out}: cannot write there ({e.strerror})") from e
    try:
        for name in (n for n in tracked_files(root) if not left_out(n, root, exercises)):
            target = staging / name
            target.parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(root / name, target)
        for path, source in sources.items():
            (staging / path.relative_to(root)).write_text(source, encoding="utf-8")
        (staging / COPY_MARK).write_text(copy_readme(exercises), encoding="utf-8")
        os.replace(staging, out)  # whole or not at all: a half copy would be refused as a student's work
    except OSError as e:
        raise ExerciseError(f"--out {out}: {e.strerror}; nothing of the copy was kept") from e
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    return [out / e.path for e in exercises]


def check_out(out: Path) -> None:
    """--out is a new or empty folder, or a path under folders: a file or a dangling link in its
    place, or a file above it, ends in one line instead of the copy's traceback."""
    if out.is_symlink() and not out.exists():
        raise ExerciseError(f"--out {out} is a link to {os.readlink(out)}, which does not exist")
    if out.exists() and not out.is_dir():
        raise ExerciseError(f"--out {out} is a file, not a folder")
    if out.exists() and any(out.iterdir()):
        raise ExerciseError(
            f"{out} already holds files (a student's work?): remove it or choose another --out"
        )
    above = next(p for p in out.absolute().parents if p.exists())
    if not above.is_dir():
        raise ExerciseError(f"--out {out}: {above} is a file, not a folder")


def make_staging(out: Path) -> Path:
    """A hidden folder beside --out that the copy is written into, then renamed to --out."""
    out.absolute().parent.mkdir(parents=True, exist_ok=True)
    staging = out.absolute().parent / f".exercises-{os.getpid()}"
    shutil.rmtree(staging, ignore_errors=True)  # left by a killed copy of a process of this pid
    staging.mkdir()
    return staging


COPY_MARK = "EXERCISES.md"  # in a student's copy only: `make grade` there grades the copy itself


def copy_readme(exercises) -> str:
    """What a student finds at the top of the copy: what it is, how to grade it, the exercises."""
    rows = "\n".join(f"| {e.key} | `{e.path}:{e.name}` | {e.equation}, {e.section} |" for e in exercises)
    return (
        "# Exercises\n\nThis folder is the project with the functions that implement the paper's "
        "equations left blank: each raises `NotImplementedError` naming its equation, its section and "
        "a hint, and keeps its signature and docstring (its contract). Fill them in, in this order, "
        "and grade the folder from inside it, as often as you like:\n\n"
        "    make grade                           # or: python -m srt.exercises --grade .\n\n"
        "| exercise | function | equation |\n|---|---|---|\n" + rows + "\n"
    )


# ==== Grading a copy ====
def run_checks(folder: Path, exercises=EXERCISES, time_limit: float = TIME_LIMIT_S) -> list[dict]:
    """Run every exercise's checks on the code in `folder` -> one result per exercise: {key, passed,
    checked (what the failing check checks), error}. The checks run in a subprocess whose sys.path
    starts with `folder` (so `import stage2_grpo` is the student's), one exercise after another,
    each with `time_limit` seconds of CPU; an exercise whose code never returns or ends the process
    fails alone, and a fresh process runs the exercises after it."""
    plan = [{"key": e.key, "function": e.function, "checks": list(e.checks)} for e in exercises]
    results = {}
    while len(results) < len(exercises):  # each process gives at least one result
        pending = [e.key for e in exercises if e.key not in results]
        results.update(checks_process(folder, plan, pending, time_limit))
    blame_callees(results, plan)
    return [results[e.key] for e in exercises]


def checks_process(folder: Path, plan: list[dict], keys: list[str], time_limit: float) -> dict[str, dict]:
    """One process of tests/exercises/run_checks.py on the exercises `keys` -> their results, up to
    the one whose code ended the process or ran out of time (that one's result says so); when none
    began, every one of `keys` says why. The results come over a pipe of their own: the student's
    prints go to stdout, which is not read, and input() reads an empty stdin."""
    read_end, write_end = os.pipe()
    limits = json.dumps({"time": time_limit, "load": LOAD_LIMIT_S})
    command = [
        sys.executable,
        str(CHECKS / "run_checks.py"),
        str(folder.resolve()),
        json.dumps(plan),
        ",".join(keys),
        str(write_end),
        limits,
    ]
    # the copy's code alone: a PYTHONPATH naming the project would fill a file the copy lacks from it
    env = {name: value for name, value in os.environ.items() if name != "PYTHONPATH"}
    env["PYTHONBREAKPOINT"] = "0"  # a breakpoint() left in an exercise is passed: no one could answer it
    with tempfile.TemporaryFile() as stderr:
        try:
            process = subprocess.Popen(
                command,
                cwd=folder,
                env=env,
                stdin=subprocess.DEVNULL,
                stdout=subprocess.DEVNULL,
                stderr=stderr,
                pass_fds=(write_end,),
            )
        finally:
            os.close(write_end)
        progress = Progress(time_limit)
        try:
            progress.follow(read_end)
        finally:
            os.close(read_end)
            process.kill()
            process.wait()
        stderr.seek(0)
        said = stderr.read().decode("utf-8", "replace").strip().splitlines()[-1:]
    results, code = progress.results, process.returncode
    out_of_cpu = code == -signal.SIGXCPU
    if progress.running is not None:
        if out_of_cpu:
            why = f"did not finish in {progress.limit:g} s"
        elif progress.ended:
            why = f"its code ended the process of the checks, exit code {code}"
            why += f": {said[0][:160]}" if said else ""
        else:
            why = f"did not finish, and waited {WAIT_LIMIT_S} s for something"
        results[progress.running] = failed(progress.running, progress.doing or "the checks", why)
    elif not results:
        if progress.ended and not out_of_cpu:
            why = said[0][:200] if said else f"exit code {code}"
        else:
            why = "python and torch did not load in time"
        results = {key: failed(key, "the checks did not run", why) for key in keys}
    return results


def failed(key: str, checked: str, error: str) -> dict:
    return {"key": key, "passed": False, "checked": checked, "error": error, "called": []}


class Progress:
    """What a process of the checks has said over its pipe (run_checks.py's events): the results so
    far, the exercise it is running, what it is doing there and the CPU seconds it has for it (which
    run_checks.py enforces), and whether the process ended (else it waited WAIT_LIMIT_S by the clock)."""

    def __init__(self, time_limit: float):
        self.time_limit, self.results = time_limit, {}
        self.running, self.doing, self.ended, self.timed = None, "", False, False
        self.limit, self.deadline = LOAD_LIMIT_S, time.monotonic() + WAIT_LIMIT_S

    def follow(self, fd: int) -> None:
        """Read events from `fd` until it ends (the process ended) or the deadline passes."""
        buffer = b""
        while True:
            left = self.deadline - time.monotonic()
            if left <= 0 or not select.select([fd], [], [], left)[0]:
                return
            chunk = os.read(fd, 1 << 16)
            if not chunk:
                self.ended = True
                return
            *lines, buffer = (buffer + chunk).split(b"\n")
            for line in lines:
                self.on(json.loads(line))

    def on(self, event: dict) -> None:
        if "start" in event:
            self.running, self.doing, self.timed = event["start"], "", False
            self.limit, self.deadline = LOAD_LIMIT_S, time.monotonic() + WAIT_LIMIT_S
        elif "import" in event:
            self.doing = f"importing {event['import']}"
        elif "check" in event:
            self.doing = event["check"]
            if not self.timed:  # the exercise's time runs from its first check on
                self.limit, self.deadline = self.time_limit, time.monotonic() + WAIT_LIMIT_S
                self.timed = True
        else:
            self.results[self.running], self.running = event["result"], None


def blame_callees(results: dict[str, dict], plan: list[dict]) -> None:
    """A failing exercise whose failing check called another exercise that fails its own checks is
    told so: fixing the other comes first."""
    names = {e["key"]: e["function"].partition(":")[2] for e in plan}
    for result in results.values():
        failing = [key for key in result.get("called", []) if not results[key]["passed"]]
        if result["passed"] or not failing:
            continue
        calls = ", ".join(f"{names[key]} ({key})" for key in failing)
        keys = ", ".join(failing)
        fails = "fails its own exercise" if len(failing) == 1 else "fail their own exercises"
        note = f"{result['key']} calls {calls}, which {fails}: pass {keys} first"
        result["error"] = "; ".join(filter(None, [result["error"], note]))


def grade_line(exercise: Exercise, result: dict) -> str:
    """PASS <key> <function>, or FAIL <key> <function>: <what was checked> — hint: <hint>."""
    if result["passed"]:
        return f"PASS {exercise.key} {exercise.name}"
    checked = result["checked"] + (f" ({result['error']})" if result.get("error") else "")
    return f"FAIL {exercise.key} {exercise.name}: {checked} — hint: {exercise.hint}"


def grade(folder: Path, exercises=EXERCISES, time_limit: float = TIME_LIMIT_S) -> bool:
    """Print one line per exercise; True when every exercise passed."""
    results = run_checks(folder, exercises, time_limit)
    for exercise, result in zip(exercises, results):
        print(grade_line(exercise, result), flush=True)
    return all(r["passed"] for r in results)


def folder_path(text: str) -> Path:
    if not text.strip():  # Path("") is ".": the copy would land in the current folder
        raise argparse.ArgumentTypeError("is empty; name the folder of the student copy, e.g. exercises/")
    return Path(text)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="python -m srt.exercises",
        description="The paper's equations as exercises: write a student copy of the project whose "
        "exercise functions raise NotImplementedError, or grade such a copy.",
    )
    action = parser.add_mutually_exclusive_group(required=True)
    add_out(action, None, "write the student copy into this (new or empty) folder", type=folder_path)
    action.add_argument("--grade", type=Path, metavar="DIR", help="grade the student copy in DIR")
    action.add_argument("--list", action="store_true", help="list the exercises in order")
    parser.add_argument(
        "--time-limit",
        type=up_to(3600),
        default=TIME_LIMIT_S,
        metavar="S",
        help="--grade: seconds each exercise's checks may take; an exercise that takes longer fails alone",
    )
    return parser


def main(argv=None) -> int:
    args = build_parser().parse_args(argv)
    try:
        if args.list:
            for e in EXERCISES:
                print(f"{e.key:<8} {e.function:<32} {e.equation}, {e.section}")
            return 0
        if args.out:
            written = write_exercises(args.out)
            files = len(set(written))
            print(f"wrote the student copy to {args.out}: {len(EXERCISES)} exercises in {files} files")
            print(f"grade it with: python -m srt.exercises --grade {args.out}")
            return 0
        if not (args.grade / "stage2_grpo.py").is_file():
            raise ExerciseError(
                f"{args.grade} holds no copy of the project (no stage2_grpo.py): write one with "
                "`make exercises`, or grade a copy from inside it with `make grade`"
            )
        return 0 if grade(args.grade, time_limit=args.time_limit) else 1
    except ExerciseError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:  # the checks' process is gone with it (checks_process kills it)
        print("\ninterrupted: grading stopped; the copy is as it was", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
