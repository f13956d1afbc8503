"""Run the exercises' checks on a student copy: `python tests/exercises/run_checks.py DIR PLAN`, PLAN
a JSON list of {"key", "function": "module:function", "checks": ["check_module:function", ...]}.

srt/exercises.py starts this in a subprocess with DIR (the copy) first on sys.path, so that the
checks' `import stage2_grpo` is the student's code, and reads one line per exercise:
RESULT {"key", "passed", "checked", "error"}. "checked" is the first line of the failing check's
docstring (what it checks, never the expected code); "error" names an exception that is not a
failed assertion, so a student sees a crash in their own code for what it is.

An exercise that calls another (compute_rewards calls format_reward; grpo_loss calls k3_kl) can fail
for the other's sake. The other exercises' functions are wrapped while its checks run, so that its
line says so: "eq9 calls k3_kl, which is not done yet (exercise kl)", or that the function it calls
fails its own exercise. A module that does not import is reported once, on its first exercise.
"""

import functools
import importlib
import json
import sys
import traceback
from pathlib import Path


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


def run_check(check: str, exercise: dict, plan: list[dict], folder: str) -> dict | None:
    """One check of `exercise` -> None when it passes, else {checked, error, called}."""
    check_module, _, check_name = check.partition(":")
    function = getattr(importlib.import_module(check_module), check_name)
    checked = first_line(function.__doc__)
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
        except Exception as e:
            where = traceback.extract_tb(e.__traceback__)[-1]
            place = f"{where.filename.rsplit('/', 1)[-1]}:{where.lineno}"
            error = f"raised {type(e).__name__}: {str(e)[:160]} at {place}"
            return {"checked": checked, "error": error, "called": calls.called}


def run_exercise(exercise: dict, folder: str, plan: list[dict], import_errors: dict) -> dict:
    """One exercise's checks, in order, up to the first that fails -> {key, passed, checked, error,
    called (the keys of the other exercises the failing check called)}. import_errors maps a failed
    import's message to the first exercise that reported it."""
    module_name, function_name = split_function(exercise)
    result = {"key": exercise["key"], "passed": True, "checked": "", "error": "", "called": []}
    try:
        module = importlib.import_module(module_name)
        for check_module in dict.fromkeys(c.partition(":")[0] for c in exercise["checks"]):
            importlib.import_module(check_module)  # the checks import the copy's modules too
    except Exception as e:  # a syntax error in the student's module is theirs to see, once
        failure = import_failure(e)
        first = import_errors.setdefault(failure, exercise["key"])
        error = failure if first == exercise["key"] else f"the same error as {first}"
        importing = module_in(e, folder) or module_name
        return {**result, "passed": False, "checked": f"importing {importing}", "error": error}
    if not callable(getattr(module, function_name, None)):
        return {
            **result,
            "passed": False,
            "checked": f"{folder}/{module_name}.py has no function {function_name}",
        }
    for check in exercise["checks"]:
        failure = run_check(check, exercise, plan, folder)
        if failure is not None:
            called = [e["key"] for e in failure.pop("called")]
            return {**result, **failure, "passed": False, "called": called}
    return result


def blame_callees(results: dict[str, dict], plan: list[dict]) -> None:
    """A failing exercise whose failing check called another exercise that fails its own checks is
    told so: fixing the other comes first."""
    names = {e["key"]: split_function(e)[1] for e in plan}
    for result in results.values():
        failing = [key for key in result["called"] if not results[key]["passed"]]
        if result["passed"] or not failing:
            continue
        calls = ", ".join(f"{names[key]} ({key})" for key in failing)
        keys = ", ".join(failing)
        fails = "fails its own exercise" if len(failing) == 1 else "fail their own exercises"
        note = f"{result['key']} calls {calls}, which {fails}: pass {keys} first"
        result["error"] = "; ".join(filter(None, [result["error"], note]))


def main() -> None:
    if len(sys.argv) != 3 or sys.argv[1] in ("-h", "--help"):
        print(__doc__.strip())  # srt/exercises.py starts it; `python -m srt.exercises --grade DIR` for people
        sys.exit(0 if sys.argv[1:2] in (["-h"], ["--help"]) else 2)
    folder, plan = sys.argv[1], json.loads(sys.argv[2])
    sys.path.insert(0, folder)  # the student's copy before everything, the checks' folder next
    import torch

    torch.set_num_threads(1)  # tiny tensors: a second thread only adds contention
    import_errors, results = {}, {}
    for exercise in plan:
        results[exercise["key"]] = run_exercise(exercise, folder, plan, import_errors)
    blame_callees(results, plan)
    for result in results.values():
        print("RESULT " + json.dumps(result), flush=True)


if __name__ == "__main__":
    main()
