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


def module_in(error: Exception, folder: str) -> str | None:
    """The copy's module that an import failed in (dotted, as imported): the file of a syntax
    error, else the innermost frame in the copy; None when the failure is outside it."""
    root = Path(folder).resolve()
    files = [error.filename] if isinstance(error, SyntaxError) and error.filename else []
    files += [frame.filename for frame in reversed(traceback.extract_tb(error.__traceback__))]
    for file in files:
        path = Path(file).resolve()
        if path.is_relative_to(root) and path.suffix == ".py":
            return ".".join(path.relative_to(root).with_suffix("").parts)
    return None


def import_failure(error: Exception) -> str:
    if isinstance(error, SyntaxError):
        return f"{Path(error.filename or '?').name} line {error.lineno}: {error.msg}"
    return repr(error)[:200]


class Calls:
    """Wraps the other exercises' functions while one exercise's checks run, recording which of them
    were called: in their module and in every module of the copy that imported them by name (what
    its functions look up), as reward.py imports srt.metrics' jaccard."""

    def __init__(self, exercise: dict, plan: list[dict], folder: str):
        self.others = [e for e in plan if e["key"] != exercise["key"]]
        self.folder = Path(folder).resolve()
        self.called, self.saved = [], []

    def __enter__(self):
        modules = copy_modules(self.folder)
        for other in self.others:
            module = sys.modules.get(split_function(other)[0])
            function = getattr(module, split_function(other)[1], None)
            if callable(function):
                wrapped = self.recording(other, function)
                for holder, name in bindings(function, modules):
                    self.saved.append((holder, name, function))
                    setattr(holder, name, wrapped)
        return self

    def recording(self, other: dict, function):
        @functools.wraps(function)
        def called(*args, **kwargs):
            if other not in self.called:
                self.called.append(other)
            return function(*args, **kwargs)

        return called

    def __exit__(self, *exc):
        for holder, name, function in self.saved:
            setattr(holder, name, function)


def copy_modules(folder: Path) -> list:
    """The imported modules whose file is in `folder`."""
    files = [(module, getattr(module, "__file__", None)) for module in list(sys.modules.values())]
    return [module for module, file in files if file and Path(file).resolve().is_relative_to(folder)]


def bindings(function, modules: list) -> list[tuple[object, str]]:
    """(module, name) for every module of `modules` whose global `name` is `function`."""
    return [(module, name) for module in modules for name, value in vars(module).items() if value is function]


def run_check(check: str, exercise: dict, plan: list[dict], folder: str, announce=None) -> dict | None:
    """One check of `exercise` -> None when it passes, else {checked, error, called}. `announce`
    is told what the check checks before it runs."""
    check_module, _, check_name = check.partition(":")
    function = getattr(importlib.import_module(check_module), check_name)
    checked = first_line(function.__doc__)
    if announce:
        announce({"check": checked})
    with Calls(exercise, plan, folder) as calls:
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
        for check_module in dict.fromkeys(c.partition(":")[0] for c in exercise["checks"]):
            importlib.import_module(check_module)  # the checks import the copy's modules too
    except STOPS as e:  # a syntax error in the student's module is theirs to see, once
        failure = import_failure(e)
        first = import_errors.setdefault(failure, exercise["key"])
        error = failure if first == exercise["key"] else f"the same error as {first}"
        importing = module_in(e, folder) or module_name
        return {**result, "passed": False, "checked": f"importing {importing}", "error": error}
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
        failure = run_check(check, exercise, plan, folder, announce)
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
