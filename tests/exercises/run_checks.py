"""Run the exercises' checks on a student copy:
`python tests/exercises/run_checks.py DIR PLAN KEYS FD LIMITS`, PLAN a JSON list of {"key", "function":
"module:function", "checks": ["check_module:function", ...]}, KEYS the comma-separated keys of the
exercises to run (in PLAN's order), FD a file descriptor open for writing, LIMITS {"time", "load"}: the
CPU seconds of an exercise's checks, and of starting and of importing an exercise's module.

srt/exercises.py starts this in a subprocess with DIR (the copy) first on sys.path, so that the
checks' `import stage2_grpo` is the student's code, and reads one JSON line per event from FD, never
from stdout, which belongs to the student's prints: {"start": key}, {"import": module}, {"check":
what it checks}, then {"result": {"key", "passed", "checked", "error", "called"}}. "checked" is the
first line of the failing check's docstring (what it checks, never the expected code); "error"
names an exception that is not a failed assertion, so a student sees a crash in their own code for
what it is. The kernel ends this process when an exercise uses up its CPU (RLIMIT_CPU: SIGXCPU),
whatever its code is doing; from the events the grader then names the exercise and the check it was
in, and starts a fresh process for the exercises after it, as it does when the code ends the process.

An exercise that calls another (compute_rewards calls format_reward; grpo_loss calls k3_kl) can fail
for the other's sake. The other exercises' functions are wrapped while its checks run, so that its
line says so: "eq9 calls k3_kl, which is not done yet (exercise kl)", or (srt/exercises.py, from
"called") that the function it calls fails its own exercise. A module that does not import is
reported once, on its first exercise.
"""

import functools
import importlib
import json
import math
import os
import resource
import sys
import traceback
from pathlib import Path

# What a student's code may raise that is no Exception: its own sys.exit() or KeyboardInterrupt ends
# the check it is in, with its own line, and the checks of the next exercises run.
STOPS = (Exception, SystemExit, KeyboardInterrupt)


def first_line(doc: str | None) -> str:
    """A docstring's first paragraph on one line (a long one is wrapped over indented lines)."""
    return " ".join((doc or "").strip().split("\n\n")[0].split())


def split_function(exercise: dict) -> tuple[str, str]:
    module_name, _, function_name = exercise["function"].partition(":")
    return module_name, function_name


def exercise_that_raised(error: BaseException, plan: list[dict]) -> dict | None:
    """The exercise whose function raised `error`: its innermost frame that is one (a blank
    raises NotImplementedError however deep the call)."""
    for frame in reversed(traceback.extract_tb(error.__traceback__)):
        for exercise in plan:
            module_name, function_name = split_function(exercise)
            file = Path(*module_name.split(".")).with_suffix(".py")
            if frame.name == function_name and Path(frame.filename).parts[-len(file.parts) :] == file.parts:
                return exercise
    return None


def import_failure(error: Exception) -> str:
    if isinstance(error, SyntaxError):
        return f"{Path(error.filename or '?').name} line {error.lineno}: {error.msg}"
    return repr(error)[:200]


class Calls:
    """Wraps the other exercises' functions in their modules while one exercise's checks run,
    recording which of them were called (the module's globals are what its functions look up)."""

    def __init__(self, exercise: dict, plan: list[dict]):
        self.others = [e for e in plan if e["key"] != exercise["key"]]
        self.called, self.saved = [], []

    def __enter__(self):
        for other in self.others:
            module = sys.modules.get(split_function(other)[0])
            function = getattr(module, split_function(other)[1], None)
            if callable(function):
                self.saved.append((module, function))
                setattr(module, function.__name__, self.recording(other, function))
        return self

    def recording(self, other: dict, function):
        @functools.wraps(function)
        def called(*args, **kwargs):
            if other not in self.called:
                self.called.append(other)
            return function(*args, **kwargs)

        return called

    def __exit__(self, *exc):
        for module, function in self.saved:
            setattr(module, function.__name__, function)


def run_check(check: str, exercise: dict, plan: list[dict], announce=None) -> dict | None:
    """One check of `exercise` -> None when it passes, else {checked, error, called}. `announce`
    is told what the check checks before it runs."""
    check_module, _, check_name = check.partition(":")
    function = getattr(importlib.import_module(check_module), check_name)
    checked = first_line(function.__doc__)
    if announce:
        announce({"check": checked})
    with Calls(exercise, plan) as calls:
        try:
            function()
            return None
        except AssertionError:
            return {"checked": checked, "error": "", "called": calls.called}
        except NotImplementedError as e:
            blank = exercise_that_raised(e, plan)
            if blank is None or blank["key"] == exercise["key"]:
                return {"checked": checked, "error": "not implemented yet", "called": []}
            name = split_function(blank)[1]
            return {
                "checked": f"{exercise['key']} calls {name}, which is not done yet (exercise {blank['key']})",
                "error": "",
                "called": [],
            }
        except STOPS as e:
            where = traceback.extract_tb(e.__traceback__)[-1]
            place = f"{where.filename.rsplit('/', 1)[-1]}:{where.lineno}"
            said = f": {str(e)[:160]}" if str(e) else ""
            error = f"raised {type(e).__name__}{said} at {place}"
            if isinstance(e, EOFError):
                error += " (the checks give input() nothing to read)"
            return {"checked": checked, "error": error, "called": calls.called}


def run_exercise(exercise: dict, folder: str, plan: list[dict], import_errors: dict, announce=None) -> dict:
    """One exercise's checks, in order, up to the first that fails -> {key, passed, checked, error,
    called (the keys of the other exercises the failing check called)}. import_errors maps a failed
    import's message to the first exercise that reported it. `announce` (optional) is told of the
    import and of each check before it runs."""
    module_name, function_name = split_function(exercise)
    result = {"key": exercise["key"], "passed": True, "checked": "", "error": "", "called": []}
    if announce:
        announce({"import": module_name})
    try:
        module = importlib.import_module(module_name)
    except STOPS as e:  # a syntax error in the student's module is theirs to see, once
        failure = import_failure(e)
        first = import_errors.setdefault(failure, exercise["key"])
        error = failure if first == exercise["key"] else f"the same error as {first}"
        return {**result, "passed": False, "checked": f"importing {module_name}", "error": error}
    where = Path(getattr(module, "__file__", None) or "?").resolve()
    if not where.is_relative_to(Path(folder).resolve()):  # the copy lacks it; another copy is on the path
        return {
            **result,
            "passed": False,
            "checked": f"importing {module_name}",
            "error": f"{folder} has no {module_name}.py (it was found at {where}, which is not graded)",
        }
    if not callable(getattr(module, function_name, None)):
        return {
            **result,
            "passed": False,
            "checked": f"{folder}/{module_name}.py has no function {function_name}",
        }
    for check in exercise["checks"]:
        failure = run_check(check, exercise, plan, announce)
        if failure is not None:
            called = [e["key"] for e in failure.pop("called")]
            return {**result, **failure, "passed": False, "called": called}
    return result


def allow_cpu(seconds: float) -> None:
    """Let this process use `seconds` more CPU time; past that the kernel ends it (SIGXCPU), even in a
    loop that never returns to Python."""
    used = resource.getrusage(resource.RUSAGE_SELF)
    _, hard = resource.getrlimit(resource.RLIMIT_CPU)
    soft = math.ceil(used.ru_utime + used.ru_stime + seconds)
    resource.setrlimit(
        resource.RLIMIT_CPU, (soft if hard == resource.RLIM_INFINITY else min(soft, hard), hard)
    )


def main() -> None:
    if len(sys.argv) != 6 or sys.argv[1] in ("-h", "--help"):
        print(__doc__.strip())  # srt/exercises.py starts it; `python -m srt.exercises --grade DIR` for people
        sys.exit(0 if sys.argv[1:2] in (["-h"], ["--help"]) else 2)
    folder, plan, keys = sys.argv[1], json.loads(sys.argv[2]), sys.argv[3].split(",")
    channel, limits = os.fdopen(int(sys.argv[4]), "w", encoding="utf-8"), json.loads(sys.argv[5])
    timed = []  # the exercise whose checks have begun: its time runs from its first check

    def announce(event: dict) -> None:
        if "start" in event:
            allow_cpu(limits["load"])
        elif "check" in event and not timed:
            allow_cpu(limits["time"])
            timed.append(True)
        channel.write(json.dumps(event) + "\n")
        channel.flush()

    allow_cpu(limits["load"])
    sys.path.insert(0, folder)  # the student's copy before everything, the checks' folder next
    import torch

    torch.set_num_threads(1)  # tiny tensors: a second thread only adds contention
    import_errors = {}
    for exercise in plan:
        if exercise["key"] in keys:
            timed.clear()
            announce({"start": exercise["key"]})
            announce({"result": run_exercise(exercise, folder, plan, import_errors, announce)})


if __name__ == "__main__":
    main()
