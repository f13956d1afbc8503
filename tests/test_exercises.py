"""The exercises (srt/exercises.py) and their grader can fail: generated into a temporary folder,
every exercise fails on its blank, passes on the project's own solution, and fails, with its hint
and without its solution, on a plausible wrong solution written into the copy's function body."""

import ast
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from srt.data_io import write_jsonl
from srt.exercises import (
    EXERCISES,
    PROJECT,
    Exercise,
    ExerciseError,
    function_body,
    replace_body,
    write_exercises,
)
from srt.reward_gallery import GALLERY_RECORD

BY_KEY = {e.key: e for e in EXERCISES}


def solution(exercise: Exercise) -> str:
    return function_body((PROJECT / exercise.path).read_text(encoding="utf-8"), exercise.name)


def patched(exercise: Exercise, old: str, new: str) -> str:
    """The project's solution with one piece of its text replaced: a wrong solution."""
    body = solution(exercise)
    assert old in body, f"{exercise.key}: the solution no longer holds {old!r}; update this test"
    return body.replace(old, new, 1)


def without_the_answer_gate() -> str:
    body = solution(BY_KEY["eq4"])
    gate = re.compile(r"\n *if result\[\"answer_gated\"\]:[^\n]*\n *result\[\"answer\"\] = -1.0")
    assert gate.search(body), "eq4: the solution no longer gates the answer this way; update this test"
    return gate.sub("", body)


# One plausible wrong solution per exercise, as a student might write it.
WRONG = {
    "eq2": lambda: patched(  # the two weights of Eq. (2) swapped
        BY_KEY["eq2"],
        "w_sem * np.asarray(similarity) + w_dist *",
        "w_dist * np.asarray(similarity) + w_sem *",
    ),
    "eq3": lambda: patched(BY_KEY["eq3"], "nll = -logprobs * target", "nll = -logprobs * answer"),  # w/o CoT
    "eq5": lambda: (  # the markers present somewhere, their order and pairing unchecked
        'ok = all(m in completion for m in ("<think>", "</think>", "Final answer:"))\n'
        'return (1.0 if ok else 0.0), ([] if ok else ["a marker is missing"])\n'
    ),
    "eq6": lambda: (  # precision |H^ n H*| / |H^| where Eq. (6) asks for the IoU
        "a = set(a)\nreturn len(a & set(b)) / len(a) if a else 1.0\n"
    ),
    "eq7": lambda: patched(
        BY_KEY["eq7"], "rewards = [-1.0] * len(answers)", "rewards = [0.0] * len(answers)"
    ),
    "eq4": without_the_answer_gate,
    "eq8": lambda: patched(BY_KEY["eq8"], "keepdim=True, unbiased=False", "keepdim=True, unbiased=True"),
    "kl": lambda: patched(
        BY_KEY["kl"], "log_ratio = ref_logprobs - logprobs", "log_ratio = logprobs - ref_logprobs"
    ),
    "gspo": lambda: patched(  # GSPO's s_i as the sum of the log-ratios, not their mean
        BY_KEY["gspo"],
        "mean = log_ratio.sum(1, keepdim=True) / mask.sum(1, keepdim=True).clamp(min=1)",
        "mean = log_ratio.sum(1, keepdim=True)",
    ),
    "eq9": lambda: patched(  # max for min: the optimistic bound
        BY_KEY["eq9"],
        "torch.min(ratio * A, clipped_ratio * A)",
        "torch.max(ratio * A, clipped_ratio * A)",
    ),
    "weights": lambda: patched(  # dr_grpo divided by each completion's own length: grpo's length bias again
        BY_KEY["weights"],
        "return mask / (G * max_new_tokens)",
        "return mask / (G * mask.sum(1, keepdim=True))",
    ),
}

# Two copies, each with half the exercises wrong and the other half the solution. A function that
# calls another exercise fails with it: compute_rewards calls format_reward and jaccard (through
# recall_reward), grpo_loss calls k3_kl and importance_ratio; so each copy's wrong set keeps the
# callers apart from their callees.
WRONG_SETS = {
    "first": ({"eq2", "eq3", "eq4", "eq8", "eq9"}, set()),
    "second": ({"eq5", "eq6", "eq7", "kl", "gspo", "weights"}, {"eq4", "eq9"}),  # (wrong, failing with them)
}
# And the first copy lacks a function: its loss_weights renamed, as a student might by mistake (no
# other exercise calls it; the checks of grpo_loss build its weights by hand).
RENAMED = ("first", "weights", "def loss_weights(", "def loss_weights_of(")


@pytest.fixture(scope="module")
def blank(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("exercises") / "exercises"
    write_exercises(out)
    return out


def copy_with(blank: Path, folder: Path, bodies: dict[str, str]) -> Path:
    """A copy of the blank with each exercise's body replaced: bodies[key], else the solution."""
    shutil.copytree(blank, folder)
    for exercise in EXERCISES:
        path = folder / exercise.path
        body = bodies.get(exercise.key) or solution(exercise)
        path.write_text(replace_body(path.read_text(encoding="utf-8"), exercise.name, body), encoding="utf-8")
    return folder


def grade_command(
    folder: Path, *extra: str, inside: bool = False, env: dict | None = None
) -> subprocess.Popen:
    """`python -m srt.exercises --grade folder`, started: the grades of one test run side by side.
    inside: `python -m srt.exercises --grade .` in the copy, as a student with the copy alone runs it."""
    where, target = (folder, ".") if inside else (PROJECT, str(folder))
    command = [sys.executable, "-m", "srt.exercises", "--grade", target, *extra]
    return subprocess.Popen(
        command, cwd=where, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env
    )


def grade_lines(process: subprocess.Popen) -> tuple[int, dict[str, str]]:
    """The finished grade -> (exit code, {key: its line})."""
    stdout, stderr = process.communicate(timeout=300)
    lines = {line.split()[1]: line for line in stdout.splitlines() if line.startswith(("PASS ", "FAIL "))}
    assert list(lines) == [e.key for e in EXERCISES], stdout + stderr
    return process.returncode, lines


# What a student's function may do besides its equation, one exercise each: (code, whether the
# solution follows it). Prints (one that mimics the grader's own protocol, one without a newline) and a
# breakpoint() left in pass; reading input, Ctrl-C, sys.exit, a loop that never ends and os._exit
# fail their own exercise alone.
MISBEHAVING = {
    "eq2": ('print("RESULT", {"key": "eq2", "passed": False})\n', True),
    "eq3": ('print("a line without its end", end="")\n', True),
    "eq5": ("breakpoint()\n", True),
    "eq6": ("raise KeyboardInterrupt\n", False),
    "eq4": ("import sys\n\nsys.exit(3)\n", False),
    "eq8": ("while True:\n    pass\n", False),
    "eq9": ("import os\n\nos._exit(0)\n", False),
    "weights": ('input("the answer? ")\n', True),
}
MISBEHAVING_LIMIT_S = 20


@pytest.fixture(scope="module")
def grades(blank, tmp_path_factory) -> dict[str, tuple[int, dict[str, str]]]:
    """Every copy this module grades, graded at once: the blank, the solution, and the two copies
    with wrong solutions (WRONG_SETS; the first also lacks a function, RENAMED)."""
    folder = tmp_path_factory.mktemp("graded")
    copies = {"blank": blank, "solved": copy_with(blank, folder / "solved", {})}
    for name, (wrong, _) in WRONG_SETS.items():
        copies[name] = copy_with(blank, folder / name, {key: WRONG[key]() for key in wrong})
    copy, key, old, new = RENAMED
    path = copies[copy] / BY_KEY[key].path
    path.write_text(path.read_text(encoding="utf-8").replace(old, new), encoding="utf-8")
    copies["kl blank"] = copy_solving(blank, folder / "kl blank", {e.key for e in EXERCISES} - {"kl"})
    copies["reward.py broken"] = copy_with(blank, folder / "broken", {})
    path = copies["reward.py broken"] / "reward.py"
    path.write_text(path.read_text(encoding="utf-8") + "\ndef broken(:\n", encoding="utf-8")
    copies["misbehaving"] = copy_with(
        blank,
        folder / "misbehaving",
        {key: code + (solution(BY_KEY[key]) if then else "") for key, (code, then) in MISBEHAVING.items()},
    )
    copies["no reward.py"] = copy_with(blank, folder / "no reward", {})
    (copies["no reward.py"] / "reward.py").unlink()
    on_the_path = {**os.environ, "PYTHONPATH": str(PROJECT)}  # the project's reward.py, which is not graded
    started = {
        name: grade_command(copy, inside=name == "blank", env=on_the_path if name == "no reward.py" else None)
        for name, copy in copies.items()
        if name != "misbehaving"
    }
    # CPU seconds (an endless loop uses them up), which correct code here stays far below, however busy
    started["misbehaving"] = grade_command(copies["misbehaving"], "--time-limit", str(MISBEHAVING_LIMIT_S))
    return {name: grade_lines(process) for name, process in started.items()}


def function_node(source: str, name: str) -> ast.FunctionDef:
    return next(n for n in ast.parse(source).body if isinstance(n, ast.FunctionDef) and n.name == name)


def test_the_copy_keeps_signatures_and_docstrings_and_restores_exactly(blank, tmp_path):
    for exercise in EXERCISES:
        original = (PROJECT / exercise.path).read_text(encoding="utf-8")
        copy = (blank / exercise.path).read_text(encoding="utf-8")
        mine, theirs = function_node(original, exercise.name), function_node(copy, exercise.name)
        assert ast.unparse(mine.args) == ast.unparse(theirs.args)
        assert ast.get_docstring(mine) == ast.get_docstring(theirs)
        statement = theirs.body[-1]
        assert isinstance(statement, ast.Raise) and statement.exc.func.id == "NotImplementedError"
        assert statement.exc.args[0].value == exercise.message()
    assert (blank / "README.md").read_bytes() == (PROJECT / "README.md").read_bytes()
    restored = copy_with(blank, tmp_path / "restored", {})
    for exercise in EXERCISES:  # the blank and the solution are the same file but for the body
        assert (restored / exercise.path).read_bytes() == (PROJECT / exercise.path).read_bytes()


def test_every_exercise_fails_on_its_blank(grades):
    code, lines = grades["blank"]
    assert code != 0
    for exercise in EXERCISES:
        line = lines[exercise.key]
        assert line.startswith(f"FAIL {exercise.key} {exercise.name}: ") and "not implemented yet" in line
        assert "  " not in line  # what was checked reads as one sentence, however its docstring wraps
        assert line.endswith(f" — hint: {exercise.hint}")


def test_every_exercise_passes_on_the_projects_solution(grades):
    code, lines = grades["solved"]
    assert code == 0
    assert list(lines.values()) == [f"PASS {e.key} {e.name}" for e in EXERCISES]


def test_a_caller_says_which_exercise_it_waits_for(grades):
    """A blank k3_kl fails the correct grpo_loss by name, and a wrong callee is blamed beside its
    caller's failed check."""
    lines = grades["kl blank"][1]
    assert lines["eq9"] == (
        "FAIL eq9 grpo_loss: eq9 calls k3_kl, which is not done yet (exercise kl) — hint: "
        + BY_KEY["eq9"].hint
    )
    assert "not implemented yet" in lines["kl"]
    assert all(lines[key].startswith("PASS ") for key in BY_KEY if key not in ("kl", "eq9"))
    wrong_callees = grades["second"][1]
    # grpo_loss calls both of the second copy's wrong callees, importance_ratio first
    blamed = (
        "eq9 calls importance_ratio (gspo), k3_kl (kl), which fail their own exercises: pass gspo, kl first)"
    )
    assert blamed in wrong_callees["eq9"], wrong_callees["eq9"]
    assert re.search(r"eq4 calls [a-z_]+ \(eq[567]\)", wrong_callees["eq4"]), wrong_callees["eq4"]


def test_a_syntax_error_is_reported_once_for_its_module(grades):
    code, lines = grades["reward.py broken"]
    assert code != 0 and lines["eq2"] == "PASS eq2 dependency_score" and lines["eq3"].startswith("PASS ")
    assert lines["eq5"].startswith("FAIL eq5 format_reward: importing reward (reward.py line ")
    for key in ("eq6", "eq7", "eq4", "eq8", "kl", "eq9", "weights"):  # stage2_grpo imports reward
        assert "(the same error as eq5) — hint:" in lines[key], lines[key]


def test_each_exercise_is_judged_alone_whatever_its_code_does(grades):
    """A function that prints, stops in a debugger, reads input, raises KeyboardInterrupt, exits,
    ends the process or never returns fails its own exercise (or passes, when it is right) and no
    other: the results come over a pipe of their own, and each exercise has its own time limit."""
    code, lines = grades["misbehaving"]
    assert code == 1
    for key in ("eq2", "eq3", "eq5", "eq7", "kl"):
        assert lines[key] == f"PASS {key} {BY_KEY[key].name}"
    expected = {
        "eq6": "(raised KeyboardInterrupt at metrics.py:",
        "eq4": "(raised SystemExit: 3 at reward.py:",
        "eq8": f"(did not finish in {MISBEHAVING_LIMIT_S} s) — hint:",
        "eq9": "(its code ended the process of the checks, exit code 0) — hint:",
        "weights": "(raised EOFError: EOF when reading a line at stage2_grpo.py:",
    }
    for key, says in expected.items():
        assert lines[key].startswith(f"FAIL {key} {BY_KEY[key].name}: ") and says in lines[key], lines[key]
    assert "(the checks give input() nothing to read)" in lines["weights"]


def test_a_copy_is_graded_on_its_own_files_whatever_pythonpath_says(grades):
    code, lines = grades["no reward.py"]
    assert code == 1 and lines["eq2"].startswith("PASS ") and lines["eq3"].startswith("PASS ")
    assert lines["eq5"].startswith(
        "FAIL eq5 format_reward: importing reward (ModuleNotFoundError(\"No module named 'reward'\"))"
    ), lines["eq5"]
    for key in ("eq6", "eq7", "eq4", "eq8", "kl", "eq9", "weights"):  # stage2_grpo imports reward
        assert "(the same error as eq5) — hint:" in lines[key], lines[key]


def test_make_grade_grades_the_copy_from_inside_it(blank):
    """A handed-out copy holds EXERCISES.md, so its Makefile grades '.' (the blank's grade above runs
    `python -m srt.exercises --grade .` from inside it)."""
    assert "make grade" in (blank / "EXERCISES.md").read_text(encoding="utf-8")
    done = subprocess.run(["make", "-n", "grade"], cwd=blank, capture_output=True, text=True, timeout=60)
    assert done.returncode == 0 and "-m srt.exercises --grade .\n" in done.stdout, done.stdout + done.stderr
    done = subprocess.run(["make", "-n", "grade"], cwd=PROJECT, capture_output=True, text=True, timeout=60)
    assert "-m srt.exercises --grade exercises\n" in done.stdout, done.stdout + done.stderr


@pytest.mark.parametrize("copy", WRONG_SETS)
def test_a_wrong_solution_fails_with_its_hint_and_not_its_solution(grades, copy):
    wrong, failing_with_them = WRONG_SETS[copy]
    code, lines = grades[copy]
    assert code != 0
    for exercise in EXERCISES:
        line = lines[exercise.key]
        if (copy, exercise.key) == RENAMED[:2]:
            continue  # test_a_missing_exercise_function_is_a_clear_error
        if exercise.key in wrong | failing_with_them:
            assert line.startswith(f"FAIL {exercise.key} {exercise.name}: "), line
            assert line.endswith(f" — hint: {exercise.hint}") and "not implemented" not in line
            for code_line in solution(exercise).splitlines():  # the grader never prints the solution
                assert len(code_line.strip()) < 30 or code_line.strip() not in line
        else:
            assert line == f"PASS {exercise.key} {exercise.name}"


def test_a_missing_exercise_function_is_a_clear_error(blank, grades, tmp_path):
    moved = Exercise("eq2", "stage0_build:dependency_scores", "Eq. (2)", "§3.2", "hint", ())
    with pytest.raises(ExerciseError, match="stage0_build.py has no function dependency_scores"):
        write_exercises(tmp_path / "never", exercises=[moved])
    assert not (tmp_path / "never").exists()
    with pytest.raises(ExerciseError, match="already holds files"):
        write_exercises(blank)

    copy, key, _, _ = RENAMED
    line = grades[copy][1][key]
    assert (
        line.startswith(f"FAIL {key} loss_weights: ")
        and "stage2_grpo.py has no function loss_weights —" in line
    )


def test_help_and_list():
    for flag, expected in (("--help", "--grade DIR"), ("--list", "stage2_grpo:grpo_loss")):
        done = subprocess.run(
            [sys.executable, "-m", "srt.exercises", flag], cwd=PROJECT, capture_output=True, text=True
        )
        assert done.returncode == 0 and expected in done.stdout


def copy_solving(blank: Path, folder: Path, keys: set[str]) -> Path:
    """A copy of the blank with the project's solution written into the exercises `keys` only."""
    shutil.copytree(blank, folder)
    for exercise in (e for e in EXERCISES if e.key in keys):
        path = folder / exercise.path
        source = replace_body(path.read_text(encoding="utf-8"), exercise.name, solution(exercise))
        path.write_text(source, encoding="utf-8")
    return folder


def gallery_in(folder: Path, example: str) -> subprocess.CompletedProcess:
    command = [sys.executable, "reward.py", "--gallery", "--reward", f"docs/rewards/{example}"]
    return subprocess.run(command, cwd=folder, capture_output=True, text=True, timeout=300)


def test_the_example_rewards_say_which_exercise_they_need_in_a_blank_copy(blank):
    for example in ("keyword_answer.py", "substring_recall.py"):
        done = gallery_in(blank, example)
        assert done.returncode == 1 and done.stdout == ""
        assert done.stderr.strip() == (
            f"error: --reward docs/rewards/{example}: compute_rewards calls reward.format_reward, "
            "exercise eq5, which is not done yet: do eq5 first (python -m srt.exercises --grade DIR)"
        )


def test_the_example_rewards_need_only_eq5_and_eq6(blank, tmp_path):
    """Class 1 asks for eq5 and eq6; eq4 and eq7 may still be blank when the gallery is tried."""
    folder = copy_solving(blank, tmp_path / "class1", {"eq5", "eq6"})
    for example, winners in (("keyword_answer.py", 4), ("substring_recall.py", 6)):
        done = gallery_in(folder, example)
        assert done.returncode == 1, done.stderr
        assert f"FAIL: {winners} of 31 attacks score as high as an honest completion" in done.stdout


def score_one_completion_in(folder: Path, tmp_path: Path) -> subprocess.CompletedProcess:
    """`python reward.py --data ... --answer-reward keys` in `folder`: the honest completion of the
    gallery's record scored and explained, with no embedder (its keys judge the answer)."""
    data = tmp_path / "record.jsonl"
    write_jsonl(data, [GALLERY_RECORD])
    command = [sys.executable, "reward.py", "--data", str(data), "--answer-reward", "keys"]
    return subprocess.run(command, cwd=folder, capture_output=True, text=True, timeout=300)


def test_a_script_names_the_blank_it_reaches(blank, tmp_path):
    """A script run in a copy ends in one line naming the exercise it needs, not in a traceback,
    and never in a number: in a blank copy the composite's own blank, and with eq4 and eq5 done the
    IoU of Eq. (6), which the recall reward calls (the reward and the metrics share it)."""
    for done_keys, function, key in (
        (set(), "reward.compute_rewards", "eq4"),
        ({"eq4", "eq5"}, "srt.metrics.jaccard", "eq6"),
    ):
        folder = copy_solving(blank, tmp_path / f"solved {sorted(done_keys)}", done_keys)
        done = score_one_completion_in(folder, tmp_path)
        assert done.returncode == 1 and done.stdout == "", done.stdout + done.stderr
        assert done.stderr.strip() == (
            f"error: reward.py calls {function}, exercise {key}, which is not done yet: do {key} first "
            "(python -m srt.exercises --grade DIR)"
        )


def distinctive_lines(exercise: Exercise) -> list[str]:
    """The solution's lines that could give it away (whitespace folded, comments dropped): any of 25
    characters or more, a plain `return x` or `else:` being no clue."""
    lines = (re.sub(r"\s+#.*$", "", " ".join(line.split())) for line in solution(exercise).splitlines())
    return [line for line in lines if len(line) >= 25 and not line.startswith("for ")]  # a loop: no clue


# A blanked formula written again under other names, in code: Eq. (6)'s IoU, the ratio's clip
# (importance_ratio), Eq. (9)'s min() of the two surrogates, the k3 estimator of Eq. (9)'s KL.
RESTATED = {
    "eq6": re.compile(r"len\((\w+) & (\w+)\) / len\(\1 \| \2\)"),
    "gspo": re.compile(r"clamp\(\w+, 1 - \w+, 1 \+ \w+\)"),
    "eq9": re.compile(r"\bmin\((\w+) \* (\w+), \w+ \* \2\)"),
    "kl": re.compile(r"\.exp\(\) - \w+ - 1|torch\.exp\((\w+)\) - \1 - 1"),
}


def test_the_copy_holds_no_solution_line(blank):
    """The copy restates no blanked body anywhere (not in a test, a bench script or a document), nor
    any of the formulas of RESTATED in code under other names (a metric's IoU, --explain's clip)."""
    texts = {
        path.relative_to(blank).as_posix(): " ".join(
            path.read_text(encoding="utf-8", errors="replace").split()
        )
        for path in blank.rglob("*")
        if path.is_file() and path.suffix in (".py", ".md", ".txt", ".sh", "")
    }
    assert "tests/test_exercises.py" not in texts and "bench/sampler_mismatch.py" not in texts
    found = [
        f"{name}: {exercise.key}: {line}"
        for exercise in EXERCISES
        for line in distinctive_lines(exercise)
        for name, text in texts.items()
        if line in text
    ]
    found += [
        f"{name}: {key}: {match.group()}"
        for key, pattern in RESTATED.items()
        for name, text in texts.items()
        for match in pattern.finditer(text)
    ]
    assert len(distinctive_lines(BY_KEY["eq9"])) >= 5 and found == []
    for key, pattern in RESTATED.items():  # each pattern finds its formula in the project's solution
        assert pattern.search(" ".join(solution(BY_KEY[key]).split())), key
