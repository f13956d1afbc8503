"""Stage 2 (§3.4): Eq. (8) advantages, Eq. (9) loss, the k3 KL, sampling and log-probs, learning on
a toy verifiable task, a skipped non-finite step, resume, and DDP under torchrun. Everything runs on
the tiny random Llama; records are built by hand."""

import json
import math
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
from grpo_records import hand_loss, run_step
from records import hand_record
from safetensors.torch import load_file

import stage2_grpo as g
from reward import compute_rewards
from srt import generation
from srt.data_io import DataError, read_jsonl, write_jsonl
from srt.generation import completion_logprobs
from srt.loading import load_model_and_tokenizer
from srt.probe import evaluate_policy, pick_eval_records, sample_lines
from srt.prompt import fit_prompt, render_prompt
from srt.rollouts import PromptStream
from srt.training import warmup_lr

REPO = Path(__file__).resolve().parents[1]


def make_record(i: int, rounds: int = 4, recall=("A1",)) -> dict:
    return hand_record(i, rounds, recall, pruned_extra=(), price=10 + i)


pytestmark = pytest.mark.usefixtures("one_thread")


def length_reward(completions, examples):
    """A toy verifiable reward with spread inside every group: longer text, more reward."""
    return [{"total": len(text) / 100.0, "format": 0.0} for text in completions]


def config(*extra):
    return g.parse_args(["--model", "tiny-random", "--dtype", "float32", *extra])


# ---------------------------------------------------------------------------------------------
# Eq. (8)
# ---------------------------------------------------------------------------------------------
def test_group_advantages_against_hand_values():
    rewards = torch.tensor(
        [
            [1.0, 2.0, 3.0, 4.0],  # mean 2.5, population std sqrt(1.25)
            [0.7, 0.7, 0.7, 0.7],  # all equal: nothing to learn
            [-1.0, 1.0, -1.0, 1.0],
        ]
    )  # mean 0, std 1
    a = g.group_advantages(rewards)
    s = math.sqrt(1.25)
    assert torch.allclose(a[0], torch.tensor([-1.5 / s, -0.5 / s, 0.5 / s, 1.5 / s]), atol=1e-6)
    assert torch.equal(a[1], torch.zeros(4))
    assert torch.allclose(a[2], torch.tensor([-1.0, 1.0, -1.0, 1.0]), atol=1e-6)
    # Every group's advantages sum to zero and, when rewards differ, have unit population std.
    assert torch.allclose(a.sum(1), torch.zeros(3), atol=1e-6)


def test_group_advantages_group_of_one_and_nan():
    assert torch.equal(g.group_advantages(torch.tensor([[5.0], [-3.0]])), torch.zeros(2, 1))
    # A float mean of equal values is not always exact; the advantage still is.
    assert torch.equal(g.group_advantages(torch.full((1, 8), 0.1)), torch.zeros(1, 8))
    # A NaN reward must not be hidden: it makes the loss non-finite and the step is skipped.
    assert torch.isnan(g.group_advantages(torch.tensor([[1.0, float("nan"), 2.0]]))).all()


def test_placebo_permutes_rewards_inside_each_group_and_never_across():
    """The placebo's control is only as good as its shuffle: each group keeps exactly its own K reward
    records (so its mean, spread and dynamic-sampling fate are unchanged) while the link to the
    completions is cut. A shuffle across the whole batch, or one that forgot to write back, fails."""
    import random

    K, groups = 4, 10

    def reward_by_position(completions, examples):
        return [{"total": float(i), "text": c} for i, c in enumerate(completions)]

    shuffled = g.shuffled_within_groups(reward_by_position, K, random.Random(0))
    texts = [f"c{i}" for i in range(K * groups)]
    out = shuffled(texts, [None] * len(texts))
    for start in range(0, len(texts), K):
        assert sorted(r["total"] for r in out[start : start + K]) == [
            float(i) for i in range(start, start + K)
        ]
    moved = sum(r["text"] != t for r, t in zip(out, texts))
    assert moved >= groups  # seed 0 is fixed; a shuffle that is never written back moves nothing
    with pytest.raises(ValueError, match="whole groups"):
        shuffled(texts[:6], [None] * 6)


def test_placebo_trains_on_rewards_shuffled_within_each_group(tmp_path, monkeypatch):
    """--placebo reaches the update: the rollout Eq. (8) reads holds each group's own rewards, some
    of them on another completion of the group; without it every reward sits on its own completion.
    It is recorded in config.json and is one of the settings a resume must match."""
    data = tmp_path / "train.jsonl"
    write_jsonl(data, [make_record(i) for i in range(3)])
    common = ["--model", "tiny-random", "--dtype", "float32", "--data", str(data), "-K", "4",
              "--prompts-per-step", "2", "--max-new-tokens", "4", "--beta", "0", "--max-steps", "2",
              "--save-every", "0", "--eval-limit", "0", "--max-prompt-length", "0"]  # fmt: skip

    def reward_of_text(completions, examples):
        return [{"total": float(hash(text) % 1000), "format": 0.0, "text": text} for text in completions]

    real_experience = g.make_experience
    for placebo in (False, True):
        rollouts = []

        def recording(models, rollout, settings):
            rollouts.append(rollout)
            return real_experience(models, rollout, settings)

        monkeypatch.setattr(g, "make_experience", recording)
        out = tmp_path / f"placebo-{placebo}"
        g.train(
            g.parse_args(common + ["--out", str(out)] + ["--placebo"] * placebo), reward_fn=reward_of_text
        )
        assert len(rollouts) == 2 and json.loads((out / "config.json").read_text())["placebo"] is placebo
        moved = 0
        for rollout in rollouts:
            for start in range(0, len(rollout.texts), 4):
                texts, scores = rollout.texts[start : start + 4], rollout.scores[start : start + 4]
                assert sorted(s["text"] for s in scores) == sorted(texts)  # the group's own rewards
                moved += sum(s["text"] != t for s, t in zip(scores, texts))
        assert (moved > 0) is placebo
    assert "placebo" in g.RESUME_MUST_MATCH


# ---------------------------------------------------------------------------------------------
# Eq. (9)
# ---------------------------------------------------------------------------------------------
def test_loss_on_policy_is_minus_mean_advantage():
    torch.manual_seed(0)
    logprobs = -torch.rand(3, 5) * 3
    mask = torch.tensor([[1, 1, 1, 1, 1], [1, 1, 0, 0, 0], [1, 1, 1, 0, 0]])
    advantages = torch.tensor([1.5, -0.5, -1.0])
    for beta in (0.0, 0.04):  # the reference equals the policy: KL 0
        loss, stats = hand_loss(logprobs, logprobs.clone(), logprobs.clone(), advantages, mask, beta=beta)
        assert loss.item() == pytest.approx(-advantages.mean().item(), abs=1e-6)
        assert stats["kl"] == 0.0 and stats["clip_fraction"] == 0.0 and stats["ratio"] == pytest.approx(1.0)
    # token normalisation weighs each completion by its length: -(5*1.5 - 2*0.5 - 3*1.0) / 10
    loss, _ = hand_loss(logprobs, logprobs.clone(), None, advantages, mask, beta=0.0, loss_type="dapo")
    assert loss.item() == pytest.approx(-0.35, abs=1e-6)


def test_clipping_engages_exactly_outside_the_interval_in_the_right_direction():
    ratios = torch.tensor([0.5, 0.79, 0.81, 1.0, 1.19, 1.21, 1.5])
    logprobs = torch.log(ratios).repeat(2, 1).requires_grad_(True)  # old log-probs 0: r = exp(logp)
    advantages = torch.tensor([1.0, -1.0])
    mask = torch.ones(2, 7)
    loss, stats = hand_loss(logprobs, torch.zeros(2, 7), None, advantages, mask, clip_eps=0.2, beta=0.0)
    # A > 0: min(r, clip(r)) -> r below 1.2, 1.2 above.  A < 0: min(-r, -clip(r)) -> -0.8 below 0.8, -r above.
    positive = [0.5, 0.79, 0.81, 1.0, 1.19, 1.2, 1.2]
    negative = [-0.8, -0.8, -0.81, -1.0, -1.19, -1.21, -1.5]
    expected = -(sum(positive) / 7 + sum(negative) / 7) / 2
    assert loss.item() == pytest.approx(expected, abs=1e-6)
    assert stats["clip_fraction"] == pytest.approx(4 / 14)
    loss.backward()
    # d loss / d logp = -(1/G)(1/|o|) A r where unclipped, 0 where clipped.
    clipped_pos = torch.tensor([False, False, False, False, False, True, True])
    clipped_neg = torch.tensor([True, True, False, False, False, False, False])
    want_pos = torch.where(clipped_pos, 0.0, -ratios / 14)
    want_neg = torch.where(clipped_neg, 0.0, ratios / 14)
    assert torch.allclose(logprobs.grad[0], want_pos, atol=1e-6)
    assert torch.allclose(logprobs.grad[1], want_neg, atol=1e-6)


def test_seq_and_token_normalisation_differ_on_unequal_lengths():
    def run(loss_type):
        logprobs = torch.zeros(2, 3, requires_grad=True)
        mask = torch.tensor([[1, 0, 0], [1, 1, 1]])  # |o_1| = 1, |o_2| = 3
        loss, _ = hand_loss(
            logprobs, logprobs.detach(), None, torch.tensor([1.0, -1.0]), mask, beta=0.0, loss_type=loss_type
        )
        loss.backward()
        return loss.item(), logprobs.grad

    loss, grad = run("grpo")  # -(1/2)(1 - 1) = 0; token of the short one weighs 1/2, others 1/6
    assert loss == pytest.approx(0.0, abs=1e-7)
    assert torch.allclose(grad, torch.tensor([[-0.5, 0.0, 0.0], [1 / 6, 1 / 6, 1 / 6]]))
    loss, grad = run("dapo")  # -(1 - 3) / 4 = 0.5; every token weighs 1/4
    assert loss == pytest.approx(0.5)
    assert torch.allclose(grad, torch.tensor([[-0.25, 0.0, 0.0], [0.25, 0.25, 0.25]]))


def test_kl_term_enters_with_beta():
    logprobs = torch.zeros(1, 2)
    ref = torch.log(torch.tensor([[0.5, 2.0]]))  # k3 = r - log r - 1 with r = pi_ref / pi
    k3 = torch.tensor([0.5 - math.log(0.5) - 1, 2.0 - math.log(2.0) - 1])
    assert torch.allclose(g.k3_kl(logprobs, ref)[0], k3)
    loss, stats = hand_loss(logprobs, logprobs, ref, torch.zeros(1), torch.ones(1, 2), beta=0.1)
    assert loss.item() == pytest.approx(0.1 * k3.mean().item(), abs=1e-7)
    assert stats["kl"] == pytest.approx(k3.mean().item(), abs=1e-7)


def test_k3_kl_is_non_negative_and_zero_for_the_same_model(tiny):
    torch.manual_seed(0)
    a, b = torch.randn(64, 32) * 3, torch.randn(64, 32) * 3
    assert (g.k3_kl(a, b) >= 0).all()
    model, tokenizer = tiny
    batch = tokenizer(["Final answer: yes", "Q1: hello there"], return_tensors="pt", padding=True)
    policy_lp, _ = g.completion_logprobs(model, batch.input_ids, batch.attention_mask, 3)
    ref_lp, _ = g.completion_logprobs(model, batch.input_ids, batch.attention_mask, 3)
    assert torch.equal(g.k3_kl(policy_lp, ref_lp), torch.zeros_like(policy_lp))


# ---------------------------------------------------------------------------------------------
# Sampling and the log-probs we train on
# ---------------------------------------------------------------------------------------------
def test_completion_mask_stops_after_the_first_stop_token():
    ids = torch.tensor([[5, 2, 7, 2], [5, 6, 7, 8], [2, 0, 0, 0], [9, 9, 3, 0]])
    assert torch.equal(
        generation.completion_mask(ids, [2, 3]),
        torch.tensor([[1, 1, 0, 0], [1, 1, 1, 1], [1, 0, 0, 0], [1, 1, 1, 0]]),
    )


def test_logprobs_match_the_sampling_distribution_under_left_padding(tiny):
    """The log-probs of Eq. (9) must be those of the distribution generate sampled from (logits / T,
    no hidden top-k), for the left-padded prompt too, and only up to the stop token."""
    model, tokenizer = tiny
    torch.manual_seed(0)
    prompts = ["Hello", "Q1: I need the Chakra Balancing service. A1: It is $180. Q2: and the price?"]
    tokenizer.padding_side = "left"
    enc = tokenizer(prompts, return_tensors="pt", padding=True, add_special_tokens=False)
    assert enc.attention_mask[0, 0] == 0  # the short prompt is padded
    out = model.generate(
        **enc,
        do_sample=True,
        temperature=0.7,
        top_k=0,
        top_p=1.0,
        max_new_tokens=6,
        output_logits=True,
        return_dict_in_generate=True,
        pad_token_id=tokenizer.pad_token_id,
    )
    logits = torch.stack(out.logits, dim=1)
    C = logits.shape[1]
    completion = out.sequences[:, -C:]
    expected = (logits / 0.7).log_softmax(-1).gather(-1, completion.unsqueeze(-1)).squeeze(-1)
    mask = generation.completion_mask(completion, generation.stop_token_ids(model, tokenizer))
    attention = torch.cat([enc.attention_mask, mask], dim=1)
    logprobs, entropy = g.completion_logprobs(
        model, out.sequences, attention, C, temperature=0.7, with_entropy=True
    )
    keep = mask.bool()
    assert torch.allclose(logprobs[keep], expected[keep], atol=1e-4)
    full = (logits / 0.7).log_softmax(-1)
    assert torch.allclose(entropy[keep], -(full.exp() * full).sum(-1)[keep], atol=1e-4)


def test_shared_prompt_logprobs_and_gradients_equal_the_unshared_ones(tiny):
    """completion_logprobs(share_prompts=True) runs each distinct prompt once and copies its KV
    cache to its rows. Two groups of K = 3 with left-padded prompts of different lengths and
    right-padded completions: the log-probs, the entropies and the gradient of a loss on them must
    be those of one plain pass over the six rows."""
    model, tokenizer = tiny
    torch.manual_seed(0)
    out = generation.generate(
        model,
        tokenizer,
        ["Hello", "Q1: I need the Chakra Balancing service. A1: It is $180."],
        max_new_tokens=5,
        num_generations=3,
        temperature=1.0,
    )
    mask = out["completion_mask"].clone()
    mask[0, 3:] = 0  # one row stopped early: its tail is padding
    ids = torch.cat([out["prompt_ids"], out["completion_ids"]], 1)
    attention = torch.cat([out["prompt_mask"], mask], 1)
    assert out["prompt_mask"][0, 0] == 0 and not torch.equal(
        out["completion_ids"][0], out["completion_ids"][1]
    )
    weights = torch.randn(6, 5)
    results = {}
    for share in (False, True):
        model.zero_grad(set_to_none=True)
        logprobs, entropy = completion_logprobs(model, ids, attention, 5, 0.9, True, share_prompts=share)
        ((logprobs * weights * mask).sum()).backward()
        grads = torch.cat([p.grad.flatten() for p in model.parameters() if p.grad is not None])
        results[share] = (logprobs.detach(), entropy, grads)
    model.zero_grad(set_to_none=True)
    (plain_lp, plain_h, plain_g), (shared_lp, shared_h, shared_g) = results[False], results[True]
    keep = mask.bool()
    assert torch.allclose(shared_lp[keep], plain_lp[keep], atol=1e-5)
    assert torch.allclose(shared_h[keep], plain_h[keep], atol=1e-5)
    assert plain_g.abs().max() > 0 and torch.allclose(shared_g, plain_g, atol=1e-5, rtol=1e-4)


def test_generate_ignores_a_checkpoints_repetition_penalty_and_top_k():
    """Qwen2.5-Instruct ships generation_config.json with repetition_penalty 1.05 and top_k 20. The
    penalty lowers exactly the prompt tokens a verbatim recall copies; GRPO's ratio and KL use
    plain softmax(logits / T). The shared generate must sample from the latter. Sampled through the
    "hf" engine, whose draws share generate's random stream (our loop draws with its own, and
    reads no setting of the checkpoint but suppress_tokens: greedy, it must equal plain greedy)."""
    model, tokenizer = load_model_and_tokenizer("tiny-random", dtype="float32")
    model.generation_config.repetition_penalty, model.generation_config.top_k = 1.05, 20
    prompts = ["Q1: I need the Chakra Balancing service. A1: It is $180. Q2: and the price?"]
    torch.manual_seed(7)
    ours = generation.generate(
        model, tokenizer, prompts, max_new_tokens=24, num_generations=32, temperature=0.9, engine="hf"
    )
    stops = generation.stop_token_ids(model, tokenizer)

    def sample(**settings):
        torch.manual_seed(7)
        out = model.generate(
            input_ids=ours["prompt_ids"],
            attention_mask=ours["prompt_mask"],
            do_sample=True,
            temperature=0.9,
            top_p=1.0,
            max_new_tokens=24,
            eos_token_id=stops,
            pad_token_id=tokenizer.pad_token_id,
            **settings,
        )
        return out[:, ours["prompt_ids"].shape[1] :]

    plain = sample(top_k=0, repetition_penalty=1.0)
    assert torch.equal(ours["completion_ids"], plain)
    # Either of the checkpoint's settings alone would have sampled otherwise (the test can fail).
    assert not torch.equal(sample(top_k=0), plain) and not torch.equal(sample(repetition_penalty=1.0), plain)
    greedy = generation.generate(model, tokenizer, prompts, max_new_tokens=24, greedy=True)
    plain_greedy = model.generate(
        input_ids=greedy["prompt_ids"], attention_mask=greedy["prompt_mask"], do_sample=False, top_k=0,
        repetition_penalty=1.0, max_new_tokens=24, eos_token_id=stops, pad_token_id=tokenizer.pad_token_id,
    )[:, greedy["prompt_ids"].shape[1] :]  # fmt: skip
    assert torch.equal(greedy["completion_ids"], plain_greedy)


def test_prefilling_each_prompt_once_samples_exactly_what_k_prefills_do(tiny):
    """generate prefills a prompt once and copies its KV cache to the K samples; with the same seed
    the completions must equal those of K separate prefills, left padding included."""
    model, tokenizer = tiny
    prompts = ["Hello", "Q1: I need the Chakra Balancing service. A1: It is $180. Q2: and the price?"]
    for greedy in (False, True):
        torch.manual_seed(11)
        shared = generation.generate(
            model, tokenizer, prompts, max_new_tokens=16, num_generations=6, greedy=greedy
        )
        torch.manual_seed(11)
        repeated = generation.generate(
            model, tokenizer, prompts, max_new_tokens=16, num_generations=6, greedy=greedy, prefill_once=False
        )
        assert torch.equal(shared["completion_ids"], repeated["completion_ids"])
        assert torch.equal(shared["completion_mask"], repeated["completion_mask"])


def test_generate_groups_k_completions_per_prompt(tiny):
    model, tokenizer = tiny
    torch.manual_seed(0)
    out = generation.generate(
        model,
        tokenizer,
        ["Hello", "Q1: a much longer prompt than the first one"],
        num_generations=3,
        max_new_tokens=5,
    )
    assert out["completion_ids"].shape[0] == 6 and len(out["texts"]) == 6
    assert out["prompt_ids"].shape[1] == out["prompt_mask"].shape[1]
    # rows 0-2 belong to prompt 0 (left padded), rows 3-5 to prompt 1
    assert torch.equal(out["prompt_ids"][0], out["prompt_ids"][2]) and torch.equal(
        out["prompt_ids"][3], out["prompt_ids"][5]
    )
    assert out["prompt_mask"][:3, 0].sum() == 0 and out["prompt_mask"][3:, 0].sum() == 3
    assert (out["completion_mask"].sum(1) >= 1).all()


# ---------------------------------------------------------------------------------------------
# Prompts and data position
# ---------------------------------------------------------------------------------------------
def test_fit_prompt_drops_oldest_turns_whatever_they_are_and_counts_lost_gold(tiny):
    _, tokenizer = tiny
    record = make_record(0, rounds=12, recall=("Q1",))
    full = render_prompt(tokenizer, record)
    n_full = len(tokenizer(full, add_special_tokens=False).input_ids)
    assert fit_prompt(tokenizer, record, 0) == (full, 0)
    assert fit_prompt(tokenizer, record, n_full) == (full, 0)
    short, gold_cut = fit_prompt(tokenizer, record, n_full - 1)
    # No gold at prompt time: Q1 (H*) is the oldest turn and goes first; the loss is only counted.
    assert "Q1: user line 1" not in short and "A1: agent line 1" in short and gold_cut == 1
    assert len(tokenizer(short, add_special_tokens=False).input_ids) <= n_full - 1
    # The same prompt whatever H* says: fitting never reads the gold recall set.
    same, _ = fit_prompt(tokenizer, {**record, "recall": ["A11"], "pruned": ["A11"]}, n_full - 1)
    assert same == short
    assert fit_prompt(tokenizer, record, 50) == (None, 0)  # not even the query fits


def test_prompt_stream_shards_ranks_and_resumes(tiny):
    _, tokenizer = tiny
    records = [make_record(i) for i in range(7)]
    streams = [PromptStream(records, tokenizer, 0, seed=3, rank=r, world_size=2) for r in range(2)]
    seen = [[rec["id"] for rec, _ in s.next_batch(2)] for s in streams]
    assert not set(seen[0]) & set(seen[1]) and len(set(seen[0] + seen[1])) == 4
    state = streams[0].state_dict()
    later = [rec["id"] for _ in range(3) for rec, _ in streams[0].next_batch(2)]  # crosses an epoch
    again = PromptStream(records, tokenizer, 0, seed=3, rank=0, world_size=2)
    again.load_state_dict(state)
    assert [rec["id"] for _ in range(3) for rec, _ in again.next_batch(2)] == later


def test_prompt_stream_truncates_long_histories_and_skips_what_cannot_fit(tiny):
    _, tokenizer = tiny
    short = [make_record(i, rounds=2) for i in range(3)]
    long_history = [make_record(10 + i, rounds=12, recall=("Q1",)) for i in range(2)]
    long_query = [{**make_record(20 + i, rounds=2), "query": "why " * 400} for i in range(2)]
    limit = max(
        len(tokenizer(render_prompt(tokenizer, r), add_special_tokens=False).input_ids) for r in short
    )
    stream = PromptStream(short + long_history + long_query, tokenizer, limit, seed=0)
    batches = [stream.next_batch(1)[0] for _ in range(10)]
    ids = {rec["id"] for rec, _ in batches}
    assert ids == {r["id"] for r in short + long_history}  # long histories lose old turns, not the record
    assert stream.skipped >= 2 and stream.gold_cut >= 2  # Q1 of each long history went with the oldest turns
    assert all(len(tokenizer(p, add_special_tokens=False).input_ids) <= limit for _, p in batches)
    with pytest.raises(DataError, match="max-prompt-length"):
        PromptStream(long_query, tokenizer, limit, seed=0).next_batch(1)


# ---------------------------------------------------------------------------------------------
# The step: learning, and a non-finite step
# ---------------------------------------------------------------------------------------------
def test_grpo_step_raises_reward_on_a_toy_task():
    """Reward: the fraction of completion tokens in the lower half of the vocabulary. A seeded run
    of 8 GRPO steps must raise the policy's mean reward clearly (measured on fresh samples)."""
    policy, tokenizer = load_model_and_tokenizer("tiny-random", dtype="float32")
    half = len(tokenizer) // 2

    def reward_fn(completions, examples):
        scores = []
        for text in completions:
            ids = tokenizer(text, add_special_tokens=False).input_ids
            scores.append({"total": sum(i < half for i in ids) / max(1, len(ids))})
        return scores

    prompts, records = ["Hello", "Q1: What time is it?"], [make_record(0), make_record(1)]
    cfg = config("-K", "8", "--max-new-tokens", "8", "--lr", "0.1", "--sample-ratio", "1", "--beta", "0")

    def mean_reward():
        with torch.random.fork_rng():
            torch.manual_seed(123)
            out = generation.generate(policy, tokenizer, prompts, num_generations=32, max_new_tokens=8)
        return float(np.mean([s["total"] for s in reward_fn(out["texts"], None)]))

    torch.manual_seed(0)
    optimizer = torch.optim.AdamW(policy.parameters(), lr=cfg.lr, weight_decay=0.0)
    before = mean_reward()
    for _ in range(8):
        result = run_step(policy, None, tokenizer, optimizer, records, prompts, cfg, reward_fn=reward_fn)
        assert result.updates == 1 and result.skipped_updates == 0
    after = mean_reward()
    assert after > before + 0.15, (before, after)


def test_only_the_first_minibatch_is_on_policy():
    """Old log-probs: the first minibatch of the first pass runs before any update (ratio exactly 1,
    no extra forward pass); every later minibatch must be compared with pi_old as it was before the
    first update. An implementation that detached the current log-probs everywhere (or scored pi_old
    after the first update) would report a ratio of exactly 1 for every update."""
    prompts, records = ["Hello", "Q1: What time is it?"], [make_record(0), make_record(1)]
    ratios = {}
    for ratio in ("1", "2"):
        policy, tokenizer = load_model_and_tokenizer("tiny-random", dtype="float32")
        optimizer = torch.optim.SGD(policy.parameters(), lr=0.5)
        cfg = config(
            "-K", "4", "--max-new-tokens", "6", "--sample-ratio", ratio, "--beta", "0", "--clip-eps", "10"
        )
        torch.manual_seed(0)
        result = run_step(policy, None, tokenizer, optimizer, records, prompts, cfg, reward_fn=length_reward)
        ratios[ratio] = result.ratio, result.updates
    assert ratios["1"] == (1.0, 1)
    mean_ratio, updates = ratios["2"]
    assert updates == 2 and abs(mean_ratio - 1.0) > 1e-4  # (1 + r_2) / 2 with r_2 off-policy


def test_dynamic_sampling_replaces_groups_whose_rewards_are_all_equal():
    """Prompt "flat" always gets the same total reward (advantage 0); prompt "echo" gets varied totals
    but always the same recall part. --dynamic-sampling total replaces only the first, --dynamic-sampling
    recall both, by drawing fresh prompts within --max-draws."""
    policy, tokenizer = load_model_and_tokenizer("tiny-random", dtype="float32")
    flat, echo, varied = make_record(0), make_record(1), make_record(2)

    def reward(completions, examples):
        return [
            {
                "total": 0.0 if e is flat else len(c) / 100.0,
                "recall": len(c) / 100.0 if e is varied else -1.25,
            }
            for c, e in zip(completions, examples)
        ]

    cases = [
        ("off", flat, 1, flat),
        ("total", flat, 2, varied),
        ("total", echo, 1, echo),
        ("recall", echo, 2, varied),
    ]
    for mode, first, expected_draws, kept in cases:
        queue = [([varied], ["Q1: What time is it?"])] * 3
        optimizer = torch.optim.AdamW(policy.parameters(), lr=1e-3)
        cfg = config(
            "-K",
            "4",
            "--max-new-tokens",
            "6",
            "--sample-ratio",
            "1",
            "--beta",
            "0",
            "--dynamic-sampling",
            mode,
            "--max-draws",
            "3",
        )
        torch.manual_seed(0)
        result = run_step(
            policy,
            None,
            tokenizer,
            optimizer,
            [first],
            ["Hello"],
            cfg,
            reward_fn=reward,
            draw_more=lambda: queue.pop(0),
        )
        assert result.draws == expected_draws and result.groups_drawn == expected_draws, mode
        assert result.groups_all_equal == (first is flat) and result.groups_recall_constant == 1, mode
        assert {r["id"] for r in result.records} == {kept["id"]}, mode
    # Bounded: a stream of flat prompts only stops after --max-draws and keeps a flat group.
    queue = [([flat], ["Hello"])] * 5
    cfg = config(
        "-K",
        "2",
        "--max-new-tokens",
        "4",
        "--sample-ratio",
        "1",
        "--beta",
        "0",
        "--dynamic-sampling",
        "total",
        "--max-draws",
        "3",
    )
    result = run_step(
        policy,
        None,
        tokenizer,
        optimizer,
        [flat],
        ["Hello"],
        cfg,
        reward_fn=reward,
        draw_more=lambda: queue.pop(0),
    )
    assert result.draws == 3 and len(queue) == 3 and result.groups_all_equal == 3


def test_per_token_advantages_enter_the_loss_token_by_token():
    """--credit segment hands grpo_loss one advantage per token: on policy, the loss is minus the mean
    over completions of each completion's mean token advantage (hand value), and a token's gradient
    has the sign of its own advantage, not of its row's."""
    logprobs = torch.zeros(2, 3, requires_grad=True)
    advantages = torch.tensor([[1.0, -1.0, -1.0], [2.0, 2.0, 0.0]])
    mask = torch.tensor([[1, 1, 1], [1, 1, 0]])
    loss, _ = hand_loss(logprobs, logprobs.detach(), None, advantages, mask, beta=0.0)
    assert loss.item() == pytest.approx(-((1 - 1 - 1) / 3 + (2 + 2) / 2) / 2, abs=1e-6)
    loss.backward()
    assert logprobs.grad[0, 0] < 0 < logprobs.grad[0, 1] and logprobs.grad[1, 2] == 0  # descent raises A > 0


def test_think_lengths_end_at_the_closing_think_tag(tiny):
    _, tokenizer = tiny
    texts = [
        "<think>\n<HIS>Q1: The spa opens at 9.</HIS>\n</think>\nFinal answer: at 9",
        "Final answer: at 9",
    ]
    rows = [tokenizer(t, add_special_tokens=False).input_ids for t in texts]
    width = max(map(len, rows))
    ids = torch.tensor([r + [tokenizer.pad_token_id] * (width - len(r)) for r in rows])
    lengths = g.think_lengths(tokenizer, ids).tolist()
    first = rows[0][: lengths[0]]
    assert tokenizer.decode(first).endswith("</think>") and "</think>" not in tokenizer.decode(first[:-1])
    assert lengths[0] < len(rows[0]) and lengths[1] == width  # no tag: every token is the think part's


def test_segment_credit_pays_the_recall_tokens_for_the_recall_and_the_answer_tokens_for_the_answer(
    monkeypatch,
):
    """Sample 0 recalls H* and answers wrong; samples 1-3 miss H* and answer right. The totals are equal,
    so Eq. (8) gives the whole group advantage 0 (--credit sequence); --credit segment gives sample 0's
    think tokens +sqrt(3) and its answer tokens -sqrt(3), the others -1/sqrt(3) and +1/sqrt(3)."""
    policy, tokenizer = load_model_and_tokenizer("tiny-random", dtype="float32")

    def reward(completions, examples):
        return [
            {"total": 0.0, "format": 1.0, "recall": r, "answer": -r - 1.0} for r in (1.0, -1.0, -1.0, -1.0)
        ]

    seen = []
    real_loss = g.grpo_loss
    monkeypatch.setattr(
        g,
        "grpo_loss",
        lambda logprobs, part, *a: seen.append(part.advantages.clone()) or real_loss(logprobs, part, *a),
    )
    monkeypatch.setattr(g, "think_lengths", lambda tok, ids: torch.tensor([1, 2, 0, ids.shape[1]]))
    for credit in ("sequence", "segment"):
        seen.clear()
        cfg = config(
            "-K", "4", "--max-new-tokens", "6", "--sample-ratio", "1", "--beta", "0", "--credit", credit
        )
        torch.manual_seed(0)
        run_step(
            policy,
            None,
            tokenizer,
            torch.optim.SGD(policy.parameters(), lr=0.0),
            [make_record(0)],
            ["Hello"],
            cfg,
            reward_fn=reward,
        )
        (advantages,) = seen
        if credit == "sequence":
            assert torch.equal(advantages, torch.zeros_like(advantages))
            continue
        C, high, low = advantages.shape[1], math.sqrt(3), 1 / math.sqrt(3)
        expected = torch.tensor(
            [[high] * 1 + [-high] * (C - 1), [-low] * 2 + [low] * (C - 2), [low] * C, [-low] * C]
        )
        assert torch.allclose(advantages, expected, atol=1e-5), advantages
    assert "credit" in g.RESUME_MUST_MATCH


def test_non_finite_loss_is_skipped_and_leaves_weights_unchanged(tiny):
    _, tokenizer = tiny
    policy, _ = load_model_and_tokenizer("tiny-random", dtype="float32")
    ref, _ = load_model_and_tokenizer("tiny-random", dtype="float32")
    before = {k: v.clone() for k, v in policy.state_dict().items()}
    optimizer = torch.optim.AdamW(policy.parameters(), lr=0.1)

    def nan_reward(completions, examples):
        return [{"total": float("nan")} for _ in completions]

    cfg = config("-K", "4", "--max-new-tokens", "4", "--sample-ratio", "2", "--mu", "2")
    torch.manual_seed(0)
    result = run_step(
        policy, ref, tokenizer, optimizer, [make_record(0)], ["Hello"], cfg, reward_fn=nan_reward
    )
    assert result.skipped_updates == 4 and result.updates == 0  # 2 minibatches x mu 2
    assert all(torch.equal(before[k], v) for k, v in policy.state_dict().items())
    assert not optimizer.state  # AdamW's moments untouched too
    assert all(p.grad is None for p in policy.parameters())
    lines = sample_lines(1, result, 4)  # NaN rewards still make readable samples
    assert lines and all(line["total"] is None for line in lines)  # NaN is not JSON: null


# ---------------------------------------------------------------------------------------------
# Evaluation helper
# ---------------------------------------------------------------------------------------------
def test_evaluate_policy_with_the_real_reward(tiny):
    model, tokenizer = tiny
    records = [make_record(i) for i in range(3)]
    result = evaluate_policy(
        model, tokenizer, records, compute_rewards, max_new_tokens=4, batch_size=2, progress=False
    )
    assert result["n"] == 3 and result["skipped"] == 0
    for key in ("format", "recall", "answer", "total", "jaccard"):
        assert math.isfinite(result[key])
    assert result["total"] == pytest.approx(result["format"] + result["recall"] + result["answer"], abs=1e-5)
    assert -1.25 <= result["recall"] <= 1.25
    assert (
        evaluate_policy(
            model, tokenizer, records, compute_rewards, 4, 2, max_prompt_length=10, progress=False
        )["skipped"]
        == 3
    )


# ---------------------------------------------------------------------------------------------
# The command line: errors, resume, time budget, torchrun
# ---------------------------------------------------------------------------------------------
def test_cli_rejects_bad_data_with_one_line(tmp_path):
    bad = tmp_path / "bad.jsonl"
    record = make_record(0)
    del record["recall"]
    bad.write_text(json.dumps(record) + "\n")
    with pytest.raises(SystemExit) as e:
        g.main(["--model", "tiny-random", "--data", str(bad), "--out", str(tmp_path / "o")])
    assert "bad.jsonl:1" in str(e.value) and "recall" in str(e.value)


def test_presets_and_explicit_flags(tmp_path):
    train = str(tmp_path / "train.jsonl")
    assert g.parse_args(["--preset", "cpu-table2", "--data", train]).eval_data is None
    (tmp_path / "dev.jsonl").write_text("")
    assert g.parse_args(["--preset", "cpu-table2", "--data", train]).eval_data == str(tmp_path / "dev.jsonl")
    assert g.parse_args(["--data", train]).eval_data is None  # only the demo evaluates by default
    cfg = g.parse_args(["--preset", "paper"])
    assert (cfg.lr, cfg.num_generations, cfg.sample_ratio, cfg.clip_eps) == (3e-7, 8, 4, 0.2)
    cfg = g.parse_args(["--preset", "cpu-table2", "--lr", "1e-5", "--no-gradient-checkpointing"])
    assert (
        cfg.lr == 1e-5
        and cfg.gradient_checkpointing is False
        and cfg.max_new_tokens == 256
        and cfg.dynamic_sampling == "recall"
    )
    assert (
        warmup_lr(1, cfg.lr, cfg.warmup_steps) == pytest.approx(1e-5 / cfg.warmup_steps)
        and warmup_lr(50, cfg.lr, cfg.warmup_steps) == 1e-5
    )


def test_train_turns_dependent_trains_only_on_turns_that_need_recall(tmp_path):
    data = tmp_path / "train.jsonl"
    records = [make_record(i, recall=()) for i in range(4)] + [
        make_record(9)
    ]  # one turn of five needs recall
    write_jsonl(data, records)
    seen = {}

    def spy(completions, examples):
        seen.setdefault(mode, set()).update(tuple(e["recall"]) for e in examples)
        return length_reward(completions, examples)

    common = [
        "--model",
        "tiny-random",
        "--data",
        str(data),
        "--dtype",
        "float32",
        "-K",
        "2",
        "--max-new-tokens",
        "3",
        "--beta",
        "0",
        "--max-steps",
        "1",
        "--prompts-per-step",
        "3",
        "--save-every",
        "0",
    ]
    for mode in ("all", "dependent"):
        g.train(g.parse_args(common + ["--out", str(tmp_path / mode), "--train-turns", mode]), reward_fn=spy)
    assert () in seen["all"]  # three prompts of five: at least two need no recall
    assert seen["dependent"] == {("A1",)}
    assert json.loads((tmp_path / "dependent" / "config.json").read_text())["train_turns"] == "dependent"
    write_jsonl(data, records[:4])
    with pytest.raises(SystemExit, match=r"no records \(--train-turns dependent\)"):
        g.main(common + ["--out", str(tmp_path / "none"), "--train-turns", "dependent"])
    cfg = g.parse_args(["--preset", "cpu-long", "--data", str(data)])
    assert (cfg.train_turns, cfg.max_steps, cfg.num_generations, cfg.prompts_per_step, cfg.lr) == (
        "dependent",
        30,
        4,
        2,
        1e-5,
    )
    assert (cfg.answer_gate, cfg.answer_reward) == (
        "off",
        "cosine",
    )  # the paper's reward: the gate is an option


def test_answer_gate_reaches_the_reward_of_the_sampled_groups(tmp_path):
    """--answer-gate recall is the reward stage 2 trains on, not a flag it only writes down: the tiny
    model's completions recall nothing, so on turns that need recall every sample is gated under
    `recall` and none under `off`. It is one of the settings a resume must match."""
    data = tmp_path / "train.jsonl"
    write_jsonl(data, [make_record(i) for i in range(3)])
    common = [
        "--model",
        "tiny-random",
        "--data",
        str(data),
        "--dtype",
        "float32",
        "-K",
        "2",
        "--max-new-tokens",
        "3",
        "--beta",
        "0",
        "--max-steps",
        "1",
        "--save-every",
        "0",
        "--sample-every",
        "1",
        "--answer-reward",
        "keys",
    ]
    for gate in ("off", "recall"):
        g.train(g.parse_args(common + ["--out", str(tmp_path / gate), "--answer-gate", gate]))
        samples = read_jsonl(tmp_path / gate / "samples.jsonl", validate=False)
        assert samples and all(s["jaccard"] == 0.0 and s["answer"] == -1.0 for s in samples)
        assert {s["answer_gated"] for s in samples} == {gate == "recall"}
    assert "answer_gate" in g.RESUME_MUST_MATCH


@pytest.mark.parametrize(
    "device",
    [
        "cpu",
        pytest.param("cuda", marks=pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA GPU")),
    ],
)
def test_resume_equals_an_uninterrupted_run(tmp_path, monkeypatch, request, device):
    """A run stopped at step 2 and resumed reaches the weights of the straight run. On a CPU the two
    sum in the same order (weights loaded into aligned memory: load_model_and_tokenizer), so they
    agree to the last bits. On a GPU some backward kernels add with atomics (SDPA's
    memory-efficient attention, split-K matmuls) in an order that varies from run to run, and
    AdamW's first steps, lr * g / (|g| + eps), turn such rounding on near-zero gradients into
    lr-sized moves: there the runs use deterministic algorithms, and must agree as closely."""
    if device == "cpu":
        monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    else:
        monkeypatch.setenv("CUBLAS_WORKSPACE_CONFIG", ":4096:8")  # cuBLAS's condition for determinism
        before = (
            torch.are_deterministic_algorithms_enabled(),
            torch.is_deterministic_algorithms_warn_only_enabled(),
        )
        # warn_only: an op without a deterministic CUDA kernel warns instead of stopping the run; a
        # difference it makes shows in the comparisons below.
        torch.use_deterministic_algorithms(True, warn_only=True)
        request.addfinalizer(lambda: torch.use_deterministic_algorithms(before[0], warn_only=before[1]))
    data = tmp_path / "train.jsonl"
    write_jsonl(data, [make_record(i) for i in range(5)])
    common = [
        "--model",
        "tiny-random",
        "--data",
        str(data),
        "--dtype",
        "float32",
        "-K",
        "4",
        "--max-new-tokens",
        "5",
        "--lr",
        "1e-2",
        "--warmup-steps",
        "2",
        "--sample-ratio",
        "2",
        "--sample-every",
        "1",
        "--save-every",
        "0",
        "--seed",
        "7",
    ]
    straight, split = tmp_path / "straight", tmp_path / "split"
    g.train(g.parse_args(common + ["--out", str(straight), "--max-steps", "4"]), reward_fn=length_reward)
    g.train(g.parse_args(common + ["--out", str(split), "--max-steps", "2"]), reward_fn=length_reward)
    summary = g.train(
        g.parse_args(common + ["--out", str(split), "--max-steps", "4", "--resume"]), reward_fn=length_reward
    )
    assert summary["steps"] == 4
    a, b = (
        load_file(straight / "final" / "model.safetensors"),
        load_file(split / "final" / "model.safetensors"),
    )
    initial = load_model_and_tokenizer("tiny-random", dtype="float32")[0].state_dict()
    assert any(not torch.equal(a[k], initial[k]) for k in a)  # training moved the weights
    for k in a:
        assert torch.allclose(a[k], b[k], atol=1e-6), k
    ma, mb = (
        read_jsonl(straight / "metrics.jsonl", validate=False),
        read_jsonl(split / "metrics.jsonl", validate=False),
    )
    assert [m["step"] for m in mb] == [1, 2, 3, 4]
    assert [m["reward_total_mean"] for m in ma] == pytest.approx([m["reward_total_mean"] for m in mb])
    for key in (
        "reward_total_std",
        "kl",
        "clip_fraction",
        "entropy",
        "completion_length",
        "lr",
        "tokens_per_s",
        "generate_s",
        "score_s",
        "train_s",
    ):
        assert key in ma[-1]
    assert ma[1]["kl"] > 0  # after one step the policy has left the reference
    samples = read_jsonl(straight / "samples.jsonl", validate=False)
    assert {s["step"] for s in samples} == {1, 2, 3, 4} and all("completion" in s for s in samples)
    config_json = json.loads((straight / "config.json").read_text())
    assert config_json["num_generations"] == 4 and config_json["seed"] == 7


def test_probe_every_n_steps_draws_the_learning_curve(tmp_path):
    data, dev = tmp_path / "train.jsonl", tmp_path / "dev.jsonl"
    write_jsonl(data, [make_record(i) for i in range(3)])
    held_out = [
        dict(make_record(10 + i), meta={"bucket": bucket, "num_turns": 6, "scores": {}})
        for i, bucket in enumerate([8, 8, 8, 16, 24, 32])
    ]
    held_out[0]["recall"] = []  # a query that needs no recall: no part of the probe's Jaccard
    write_jsonl(dev, held_out)
    out = tmp_path / "run"
    g.train(
        g.parse_args(
            [
                "--model",
                "tiny-random",
                "--data",
                str(data),
                "--out",
                str(out),
                "--dtype",
                "float32",
                "--max-steps",
                "3",
                "-K",
                "2",
                "--max-new-tokens",
                "3",
                "--beta",
                "0",
                "--eval-data",
                str(dev),
                "--eval-limit",
                "4",
                "--probe-every",
                "2",
                "--eval-max-new-tokens",
                "3",
            ]
        ),
        reward_fn=length_reward,
    )
    probes = read_jsonl(out / "probe.jsonl", validate=False)
    assert [p["step"] for p in probes] == [0, 2, 3]  # before, every 2 steps, after
    assert all(p["n"] == 4 and {"f1", "jaccard_needed", "n_needed"} <= set(p) for p in probes)
    assert (out / "learning_curve.png").stat().st_size > 10_000
    assert json.loads((out / "eval_after.json").read_text())["n"] == 4
    # The probe set is stratified: 4 of 6 records, one from every length bucket.
    assert sorted(r["meta"]["bucket"] for r in pick_eval_records(held_out, 4)) == [8, 16, 24, 32]


def test_time_budget_stops_cleanly_then_resume_finishes_and_leaves_a_finished_run(tmp_path, capsys):
    data = tmp_path / "train.jsonl"
    write_jsonl(data, [make_record(0)])
    out = tmp_path / "run"
    args = [
        "--model",
        "tiny-random",
        "--data",
        str(data),
        "--out",
        str(out),
        "--dtype",
        "float32",
        "--max-steps",
        "2",
        "-K",
        "2",
        "--max-new-tokens",
        "3",
        "--beta",
        "0",
        "--resume",
    ]
    summary = g.train(g.parse_args(args + ["--time-budget-minutes", "0"]), reward_fn=length_reward)
    assert "starting from scratch" in capsys.readouterr().out  # --resume without a checkpoint
    assert summary["steps"] == 0 and summary["stop_reason"] == "time_budget"
    assert (out / "final" / "model.safetensors").exists() and (
        out / "checkpoint" / "trainer_state.pt"
    ).exists()
    assert g.train(g.parse_args(args), reward_fn=length_reward)["steps"] == 2
    assert len(read_jsonl(out / "metrics.jsonl", validate=False)) == 2
    assert g.train(g.parse_args(args), reward_fn=length_reward)["steps"] == 2  # finished: nothing redone
    assert "nothing to do" in capsys.readouterr().out
    with pytest.raises(SystemExit, match="seed"):  # a checkpoint is continued only with its data order
        g.train(g.parse_args(args + ["--max-steps", "3", "--seed", "1"]), reward_fn=length_reward)


DRIVER = """
import sys
sys.path.insert(0, {repo!r})
import stage2_grpo

def length_reward(completions, examples):
    return [{{"total": len(text) / 100.0}} for text in completions]

stage2_grpo.train(stage2_grpo.parse_args(sys.argv[1:]), reward_fn=length_reward)
from srt.distributed import teardown_distributed
teardown_distributed()
"""


def test_torchrun_two_ranks_stay_identical(tmp_path):
    data = tmp_path / "train.jsonl"
    write_jsonl(data, [make_record(i) for i in range(4)])
    driver = tmp_path / "driver.py"
    driver.write_text(DRIVER.format(repo=str(REPO)))
    out = tmp_path / "ddp"
    env = dict(os.environ, OMP_NUM_THREADS="1", CUDA_VISIBLE_DEVICES="")  # gloo on CPU, even on a GPU box
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "torch.distributed.run",
            "--standalone",
            "--nproc_per_node=2",
            str(driver),
            "--model",
            "tiny-random",
            "--data",
            str(data),
            "--out",
            str(out),
            "--dtype",
            "float32",
            "--max-steps",
            "1",
            "-K",
            "4",
            "--max-new-tokens",
            "6",
            "--lr",
            "1e-2",
            "--warmup-steps",
            "0",
            "--sample-ratio",
            "2",
            "--micro-batch-size",
            "1",
        ],  # 2 micro-batches per minibatch: DDP's no_sync on the first
        cwd=REPO,
        env=env,
        capture_output=True,
        text=True,
        timeout=240,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    summary = json.loads((out / "summary.json").read_text())
    assert summary["world_size"] == 2 and summary["steps"] == 1
    assert summary["ranks_in_sync"]
    trained = load_file(out / "final" / "model.safetensors")
    initial = load_model_and_tokenizer("tiny-random", dtype="float32")[0].state_dict()
    assert any(not torch.equal(trained[k], initial[k]) for k in trained)
    metrics = read_jsonl(out / "metrics.jsonl", validate=False)
    assert len(metrics) == 1 and metrics[0]["skipped_updates"] == 0


def varied_reward(completions, records):
    """A reward that differs between completions (a hash of the text), so Eq. (8) has a spread."""
    import hashlib

    scores = []
    for text in completions:
        h = int(hashlib.sha256(text.encode()).hexdigest()[:8], 16) / 2**32
        scores.append({"format": 0.0, "recall": 2.5 * h - 1.25, "answer": 1.0 - h, "total": 1.5 * h - 0.25})
    return scores


def test_explain_prints_advantages_that_follow_eq8_from_the_printed_rewards(tmp_path):
    """--explain's Eq. (8) table, recomputed by hand from its Eq. (4) table: mean, population std,
    (R - mean) / (std + 1e-8). Both are printed with 4 decimals, so each printed R is off by at most
    5e-5 and each printed A~ by 5e-5; an A~ recomputed from rounded R moves by about 5e-5 * 2 / std,
    under 2e-3 for the std >= 0.05 checked here. A wrong std (sample instead of population: a factor
    sqrt(K / (K - 1)) = 1.15 for K = 4) or a missing mean would be off by far more."""
    data = tmp_path / "train.jsonl"
    write_jsonl(data, [make_record(i) for i in range(4)])
    printed = []
    cfg = g.parse_args(["--model", "tiny-random", "--data", str(data), "-K", "4", "--max-new-tokens", "12",
                        "--sample-ratio", "2", "--lr", "1e-2", "--dtype", "float32",
                        "--explain-html", str(tmp_path / "step.html")])  # fmt: skip
    result = g.explain(cfg, reward_fn=varied_reward, print_fn=printed.append)
    text = "\n".join(printed)
    lines = text.splitlines()
    start = next(i for i, line in enumerate(lines) if line.startswith("Eqs. (4)-(7)")) + 2
    printed_rewards = [float(lines[start + k].split()[4]) for k in range(4)]
    start = next(i for i, line in enumerate(lines) if line.startswith("Eq. (8)")) + 2
    printed_advantages = [float(lines[start + k].split()[2]) for k in range(4)]
    mean = sum(printed_rewards) / 4
    std = (sum((r - mean) ** 2 for r in printed_rewards) / 4) ** 0.5
    assert std >= 0.05, text
    by_hand = [(r - mean) / (std + 1e-8) for r in printed_rewards]
    assert printed_advantages == pytest.approx(by_hand, abs=2e-3), text
    assert result["advantages"] == pytest.approx(printed_advantages, abs=1e-4)
    # After a real update (lr 1e-2) the policy moved: some ratio differs from 1, KL to pi_ref > 0.
    assert any(abs(row["ratio"] - 1) > 1e-6 for row in result["after"]) and any(
        r["kl"] > 0 for r in result["after"]
    )
    assert "Eq. (9) on this group now" in text


def test_every_numeric_flag_is_range_checked_with_one_line_naming_it(capsys):
    """--lr -1 used to end in a torch traceback; now argparse refuses it and names the flag. A
    preset's values pass the same check."""
    from srt.config import Bounded

    numeric = [a for a in g.build_parser()._actions if a.type in (int, float)]
    assert not numeric, [a.option_strings for a in numeric]
    bad_values = [("--lr", "-1"), ("--num-generations", "0"), ("--temperature", "0"), ("--top-p", "1.5"),
                  ("--clip-eps", "nan"), ("--sample-ratio", "0")]  # fmt: skip
    for flag, value in bad_values:
        with pytest.raises(SystemExit):
            g.parse_args([flag, value])
        assert f"argument {flag}" in capsys.readouterr().err.splitlines()[-1]
    assert isinstance(g.build_parser()._option_string_actions["--lr"].type, Bounded)
    g.PRESETS["broken"] = {"lr": -1.0}
    try:
        with pytest.raises(SystemExit):
            g.parse_args(["--preset", "broken"])
        assert "argument --lr: must be >= 0.0, got -1.0" in capsys.readouterr().err
    finally:
        del g.PRESETS["broken"]


def test_a_sample_ratio_above_the_rows_is_the_rows_in_the_config_and_said(capsys):
    """-K 2, one prompt: a sample batch of 2 rows makes at most 2 minibatches. The ratio the run
    uses is the one config.json records (it once said 8 and trained with 2), and an explicit
    --sample-ratio that changes says so in one line."""
    assert g.parse_args(["-K", "2", "--sample-ratio", "8"]).sample_ratio == 2
    assert "--sample-ratio 8 of 2 rows" in capsys.readouterr().err
    assert g.parse_args(["-K", "2", "--prompts-per-step", "3"]).sample_ratio == 4  # 6 rows: as asked
    assert g.parse_args(["-K", "2"]).sample_ratio == 2 and capsys.readouterr().err == ""  # the default
