"""Run the exercises' checks on a student copy: `python tests/exercises/run_checks.py DIR PLAN`, PLAN
a JSON list of {"key", "function": "module:function", "checks": ["check_module:function", ...]}.

srt/exercises.py starts this in a subprocess with DIR (the copy) first on sys.path, so that the
checks' `import stage2_grpo` is the student's code, and reads one line per exercise:
RESULT {"key", "passed", "checked", "error"}. "checked" is the first line of the failing check's
docstring (what it checks, never the expected code); "error" names an exception that is not a
failed assertion, so a student sees a crash in their own code for what it is.
"""

import importlib
import json
import sys
import traceback


def first_line(doc: str | None) -> str:
    """A docstring's first paragraph on one line (a long one is wrapped over indented lines)."""
    return " ".join((doc or "").strip().split("\n\n")[0].split())


def run_exercise(exercise: dict, folder: str) -> dict:
    module_name, _, function_name = exercise["function"].partition(":")
    result = {"key": exercise["key"], "passed": True, "checked": "", "error": ""}
    try:
        module = importlib.import_module(module_name)
    except Exception as e:  # a syntax error in the student's module is theirs to see
        return {**result, "passed": False, "checked": f"importing {module_name}", "error": repr(e)[:200]}
    if not callable(getattr(module, function_name, None)):
        return {
            **result,
            "passed": False,
            "checked": f"{folder}/{module_name}.py has no function {function_name}",
        }
    for check in exercise["checks"]:
        check_module, _, check_name = check.partition(":")
        function = getattr(importlib.import_module(check_module), check_name)
        try:
            function()
        except AssertionError:
            return {**result, "passed": False, "checked": first_line(function.__doc__)}
        except NotImplementedError:
            return {
                **result,
                "passed": False,
                "checked": first_line(function.__doc__),
                "error": "not implemented yet",
            }
        except Exception as e:
            where = traceback.extract_tb(e.__traceback__)[-1]
            place = f"{where.filename.rsplit('/', 1)[-1]}:{where.lineno}"
            error = f"raised {type(e).__name__}: {str(e)[:160]} at {place}"
            return {**result, "passed": False, "checked": first_line(function.__doc__), "error": error}
    return result


def main() -> None:
    if len(sys.argv) != 3 or sys.argv[1] in ("-h", "--help"):
        print(__doc__.strip())  # srt/exercises.py starts it; `python -m srt.exercises --grade DIR` for people
        sys.exit(0 if sys.argv[1:2] in (["-h"], ["--help"]) else 2)
    folder, plan = sys.argv[1], json.loads(sys.argv[2])
    sys.path.insert(0, folder)  # the student's copy before everything, the checks' folder next
    import torch

    torch.set_num_threads(1)  # tiny tensors: a second thread only adds contention
    for exercise in plan:
        print("RESULT " + json.dumps(run_exercise(exercise, folder)), flush=True)


if __name__ == "__main__":
    main()
