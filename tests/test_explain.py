"""stage2_grpo.py --explain (srt/grpo_explain.py): the groups it samples until one whose rewards differ,
Eq. (9) after the update as grpo_loss computes it, the one token whose term it writes out by hand, and
the HTML page of the step (srt/step_page.py).

Tolerances: every value compared here is produced by the same code path in one process (the page's
numbers are repr of the very floats the returned dict holds; the printed ones are 9 significant
digits of float32 values, which round-trip). The only differences left are float32 arithmetic in the
step against float64 in the test, about 1e-7 relative, so 1e-6 relative holds on any CPU."""

import math
import re
from html.parser import HTMLParser

import numpy as np
import pytest
import torch
from grpo_records import hand_experience
from records import hand_record
from test_stage2 import varied_reward

import stage2_grpo as g
from srt.data_io import write_jsonl
from srt.step_page import render_step_page, write_step_page

pytestmark = pytest.mark.usefixtures("one_thread")
K = 4


def constant_reward(completions, records):
    """What the base model earns on every completion (docs/grpo-step.md): no format, no recall, no answer."""
    return [{"format": 0.0, "recall": -1.25, "answer": -1.0, "total": -2.25} for _ in completions]


def constant_then_varied():
    """The first group's K rewards are all equal, every later group's differ."""
    calls = []

    def reward(completions, records):
        calls.append(len(completions))
        return (constant_reward if len(calls) == 1 else varied_reward)(completions, records)

    return reward


def run_explain(tmp_path, reward_fn, *extra):
    data = tmp_path / "train.jsonl"
    write_jsonl(data, [hand_record(i, 4, ("A1",), pruned_extra=(), price=10 + i) for i in range(4)])
    page = tmp_path / "page" / "step.html"
    cfg = g.parse_args(["--model", "tiny-random", "--data", str(data), "-K", str(K), "--max-new-tokens", "12",
                        "--sample-ratio", "2", "--lr", "1e-2", "--dtype", "float32",
                        "--explain-html", str(page), *extra])  # fmt: skip
    printed = []
    result = g.explain(cfg, reward_fn=reward_fn, print_fn=printed.append)
    return result, "\n".join(printed), page, cfg


@pytest.fixture(scope="module")
def explained(tmp_path_factory):
    return run_explain(tmp_path_factory.mktemp("explain"), constant_then_varied())


def test_an_all_equal_group_is_passed_over_for_the_next_prompt(explained):
    result, text, _, _ = explained
    assert result["tries"] == 2 and result["differs"], text
    skipped = [line for line in text.splitlines() if "rewards equal" in line]
    assert len(skipped) == 1 and "R = -2.2500" in skipped[0] and "trying the next prompt" in skipped[0]
    # Eq. (8) by hand on the explained group: population std, and advantages of both signs.
    rewards = np.array(result["rewards"])
    by_hand = (rewards - rewards.mean()) / (rewards.std() + 1e-8)
    assert np.abs(by_hand).max() > 0.5
    assert result["advantages"] == pytest.approx(by_hand.tolist(), rel=1e-6, abs=1e-6)


def test_with_a_constant_reward_it_stops_after_explain_tries_and_says_so(tmp_path):
    result, text, page, _ = run_explain(tmp_path, constant_reward, "--explain-tries", "3")
    assert result["tries"] == 3 and not result["differs"]
    skipped = [line for line in text.splitlines() if "rewards equal" in line]
    assert len(skipped) == 3 and "that was the last try" in skipped[-1]
    assert "None of the 3 groups sampled" in text
    assert result["advantages"] == [0.0] * K and page.exists()


def test_explain_tries_is_range_checked():
    with pytest.raises(SystemExit):
        g.parse_args(["--model", "tiny-random", "--explain", "--explain-tries", "0"])


class StepPage(HTMLParser):
    """The completion sections of the page, each with its token spans as (attributes, text)."""

    def __init__(self):
        super().__init__()
        self.sections, self.in_token = [], False

    def handle_starttag(self, tag, attrs):
        attrs, classes = dict(attrs), (dict(attrs).get("class") or "").split()
        if tag == "section" and "completion" in classes:
            self.sections.append({**attrs, "tokens": []})
        elif tag == "span" and "tok" in classes:
            self.sections[-1]["tokens"].append([attrs, ""])
            self.in_token = True

    def handle_endtag(self, tag):
        if tag == "span":
            self.in_token = False

    def handle_data(self, data):
        if self.in_token:
            self.sections[-1]["tokens"][-1][1] += data


def parse(page: str) -> list[dict]:
    parser = StepPage()
    parser.feed(page)
    parser.close()
    return parser.sections


def test_the_page_holds_the_step_token_by_token(explained):
    result, text, path, cfg = explained
    assert str(path) in text
    page = path.read_text(encoding="utf-8")
    for remote in ("http://", "https://", "<script src", "<link"):
        assert remote not in page.lower()
    sections = parse(page)
    assert [int(s["data-k"]) for s in sections] == list(range(1, K + 1))
    terms = varied_reward(result["texts"], [None] * K)  # the explained group was the second, varied
    eps = np.float32(1 + cfg.clip_eps), np.float32(1 - cfg.clip_eps)  # the flags were set in float32
    for k, section in enumerate(sections):
        assert float(section["data-reward"]) == pytest.approx(result["rewards"][k], rel=1e-6)
        assert float(section["data-advantage"]) == pytest.approx(result["advantages"][k], rel=1e-6)
        for name in ("format", "recall", "answer"):
            assert float(section[f"data-{name}"]) == pytest.approx(terms[k][name], rel=1e-6, abs=1e-9)
        row, spans = result["tokens"][k], section["tokens"]
        # |o_k| spans: the policy's tokens and any the program wrote (policy_mask 0)
        assert len(spans) == len(row["policy_mask"]) == len(row["ratio"])
        assert sum(int(a["data-policy"]) for a, _ in spans) == result["after"][k]["tokens"]
        ratios = [float(a["data-ratio"]) for a, _ in spans]
        by_hand = [math.exp(new - old) for new, old in zip(row["new_logprobs"], row["old_logprobs"])]
        assert ratios == pytest.approx(by_hand, rel=1e-6, nan_ok=True)
        A = float(section["data-advantage"])
        for (attrs, _), r in zip(spans, ratios):
            rule = (np.float32(r) > eps[0] and A > 0) or (np.float32(r) < eps[1] and A < 0)
            assert attrs["data-clipped"] == ("1" if rule else "0")
        assert "".join(piece for _, piece in spans) == result["texts"][k]
    assert any(abs(float(a["data-ratio"]) - 1) > 1e-6 for s in sections for a, _ in s["tokens"])


NUMBER = r"([-+]?(?:\d+\.?\d*(?:e[-+]?\d+)?|nan|inf))"


def test_the_one_token_line_follows_the_clipped_surrogate(explained):
    result, text, _, cfg = explained
    eps, beta = cfg.clip_eps, cfg.beta

    def printed(pattern):
        match = re.search(pattern, text, re.MULTILINE)
        assert match, (pattern, text)
        return [float(x) for x in match.groups()]

    d_ratio, r = printed(rf"^  r = exp\(log pi_theta - log pi_old\) = exp\({NUMBER}\) = {NUMBER}$")
    (A,) = printed(rf"^  A~ = {NUMBER} ")
    (unclipped,) = printed(rf"^  r \* A~ = {NUMBER}$")
    clip_r, clipped_term = printed(
        rf"^  clip\(r, 1 - [\d.]+, 1 \+ [\d.]+\) \* A~ = {NUMBER} \* A~ = {NUMBER}$"
    )
    (surrogate,) = printed(rf"^  min\(r \* A~, clip\(r\) \* A~\) = {NUMBER}: ")
    d, kl = printed(rf"^  k3 KL = exp\(d\) - d - 1, d = log pi_ref - log pi_theta = {NUMBER}: KL = {NUMBER}$")
    (w,) = printed(rf"^  w = min\(pi_old / pi_sampler, [\d.]+\) = min\(exp\(.*\), [\d.]+\) = {NUMBER} ")
    (term,) = printed(rf"^  its term of Eq. \(9\): w \* min\(...\) - beta \* KL = .* = {NUMBER}$")

    assert A != 0  # the explained group's rewards differ: the token is one with an advantage
    assert r == pytest.approx(math.exp(d_ratio), rel=1e-6)
    assert unclipped == pytest.approx(r * A, rel=1e-6)
    assert clip_r == pytest.approx(min(max(r, 1 - eps), 1 + eps), rel=1e-6)
    assert clipped_term == pytest.approx(clip_r * A, rel=1e-6)
    assert surrogate == pytest.approx(min(r * A, clip_r * A), rel=1e-6)
    is_clipped = (r > 1 + eps and A > 0) or (r < 1 - eps and A < 0)
    assert ("min() took the constant clip(r)" in text) == is_clipped
    assert kl == pytest.approx(math.exp(d) - d - 1, rel=1e-6, abs=1e-6)  # exp(d) - d - 1 cancels in float32
    assert term == pytest.approx(w * surrogate - beta * kl, rel=1e-6, abs=1e-9)
    # and it is the token of the returned arrays it names
    worked = result["worked"]
    assert r == pytest.approx(result["tokens"][worked["k"] - 1]["ratio"][worked["t"] - 1], rel=1e-6)


# log pi_old - log pi_sampler, token by token in turn: w = min(exp(.), --is-cap 2) is 2 (e, capped), 1.35, 1
# and 0.74, where the unmoved sampler (the policy itself on an fp32 CPU) gives w = 1 on every token.
SAMPLER_SHIFTS = (1.0, 0.3, 0.0, -0.3)


@pytest.mark.parametrize("loss_type", ["grpo", "dapo", "dr_grpo"])
def test_the_printed_eq9_is_grpo_loss_with_its_importance_weights(tmp_path, monkeypatch, loss_type):
    """Eq. (9) after the update, as --explain prints and returns it, is the loss the update minimises:
    each token's reported term times its reported weight, summed over the group, is minus the loss
    grpo_loss gives on the step's log-probs, advantages and truncated importance weights, and the
    printed loss is that loss. The sampler's log-probs are moved off pi_old so that w spans 0.74-2:
    a page that leaves w out (or re-derives Eq. (9) without it) is off by far more than rounding."""
    explained_rollouts = []
    sample_batch = g.sample_batch

    def sample_with_a_moved_sampler(*args, **kwargs):
        rollout = sample_batch(*args, **kwargs)
        assert rollout.sampler_logprobs is not None, "the decoder keeps each token's sampler log-prob"
        columns = rollout.sampler_logprobs.shape[1]
        shifts = torch.tensor(SAMPLER_SHIFTS).repeat(columns // len(SAMPLER_SHIFTS) + 1)[:columns]
        # Completion k's last 2k tokens marked as the program's (as --recall copy marks a copied turn):
        # completions of different policy lengths, where --loss-type grpo, dapo and dr_grpo differ.
        for k in range(1, len(rollout.policy_mask)):
            rollout.policy_mask[k, columns - 2 * k :] = 0
        rollout.sampler_logprobs = (rollout.sampler_logprobs - shifts) * rollout.policy_mask
        explained_rollouts.append(rollout)
        return rollout

    monkeypatch.setattr(g, "sample_batch", sample_with_a_moved_sampler)
    result, text, _, cfg = run_explain(tmp_path, varied_reward, "--loss-type", loss_type)
    rollout = explained_rollouts[-1]
    assert cfg.is_cap == 2 and cfg.loss_type == loss_type
    # Eq. (8) as the step computes it: Dr. GRPO's default drops the std, and the page says so
    assert ("A~ = R - mean (no std)" in text) == (loss_type == "dr_grpo")

    # The step's tensors rebuilt from what explain returns; a position past a completion's end is
    # outside the policy mask, so its zero counts in no term.
    mask = rollout.policy_mask.float()

    def padded(key):
        out = torch.zeros(mask.shape)
        for k, row in enumerate(result["tokens"]):
            out[k, : len(row[key])] = torch.tensor(row[key])
        return out

    new, old, ref = padded("new_logprobs"), padded("old_logprobs"), padded("ref_logprobs")
    advantages = torch.tensor(result["advantages"])
    is_weights = g.truncated_is_weights(old, rollout.sampler_logprobs, cfg.is_cap)
    halves = (slice(0, K // 2), slice(K // 2, K))  # --sample-ratio 2: the update's two minibatches

    def loss_of(loss_type, weights):
        """Eq. (9) over the two minibatches, each normalised by the one table (loss_weights)."""
        total = 0.0
        for rows in halves:
            record = hand_experience(old[rows], ref[rows], advantages[rows], mask[rows], loss_type,
                                     is_weights=None if weights is None else weights[rows],
                                     max_new_tokens=cfg.max_new_tokens)  # fmt: skip
            total += g.grpo_loss(new[rows], record, cfg.clip_eps, cfg.beta)[0].item()
        return total

    loss = loss_of(loss_type, is_weights)
    assert abs(loss_of(loss_type, None) - loss) > 1e-3  # the weights matter here: w left out would show
    other_type = {"grpo": "dapo", "dapo": "grpo", "dr_grpo": "grpo"}[loss_type]
    assert abs(loss_of(other_type, is_weights) - loss) > 1e-3  # and so does the normalisation
    # the printed weights are loss_weights' own, minibatch by minibatch
    table = torch.cat([g.loss_weights(mask[rows], loss_type, cfg.max_new_tokens) for rows in halves])
    assert padded("weight").tolist() == [pytest.approx(row, rel=1e-6) for row in table.tolist()]

    reported_w = padded("is_weight")[mask > 0]
    assert reported_w.tolist() == pytest.approx(is_weights[mask > 0].tolist(), rel=1e-6)
    assert reported_w.max().item() == 2 and reported_w.min().item() < 0.8  # capped at e, and below 1
    summed = sum(
        o * w for row in result["tokens"] for o, w in zip(row["objective"], row["weight"], strict=True)
    )
    assert summed == pytest.approx(-loss, rel=1e-5, abs=1e-7)
    assert sum(row["of_loss"] for row in result["after"]) == pytest.approx(-loss, rel=1e-5, abs=1e-7)
    assert result["loss"] == pytest.approx(loss, rel=1e-6, abs=1e-9)
    (line,) = [line for line in text.splitlines() if line.startswith("Eq. (9) on this group now")]
    assert f"--loss-type {loss_type}" in line
    printed = float(re.fullmatch(rf".*= {NUMBER}", line).group(1))  # 6 decimals
    assert printed == pytest.approx(loss, abs=5e-7)
    # the one token written out: its weight as the normalisation gives it
    worked, rows = result["worked"], result["tokens"][result["worked"]["k"] - 1]
    assert worked["weight"] == rows["weight"][worked["t"] - 1] > 0
    assert worked["is_weight"] == rows["is_weight"][worked["t"] - 1]
    assert f"its weight in the normalisation (--loss-type {loss_type}): " in text
    assert f"Each token's weight under --loss-type {loss_type}" in text


def test_the_page_escapes_text_and_marks_the_tokens_the_program_wrote(tmp_path):
    """A hand-made step: token text with markup and whitespace comes back verbatim, a copied token
    (policy_mask 0, --recall copy) is set apart, and the file is written whole."""
    tokens = ["<HIS>", "A1: ", 'it\'s <b>"$10" & more</b>\n', "</HIS>", " yes", ""]
    step = {
        "title": "a <step>",
        "settings": [("K", 2)],
        "prompt": {
            "id": "r&1",
            "history_turns": 2,
            "query_turn": 2,
            "query": "q <?>",
            "recall": ["A1"],
            "answer": "a & b",
        },
        "tries": 1,
        "differs": True,
        "clip_eps": 0.2,
        "beta": 0.04,
        "mean": 0.0,
        "std": 1.0,
        "completions": [
            {
                "k": k + 1,
                "format": 1.0,
                "recall": 0.5 * s,
                "answer": 0.25,
                "total": 1.25 + 0.5 * s,
                "advantage": s * 1.0,
                "tokens": tokens,
                "marks": [""] * 5 + ["<|endoftext|>"],
                "ratio": [1.3, 1.0, 1.0, 1.0, 0.7, 1.0],
                "kl": [1e-3, 0.0, 0.0, 0.0, 2e-3, 0.0],
                "clipped": [s > 0, False, False, False, s < 0, False],
                "policy_mask": [1, 1, 0, 0, 1, 1],
            }
            for k, s in enumerate((1, -1))
        ],
    }
    path = write_step_page(tmp_path / "sub" / "p.html", step)
    page = (tmp_path / "sub" / "p.html").read_text(encoding="utf-8")
    assert path.endswith("p.html") and page == render_step_page(step)
    assert "a <step>" not in page and '<b>"$10"' not in page and "q <?>" not in page
    sections = parse(page)
    assert len(sections) == 2
    for section in sections:
        spans = section["tokens"]
        assert [piece for _, piece in spans] == tokens
        assert [a["data-policy"] for a, _ in spans] == ["1", "1", "0", "0", "1", "1"]
        assert all("copied" in a["class"] for a, _ in spans[2:4])
        assert spans[5][0]["data-mark"] == "<|endoftext|>"
    assert [a["data-clipped"] for a, _ in sections[0]["tokens"]] == ["1", "0", "0", "0", "0", "0"]
    assert [a["data-clipped"] for a, _ in sections[1]["tokens"]] == ["0", "0", "0", "0", "1", "0"]
    assert list(tmp_path.joinpath("sub").iterdir()) == [tmp_path / "sub" / "p.html"]  # no temporary left
