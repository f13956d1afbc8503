"""Plausible wrong solutions of every exercise, each applied in turn to the project's own code and
graded by the grader's own runner (tests/exercises/run_checks.py): every one must fail, on a check
of its exercise, with a line that names what was checked. A mistake the project's tests would catch
is one the grader must catch; the grader is held to this list as the tests are held to the code.

Each wrong solution is the project's solution with one piece of text replaced (`patch`), or a body
written out (`body`), as a student might write it from the docstring and the hint."""

import ast
import importlib
import importlib.util
import textwrap
from collections.abc import Callable
from contextlib import contextmanager

import pytest

from srt.exercises import EXERCISES, PROJECT, function_body, replace_body

BY_KEY = {e.key: e for e in EXERCISES}
CHECKS = PROJECT / "tests" / "exercises"


def solution(key: str) -> str:
    exercise = BY_KEY[key]
    return function_body((PROJECT / exercise.path).read_text(encoding="utf-8"), exercise.name)


def patch(key: str, *pairs: str) -> Callable[[], str]:
    """The solution of `key` with each (old, new) pair of `pairs` replaced once."""

    def wrong() -> str:
        text = solution(key)
        for old, new in zip(pairs[::2], pairs[1::2]):
            assert old in text, f"{key}: the solution no longer holds {old!r}; update this wrong solution"
            text = text.replace(old, new, 1)
        return text

    return wrong


def body(text: str) -> Callable[[], str]:
    return lambda: textwrap.dedent(text)


# (exercise, what the student got wrong, the wrong body)
WRONG = [
    # ==== Eq. (2) ====
    (
        "eq2",
        "the two weights swapped",
        patch("eq2", "w_sem * np.asarray(similarity) + w_dist", "w_dist * np.asarray(similarity) + w_sem"),
    ),
    (
        "eq2",
        "the distance signed, not |t - i|",
        patch("eq2", "np.abs(np.asarray(t) - np.asarray(i))", "(np.asarray(t) - np.asarray(i))"),
    ),
    ("eq2", "a growth, exp(+decay d)", patch("eq2", "np.exp(-decay *", "np.exp(decay *")),
    (
        "eq2",
        "the paper's constants written in, the arguments ignored",
        body("""\
        return 0.6 * np.asarray(similarity) + 0.4 * np.exp(-0.15 * np.abs(np.asarray(t) - np.asarray(i)))
        """),
    ),
    (
        "eq2",
        "a linear decay for the exponential",
        body("""\
        return w_sem * np.asarray(similarity) + w_dist * (1 - decay * np.abs(np.asarray(t) - np.asarray(i)))
        """),
    ),
    (
        "eq2",
        "math on scalars: no arrays",
        body("""\
        import math
        return w_sem * similarity + w_dist * math.exp(-decay * abs(t - i))
        """),
    ),
    (
        "eq2",
        "the distance off by one",
        patch("eq2", "np.abs(np.asarray(t) - np.asarray(i))", "(np.abs(np.asarray(t) - np.asarray(i)) + 1)"),
    ),
    # ==== Eq. (3) ====
    (
        "eq3",
        "the answer alone (w/o CoT)",
        patch("eq3", "nll = -logprobs * target", "nll = -logprobs * answer"),
    ),
    (
        "eq3",
        "a mean where Eq. (3)'s callers want sums",
        patch("eq3", '"nll": nll.sum(),', '"nll": nll.sum() / target.sum(),'),
    ),
    (
        "eq3",
        "every column counted as a token",
        patch("eq3", '"tokens": target.sum(),', '"tokens": target.numel(),'),
    ),
    (
        "eq3",
        "reasoning = not answer, prompt and padding included",
        patch("eq3", "reasoning = target & ~answer", "reasoning = ~answer"),
    ),
    (
        "eq3",
        "the unmasked log-probs (padding in the sum)",
        patch("eq3", "nll = -logprobs * target", "nll = -logprobs"),
    ),
    (
        "eq3",
        "the log-likelihood, not its negative",
        patch("eq3", "nll = -logprobs * target", "nll = logprobs * target"),
    ),
    ("eq3", "the sums as floats: no gradient", patch("eq3", '"nll": nll.sum(),', '"nll": nll.sum().item(),')),
    (
        "eq3",
        "reasoning and answer swapped",
        patch(
            "eq3",
            '"reasoning_nll": nll[reasoning].sum(),\n    "answer_nll": nll[answer].sum(),',
            '"reasoning_nll": nll[answer].sum(),\n    "answer_nll": nll[reasoning].sum(),',
        ),
    ),
    # ==== Eq. (5) ====
    (
        "eq5",
        "the markers present somewhere, order and pairing unchecked",
        body("""\
        ok = all(m in completion for m in ("<think>", "</think>", "Final answer:"))
        return (1.0 if ok else 0.0), ([] if ok else ["a marker is missing"])
        """),
    ),
    (
        "eq5",
        "the broken rules dropped from the result",
        body("""\
        return (0.0 if format_problems(completion) else 1.0), []
        """),
    ),
    (
        "eq5",
        "one broken rule forgiven",
        body("""\
        problems = format_problems(completion)
        return (0.0 if len(problems) > 1 else 1.0), problems
        """),
    ),
    (
        "eq5",
        "<HIS> pairing checked by counting the tags",
        body("""\
        pairing = ("nested", "has no opening", "is never closed")
        problems = [p for p in format_problems(completion) if not any(word in p for word in pairing)]
        if completion.count("<HIS>") != completion.count("</HIS>"):
            problems.append("as many <HIS> as </HIS>")
        return (0.0 if problems else 1.0), problems
        """),
    ),
    (
        "eq5",
        "the format read after NFKC (a full-width tag taken for one)",
        body("""\
        import unicodedata
        problems = format_problems(unicodedata.normalize("NFKC", completion))
        return (0.0 if problems else 1.0), problems
        """),
    ),
    # ==== Eq. (6): the IoU, srt.metrics.jaccard(a, b), H^ and H* ====
    (
        "eq6",
        "precision |H^ n H*| / |H^| for the IoU",
        body("""\
        a = set(a)
        return len(a & set(b)) / len(a) if a else 1.0
        """),
    ),
    (
        "eq6",
        "recall |H^ n H*| / |H*|: over-recall free",
        body("""\
        b = set(b)
        return len(set(a) & b) / len(b) if b else 1.0
        """),
    ),
    (
        "eq6",
        "lists, not sets: a repeat counts twice",
        body("""\
        a, b = list(a), list(b)
        both = [x for x in a if x in b]
        union = len(a) + len(b) - len(both)
        return len(both) / union if union else 1.0
        """),
    ),
    (
        "eq6",
        "two empty sets disagree",
        body("""\
        a, b = set(a), set(b)
        return len(a & b) / len(a | b) if a | b else 0.0
        """),
    ),
    (
        "eq6",
        "the union without its intersection removed (Dice)",
        body("""\
        a, b = set(a), set(b)
        total = len(a) + len(b)
        return 2 * len(a & b) / total if total else 1.0
        """),
    ),
    (
        "eq6",
        "Eq. (6) whole, scaled here where recall_reward scales the IoU",
        body("""\
        a, b = set(a), set(b)
        return 2.5 * (len(a & b) / len(a | b) if a | b else 1.0) - 1.25
        """),
    ),
    (
        "eq6",
        "the Jaccard distance 1 - IoU",
        body("""\
        a, b = set(a), set(b)
        return 1.0 - (len(a & b) / len(a | b) if a | b else 1.0)
        """),
    ),
    # ==== Eq. (7) ====
    (
        "eq7",
        "a missing answer earns 0",
        patch("eq7", "rewards = [-1.0] * len(answers)", "rewards = [0.0] * len(answers)"),
    ),
    (
        "eq7",
        "each answer against the best reference of the batch",
        patch(
            "eq7",
            "cosines = np.sum(vectors[: len(present)] * vectors[len(present) :], axis=1)",
            "cosines = (vectors[: len(present)] @ vectors[len(present) :].T).max(axis=1)",
        ),
    ),
    (
        "eq7",
        "each answer against the batch's mean reference",
        patch(
            "eq7",
            "cosines = np.sum(vectors[: len(present)] * vectors[len(present) :], axis=1)",
            "mean = vectors[len(present) :].mean(axis=0)\n"
            "    cosines = vectors[: len(present)] @ (mean / np.linalg.norm(mean))",
        ),
    ),
    ("eq7", "no clip", patch("eq7", "rewards[i] = float(np.clip(c, -1.0, 1.0))", "rewards[i] = float(c)")),
    ("eq7", "a clip to [0, 1]", patch("eq7", "np.clip(c, -1.0, 1.0)", "np.clip(c, 0.0, 1.0)")),
    (
        "eq7",
        "every reference embedded, the missing answers' too",
        patch("eq7", "[references[i] for i in present]", "list(references)"),
    ),
    (
        "eq7",
        "one embedding call per answer",
        body("""\
        rewards = [-1.0] * len(answers)
        for i, answer in enumerate(answers):
            if answer is not None:
                a, r = embed([answer]), embed([references[i]])
                rewards[i] = float(np.clip(np.sum(a * r), -1.0, 1.0))
        return rewards
        """),
    ),
    # ==== Eq. (4) ====
    ("eq4", "no answer gate", patch("eq4", 'if result["answer_gated"]:', "if False:")),
    (
        "eq4",
        "a missing 'Final answer:' judged as if the whole text were the answer",
        patch("eq4", "answers.append(parsed.final_answer)", "answers.append(parsed.final_answer or text)"),
    ),
    (
        "eq4",
        "hallucinated tags dropped from H^ before Eq. (6)",
        patch(
            "eq4", 'recall_reward(predicted, example["recall"])', 'recall_reward(recalled, example["recall"])'
        ),
    ),
    (
        "eq4",
        "the gate shut on a partial recall too",
        patch("eq4", 'result["jaccard"] == 0.0', 'result["jaccard"] < 1.0'),
    ),
    (
        "eq4",
        "--answer-reward ignored: always the cosine",
        patch(
            "eq4",
            "answer_rewards(answers, examples, answer_reward)",
            'answer_rewards(answers, examples, "cosine")',
        ),
    ),
    (
        "eq4",
        "unequal lengths cut short by zip",
        patch("eq4", "if len(completions) != len(examples):", "if False:"),
    ),
    (
        "eq4",
        "the format term left out of the total",
        patch(
            "eq4",
            'result["total"] = result["format"] + result["recall"] + result["answer"]',
            'result["total"] = result["recall"] + result["answer"]',
        ),
    ),
    # ==== Eq. (8) ====
    (
        "eq8",
        "the sample std (K - 1)",
        patch("eq8", "keepdim=True, unbiased=False", "keepdim=True, unbiased=True"),
    ),
    (
        "eq8",
        "nan_to_num on the rewards: a NaN no longer skips the step",
        patch("eq8", "rewards = rewards.double()", "rewards = torch.nan_to_num(rewards.double())"),
    ),
    (
        "eq8",
        "in float32 and no exact zero: rounding blown up by a tiny std",
        patch(
            "eq8",
            "rewards = rewards.double()",
            "rewards = rewards.float()",
            "return torch.where(all_equal, torch.zeros_like(advantages), advantages).float()",
            "return advantages.float()",
        ),
    ),
    (
        "eq8",
        "the exact zero under 'group' only (in float32)",
        body("""\
        mean = rewards.mean(dim=1, keepdim=True)
        all_equal = (rewards == rewards[:, :1]).all(dim=1, keepdim=True)
        if scale == "group":
            advantages = (rewards - mean) / (rewards.std(dim=1, keepdim=True, unbiased=False) + eps)
            return torch.where(all_equal, torch.zeros_like(advantages), advantages)
        if scale == "batch":
            everything = rewards if batch_rewards is None else batch_rewards
            return (rewards - mean) / (everything.std(unbiased=False) + eps)
        if scale == "none":
            return rewards - mean
        raise ValueError(f"unknown scale {scale!r}")
        """),
    ),
    (
        "eq8",
        "one mean over the whole batch",
        patch("eq8", "mean = rewards.mean(dim=1, keepdim=True)", "mean = rewards.mean()"),
    ),
    (
        "eq8",
        "'batch' ignores batch_rewards",
        patch(
            "eq8",
            "everything = rewards if batch_rewards is None else batch_rewards.double()",
            "everything = rewards",
        ),
    ),
    ("eq8", "returned in float64", patch("eq8", "advantages).float()", "advantages)")),
    # ==== k3 ====
    (
        "kl",
        "the log-ratio the wrong way round",
        patch("kl", "log_ratio = ref_logprobs - logprobs", "log_ratio = logprobs - ref_logprobs"),
    ),
    ("kl", "k1, the plain log-ratio", body("return ref_logprobs - logprobs\n")),
    ("kl", "k2, half the squared log-ratio", body("return 0.5 * (ref_logprobs - logprobs) ** 2\n")),
    ("kl", "no -1", patch("kl", "torch.exp(log_ratio) - log_ratio - 1", "torch.exp(log_ratio) - log_ratio")),
    (
        "kl",
        "one mean over the tokens",
        patch("kl", "torch.exp(log_ratio) - log_ratio - 1", "(torch.exp(log_ratio) - log_ratio - 1).mean()"),
    ),
    # ==== Eq. (9) ====
    (
        "eq9",
        "a token mean for the loss weights (--loss-type ignored)",
        patch(
            "eq9", "loss = -(experience.loss_weights * objective).sum()", "loss = -objective[sampled].mean()"
        ),
    ),
    (
        "eq9",
        "each completion's token mean, then the mean: grpo whatever the weights",
        patch(
            "eq9",
            "loss = -(experience.loss_weights * objective).sum()",
            "loss = -(objective.sum(1) / sampled.sum(1).clamp(min=1)).mean()",
        ),
    ),
    ("eq9", "the KL added, not subtracted", patch("eq9", "surrogate - beta * kl", "surrogate + beta * kl")),
    (
        "eq9",
        "the importance weights on the KL too",
        patch(
            "eq9",
            "objective = torch.where(sampled, surrogate - beta * kl, 0.0)",
            "objective = torch.where(sampled, (surrogate - beta * kl) * experience.is_weights, 0.0)",
        ),
    ),
    (
        "eq9",
        "the importance weights left out",
        patch("eq9", "surrogate = surrogate * experience.is_weights", "surrogate = surrogate"),
    ),
    (
        "eq9",
        "masked tokens not replaced before the exp",
        patch("eq9", "logprobs = torch.where(sampled, logprobs, 0.0)", "logprobs = logprobs"),
    ),
    (
        "eq9",
        "max for min",
        patch("eq9", "torch.min(ratio * A, clipped_ratio * A)", "torch.max(ratio * A, clipped_ratio * A)"),
    ),
    (
        "eq9",
        "clipped wherever the ratio leaves the band, whatever A's sign",
        patch(
            "eq9",
            "clipped = ((ratio > clipped_ratio) & (A > 0)) | ((ratio < clipped_ratio) & (A < 0))",
            "clipped = ratio != clipped_ratio",
        ),
    ),
    (
        "eq9",
        "the level not passed on: Eq. (9)'s token ratio whatever --importance-sampling-level says",
        patch("eq9", "    level,\n    clip_eps,", '    "token",\n    clip_eps,'),
    ),
    (
        "eq9",
        "clip-higher not passed on: a symmetric clip always",
        patch("eq9", "    clip_eps_high,\n)", ")"),
    ),
    (
        "eq9",
        "the log-ratio detached before the ratio: no gradient",
        patch(
            "eq9",
            "ratio, clipped_ratio = importance_ratio(\n    logprobs,",
            "ratio, clipped_ratio = importance_ratio(\n    logprobs.detach(),",
        ),
    ),
    # ==== The unit of Eq. (9)'s ratio: token, or GSPO's sequence ====
    (
        "gspo",
        "the mean of the token ratios, not the exp of the mean log-ratio",
        patch(
            "gspo",
            "mean = log_ratio.sum(1, keepdim=True)",
            "mean = (torch.exp(log_ratio) * (mask > 0)).sum(1, keepdim=True)",
            "torch.exp(mean).expand_as",
            "mean.expand_as",
        ),
    ),
    (
        "gspo",
        "a sum of the log-ratios, not their mean: the whole sequence's likelihood ratio",
        patch(
            "gspo",
            "mean = log_ratio.sum(1, keepdim=True) / mask.sum(1, keepdim=True).clamp(min=1)",
            "mean = log_ratio.sum(1, keepdim=True)",
        ),
    ),
    (
        "gspo",
        "the token epsilon at the sequence level",
        patch(
            "gspo",
            "torch.exp(mean).expand_as(log_ratio), gspo_clip_eps",
            "torch.exp(mean).expand_as(log_ratio), clip_eps",
        ),
    ),
    (
        "gspo",
        "clip-higher applied to the lower side too",
        patch("gspo", "torch.clamp(ratio, 1 - eps, 1 + high)", "torch.clamp(ratio, 1 - high, 1 + high)"),
    ),
    (
        "gspo",
        "the padding counted in the mean (divided by the width)",
        patch("gspo", "mask.sum(1, keepdim=True).clamp(min=1)", "mask.shape[1]"),
    ),
    (
        "gspo",
        "the clip on one side only",
        patch("gspo", "torch.clamp(ratio, 1 - eps, 1 + high)", "torch.clamp(ratio, max=1 + high)"),
    ),
    (
        "gspo",
        "the ratio inverted",
        patch(
            "gspo",
            "torch.where(mask > 0, logprobs - old_logprobs, 0.0)",
            "torch.where(mask > 0, old_logprobs - logprobs, 0.0)",
        ),
    ),
    (
        "gspo",
        "the ratio detached: no gradient",
        patch(
            "gspo",
            "torch.where(mask > 0, logprobs - old_logprobs, 0.0)",
            "torch.where(mask > 0, logprobs - old_logprobs, 0.0).detach()",
        ),
    ),
    (
        "gspo",
        "the mask multiplied in: a padding token's -inf times 0 is NaN",
        patch(
            "gspo", "torch.where(mask > 0, logprobs - old_logprobs, 0.0)", "(logprobs - old_logprobs) * mask"
        ),
    ),
    # ==== Eq. (9)'s normalisation ====
    (
        "weights",
        "dr_grpo divided by each completion's own length",
        patch(
            "weights", "return mask / (G * max_new_tokens)", "return mask / (G * mask.sum(1, keepdim=True))"
        ),
    ),
    (
        "weights",
        "grpo without the clamp: a row without tokens is NaN",
        patch(
            "weights",
            "mask / (mask.sum(1, keepdim=True).clamp(min=1) * G)",
            "mask / (mask.sum(1, keepdim=True) * G)",
        ),
    ),
    (
        "weights",
        "grpo's G counts only the rows with tokens",
        patch(
            "weights",
            "mask / (mask.sum(1, keepdim=True).clamp(min=1) * G)",
            "mask / (mask.sum(1, keepdim=True).clamp(min=1) * (mask.sum(1) > 0).sum())",
        ),
    ),
    (
        "weights",
        "dapo without the world size",
        patch("weights", "return mask * world_size / tokens", "return mask / tokens"),
    ),
    (
        "weights",
        "dapo's N the rank's own tokens",
        patch(
            "weights",
            "tokens = mask.sum().clamp(min=1) if all_rank_tokens is None else all_rank_tokens",
            "tokens = mask.sum().clamp(min=1)",
        ),
    ),
    (
        "weights",
        "dr_grpo's L the padded width",
        patch("weights", "return mask / (G * max_new_tokens)", "return mask / (G * mask.shape[1])"),
    ),
    (
        "weights",
        "dr_grpo on every column, masked or not",
        patch(
            "weights",
            "return mask / (G * max_new_tokens)",
            "return torch.full_like(mask, 1 / (G * max_new_tokens))",
        ),
    ),
    (
        "weights",
        "all_rank_tokens taken for a tensor",
        patch("weights", "else all_rank_tokens", "else all_rank_tokens.clamp(min=1)"),
    ),
]


def run_checks_module():
    spec = importlib.util.spec_from_file_location("run_checks", CHECKS / "run_checks.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.fixture(scope="module")
def runner(tmp_path_factory):
    """run_checks.py's run_exercise, with the checks' folder importable (as the grader runs them)."""
    with pytest.MonkeyPatch.context() as monkeypatch:
        monkeypatch.syspath_prepend(str(CHECKS))
        yield run_checks_module()


@contextmanager
def applied(key: str, runner, wrong_body: str):
    """The project's module with the exercise's function replaced by one of the wrong body,
    compiled under the module's file name and in its globals, as the copy's would be, and bound in
    its place wherever the project imported it by name (reward.py's jaccard)."""
    exercise = BY_KEY[key]
    module = importlib.import_module(exercise.module)
    path = PROJECT / exercise.path
    source = replace_body(path.read_text(encoding="utf-8"), exercise.name, wrong_body)
    node = next(n for n in ast.parse(source).body if getattr(n, "name", None) == exercise.name)
    definition = "\n".join(source.splitlines()[node.lineno - 1 : node.end_lineno])
    original = getattr(module, exercise.name)
    holders = runner.bindings(original, runner.copy_modules(PROJECT))
    assert (module, exercise.name) in holders
    exec(compile(definition, str(path), "exec"), vars(module))
    for holder, name in holders:
        setattr(holder, name, getattr(module, exercise.name))
    try:
        yield
    finally:
        for holder, name in holders:
            setattr(holder, name, original)


def first_lines(runner, key: str) -> set[str]:
    checks = [c.partition(":") for c in BY_KEY[key].checks]
    return {runner.first_line(getattr(importlib.import_module(m), f).__doc__) for m, _, f in checks}


def plan() -> list[dict]:
    return [{"key": e.key, "function": e.function, "checks": list(e.checks)} for e in EXERCISES]


def test_the_projects_own_solutions_pass_every_check(runner):
    for exercise in plan():
        result = runner.run_exercise(exercise, str(PROJECT), plan(), {})
        assert result["passed"], result


def test_there_are_wrong_solutions_for_every_exercise():
    per_key = {e.key: sum(key == e.key for key, _, _ in WRONG) for e in EXERCISES}
    assert len(WRONG) >= 40 and min(per_key.values()) >= 4, per_key


@pytest.mark.parametrize(("key", "mistake", "wrong_body"), WRONG, ids=[f"{k}: {m}" for k, m, _ in WRONG])
def test_the_grader_fails_a_wrong_solution(runner, key, mistake, wrong_body):
    exercise = BY_KEY[key]
    everything = plan()
    with applied(key, runner, wrong_body()):
        result = runner.run_exercise(everything[EXERCISES.index(exercise)], str(PROJECT), everything, {})
    assert not result["passed"], f"{key}: the grader passes a wrong solution: {mistake}"
    assert result["checked"] in first_lines(runner, key), result
    assert "not implemented" not in result["error"] and "its own exercise" not in result["error"], result
