"""The rollout record (srt/rollouts.py Rollout) and what the update reads from it: the sampler's own
log-probs, the policy mask, the truncated importance weight pi_old / pi_sampler, and one code path
for pi_old and pi_theta (the same suppressed tokens, no dropout, a sampling copy as fresh as the
weights). Everything runs on the tiny random Llama, fp32 unless a test says not."""

import copy
import math

import pytest
import torch
from grpo_records import hand_loss, run_step, sample, step_on
from records import hand_record

import stage2_grpo as g
from srt import decode, generation, loading
from srt.data_io import write_jsonl
from srt.loading import enable_activation_checkpointing, load_model_and_tokenizer
from srt.rollouts import Rollout, think_lengths
from srt.training import adamw

pytestmark = pytest.mark.usefixtures("one_thread")

PROMPTS = ["Hello", "Q1: What time is it?"]


def config(*extra):
    return g.parse_args(["--model", "tiny-random", "--dtype", "float32", *extra])


def varied_reward(completions, examples):
    """A toy verifiable reward with spread inside every group."""
    return [{"total": len(text) / 100.0, "format": 0.0, "recall": 0.0} for text in completions]


def sharp_tiny():
    """tiny-random with its head scaled 12x: its logits are nearly flat (std 0.17), which gives every
    completion the same log-prob and hides what a test looks for."""
    model, tokenizer = load_model_and_tokenizer("tiny-random", dtype="float32")
    with torch.no_grad():
        model.lm_head.weight.mul_(12)
    return model, tokenizer


def rollout_of(model, tokenizer, cfg):
    records = [hand_record(i, 3, ("A1",), pruned_extra=()) for i in range(len(PROMPTS))]
    torch.manual_seed(0)
    return sample(model, tokenizer, records, PROMPTS, cfg, varied_reward)


def forward_logprobs(model, rollout, temperature=1.0):
    input_ids, attention_mask = rollout.sequences("cpu")
    with torch.no_grad():
        return generation.completion_logprobs(
            model, input_ids, attention_mask, rollout.completion_ids.shape[1], temperature
        )[0]


# ---------------------------------------------------------------------------------------------
# The record
# ---------------------------------------------------------------------------------------------
def test_sample_batch_returns_the_record_with_the_samplers_own_logprobs():
    """The record holds what the update needs and nothing by string key. On an fp32 CPU the sampler
    is the model itself, so its log-probs equal a forward of the model: the decode loop (packed
    products, one token a step) and the Hugging Face forward sum in other orders, which moves fp32
    log-probs by ~1e-6 here; 1e-4 is far below the bf16 gap (~4e-2) the record exists to see.
    Temperature 0.7: the log-probs are those of softmax(logits / T), not of T = 1."""
    model, tokenizer = sharp_tiny()
    cfg = config("-K", "3", "--max-new-tokens", "8", "--temperature", "0.7")
    rollout = rollout_of(model, tokenizer, cfg)
    assert isinstance(rollout, Rollout) and rollout.num_generations == 3
    assert rollout.completion_ids.shape == rollout.policy_mask.shape == rollout.sampler_logprobs.shape
    assert torch.equal(rollout.policy_mask, rollout.completion_mask)  # every token sampled by the policy
    assert rollout.rewards("total").shape == (2, 3) and len(rollout.texts) == len(rollout.records) == 6
    expected = forward_logprobs(model, rollout, temperature=0.7) * rollout.completion_mask
    assert (rollout.sampler_logprobs[rollout.completion_mask.bool()] < 0).all()
    assert torch.allclose(rollout.sampler_logprobs, expected, atol=1e-4)
    assert not torch.allclose(
        rollout.sampler_logprobs, forward_logprobs(model, rollout) * rollout.completion_mask
    )


def test_a_bf16_sampler_reports_its_own_logprobs_not_the_trainers():
    """Where rollouts run on a bf16 copy of the policy (a GPU, an AMX CPU; forced here), the record's
    log-probs are the copy's, and they differ from the fp32 master weights' under autocast: the
    sampler/trainer gap the importance weight corrects. bf16 keeps 8 bits of mantissa, so a logit of
    ~10 moves by up to ~0.03; 0.05 bounds the copy against itself (the loop and a forward of the
    copy round the same way up to the order of sums)."""
    model, tokenizer = sharp_tiny()
    cfg = config("-K", "4", "--max-new-tokens", "8")
    records = [hand_record(i, 3, ("A1",), pruned_extra=()) for i in range(len(PROMPTS))]
    torch.manual_seed(0)
    rollout = sample(model, tokenizer, records, PROMPTS, cfg, varied_reward, torch.bfloat16)
    mask = rollout.completion_mask.bool()
    copy = decode.sampling_model(model, torch.bfloat16)
    assert copy is not model and next(copy.parameters()).dtype == torch.bfloat16
    of_copy = forward_logprobs(copy, rollout)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        of_trainer = forward_logprobs(model, rollout)
    sampler = rollout.sampler_logprobs
    gap_to_copy = (sampler - of_copy)[mask].abs().mean().item()
    gap_to_trainer = (sampler - of_trainer)[mask].abs().mean().item()
    assert gap_to_copy < 0.05 and gap_to_trainer > 0, (gap_to_copy, gap_to_trainer)


def test_join_pads_every_row_tensor_and_keeps_groups_whole():
    """Two sample batches of different widths joined by (draw, group): prompts padded on the left,
    completions, masks and sampler log-probs on the right with 0, rows in the picks' order."""
    model, tokenizer = load_model_and_tokenizer("tiny-random", dtype="float32")
    cfg = config("-K", "2", "--max-new-tokens", "4")
    first = rollout_of(model, tokenizer, cfg)
    second = rollout_of(model, tokenizer, config("-K", "2", "--max-new-tokens", "7"))
    joined = Rollout.join([first, second], [(1, 1), (0, 0)], tokenizer.pad_token_id)
    width = max(first.completion_ids.shape[1], second.completion_ids.shape[1])
    assert joined.completion_ids.shape == joined.sampler_logprobs.shape == (4, width)
    assert torch.equal(joined.completion_ids[:2, : second.completion_ids.shape[1]], second.completion_ids[2:])
    narrow = first.completion_ids.shape[1]
    assert torch.equal(joined.sampler_logprobs[2:, :narrow], first.sampler_logprobs[:2])
    assert (joined.policy_mask[2:, narrow:] == 0).all() and (joined.sampler_logprobs[2:, narrow:] == 0).all()
    assert joined.texts == second.texts[2:] + first.texts[:2]


# ---------------------------------------------------------------------------------------------
# The policy mask: tokens the policy did not write are attended to, never trained on
# ---------------------------------------------------------------------------------------------
def test_a_masked_token_changes_neither_the_loss_nor_its_gradient_but_later_tokens_attend_to_it():
    model, tokenizer = load_model_and_tokenizer("tiny-random", dtype="float32")
    cfg = config("-K", "2", "--max-new-tokens", "6")
    rollout = rollout_of(model, tokenizer, cfg)
    row, planted = 0, 2
    assert rollout.completion_mask[row, : planted + 2].all()
    rollout.policy_mask[row, planted] = 0  # as if the program, not the policy, wrote this token

    # Eq. (9) on leaf log-probs: the planted token gets no gradient, and the normalisation counts only
    # the policy's tokens (hand value for --loss-type dapo: minus the mean of A over them).
    logprobs = forward_logprobs(model, rollout).requires_grad_(True)
    advantages = torch.arange(4.0) - 1.5
    for loss_type in ("grpo", "dapo"):
        logprobs.grad = None
        weights = torch.ones_like(logprobs).index_put_(
            (torch.tensor(row), torch.tensor(planted)), torch.tensor(50.0)
        )
        loss, stats = hand_loss(
            logprobs, logprobs.detach(), logprobs.detach() - 3.0, advantages, rollout.policy_mask,
            beta=0.0, loss_type=loss_type, is_weights=weights,
        )  # fmt: skip
        loss.backward()
        assert logprobs.grad[row, planted] == 0 and (logprobs.grad[rollout.policy_mask.bool()] != 0).all()
        if loss_type == "dapo":
            mask = rollout.policy_mask.float()
            hand = -(advantages[:, None] * mask).sum() / mask.sum()
            assert loss.item() == pytest.approx(hand.item(), abs=1e-6)

    # The update: whatever the record says of the planted token (a wild sampler log-prob, so an
    # importance weight at its cap), the gradient is the one of the same batch without it in the loss.
    class Recording(torch.optim.SGD):  # lr 0: the gradient the update hands its optimizer
        def step(self, closure=None):
            self.gradients = [p.grad.clone() for p in self.param_groups[0]["params"]]
            return super().step(closure)

    def gradient(sampler_value, policy_mask):
        policy, _ = load_model_and_tokenizer("tiny-random", dtype="float32")
        record = Rollout(
            **{
                **rollout.__dict__,
                "policy_mask": policy_mask,
                "sampler_logprobs": rollout.sampler_logprobs.clone(),
            }
        )
        record.sampler_logprobs[row, planted] = sampler_value
        optimizer = Recording(policy.parameters(), lr=0.0)
        step_on(
            record, policy, tokenizer, optimizer, config("-K", "2", "--sample-ratio", "1", "--beta", "0.1")
        )
        return optimizer.gradients

    real = rollout.sampler_logprobs[row, planted].item()
    masked = gradient(real, rollout.policy_mask)
    assert all(torch.equal(a, b) for a, b in zip(masked, gradient(-80.0, rollout.policy_mask)))
    # ...and the test has teeth: the same token in the loss moves the gradient.
    assert not all(torch.equal(a, b) for a, b in zip(masked, gradient(real, rollout.completion_mask)))

    # Attended to: a later token's log-prob depends on the planted one.
    changed = rollout.completion_ids.clone()
    changed[row, planted] = (changed[row, planted] + 1) % len(tokenizer)
    other = Rollout(**{**rollout.__dict__, "completion_ids": changed})
    before, after = forward_logprobs(model, rollout), forward_logprobs(model, other)
    assert torch.equal(before[row, :planted], after[row, :planted])
    assert (before[row, planted + 1] - after[row, planted + 1]).abs() > 1e-4


# ---------------------------------------------------------------------------------------------
# The truncated importance weight: the sampler/trainer gap, corrected
# ---------------------------------------------------------------------------------------------
def test_is_weight_makes_the_gradient_the_on_policy_one_in_expectation_and_the_cap_truncates():
    """A planted gap on one categorical step: the policy p = softmax(theta), the sampler q a
    distorted copy (token 5 under-sampled 5x, so p/q = 5 there), a fixed advantage per token. With
    the ratio at 1 the surrogate's gradient is w A grad log p, so over N draws from q:
      uncorrected (w = 1):  E_q[A grad log p]                  (biased)
      w = p / q:            E_p[A grad log p]                  (the on-policy gradient)
      w = min(p / q, 2):    E_q[min(p / q, 2) A grad log p]    (truncated: biased on token 5 only)
    Each Monte Carlo mean must lie within 5 of its own standard errors of its exact value (a false
    alarm under 1e-6 a component), and the uncorrected and truncated ones far from on-policy."""
    theta = torch.tensor([1.0, 0.5, 0.0, -0.5, 0.2, 0.8], dtype=torch.float64)
    p = theta.softmax(0)
    q = p * torch.tensor([1.0, 1.0, 1.0, 1.0, 1.0, 0.2], dtype=torch.float64)
    q = q / q.sum()
    A = torch.tensor([0.5, -1.0, 0.3, -0.2, 1.0, 2.0], dtype=torch.float64)
    N = 200_000
    draws = torch.multinomial(q, N, replacement=True, generator=torch.Generator().manual_seed(0))
    grad_log_p = torch.eye(6, dtype=torch.float64) - p  # row x: e_x - p

    def exact(weight):  # -sum_x q(x) w(x) A(x) (e_x - p): the gradient of the loss, which is -objective
        return -(q[:, None] * weight[:, None] * A[:, None] * grad_log_p).sum(0)

    def monte_carlo(cap):
        logits = theta.clone().requires_grad_(True)
        logprobs = logits.log_softmax(0)[draws][:, None]
        sampler = q.log()[draws][:, None]
        weights = g.truncated_is_weights(logprobs, sampler, cap)
        loss, _ = hand_loss(logprobs, logprobs.detach(), None, A[draws], torch.ones(N, 1), beta=0.0,
                            loss_type="dapo", is_weights=weights)  # fmt: skip
        loss.backward()
        w = torch.ones(N, dtype=torch.float64) if weights is None else weights[:, 0].detach()
        per_draw = -(w * A[draws])[:, None] * grad_log_p[draws]
        return logits.grad, per_draw.std(0) / math.sqrt(N)

    on_policy = exact(p / q)
    assert torch.allclose(on_policy, -(p[:, None] * A[:, None] * grad_log_p).sum(0))
    for cap, target in (
        (0, exact(torch.ones(6, dtype=torch.float64))),
        (1e9, on_policy),
        (2.0, exact((p / q).clamp(max=2))),
    ):
        estimate, standard_error = monte_carlo(cap)
        assert ((estimate - target).abs() <= 5 * standard_error).all(), (cap, estimate, target)
        if cap != 1e9:  # the bias a missing or truncated correction leaves is many errors wide
            assert ((estimate - on_policy).abs() > 10 * standard_error).any(), cap


def test_mismatch_metrics_are_about_zero_on_an_fp32_cpu_and_reach_metrics_jsonl():
    """fp32: the sampler is the policy, its log-probs equal pi_old up to the order of sums (~1e-6), so
    the mean log-ratio and the k3 KL are ~0 and no weight reaches the cap; the weight multiplies the
    surrogate by 1 to within 1e-4."""
    policy, tokenizer = load_model_and_tokenizer("tiny-random", dtype="float32")
    cfg = config("-K", "4", "--max-new-tokens", "6", "--sample-ratio", "2")
    records = [hand_record(i, 3, ("A1",), pruned_extra=()) for i in range(2)]
    torch.manual_seed(0)
    result = run_step(policy, None, tokenizer, torch.optim.AdamW(policy.parameters(), lr=1e-3), records,
                         PROMPTS, cfg, reward_fn=varied_reward)  # fmt: skip
    assert abs(result.sampler_log_ratio) < 1e-4 and 0 <= result.sampler_kl < 1e-8
    assert result.is_capped_fraction == 0.0
    from srt.probe import step_metrics

    line = step_metrics(1, [result.without_samples()], 1.0)
    assert {"sampler_log_ratio", "sampler_kl", "is_capped_fraction"} <= set(line)


def test_sampler_mismatch_by_hand():
    old = torch.tensor([[-1.0, -2.0, -0.5], [-1.0, 0.0, 0.0]])
    sampler = torch.tensor([[-1.5, -1.0, -0.5], [-2.0, 0.0, 0.0]])
    mask = torch.tensor([[1, 1, 1], [1, 0, 0]])
    stats = g.sampler_mismatch(old, sampler, mask, cap=2.0)
    log_ratios = torch.tensor([0.5, -1.0, 0.0, 1.0])  # old - sampler on the 4 policy tokens
    assert stats["sampler_log_ratio"] == pytest.approx(0.125)
    assert stats["sampler_kl"] == pytest.approx((log_ratios.exp() - log_ratios - 1).mean().item())
    assert stats["is_capped_fraction"] == pytest.approx(0.25)  # only e^1 = 2.72 is above 2
    weights = g.truncated_is_weights(old, sampler, 2.0)
    assert torch.allclose(weights[0], torch.tensor([math.exp(0.5), math.exp(-1.0), 1.0]))
    assert weights[1, 0] == 2.0
    assert g.truncated_is_weights(old, sampler, 0) is None and g.truncated_is_weights(old, None, 2.0) is None


# ---------------------------------------------------------------------------------------------
# One code path for pi_old and pi_theta
# ---------------------------------------------------------------------------------------------
def test_pi_old_equals_pi_theta_before_any_update_under_checkpointing_and_autocast():
    """lr 0, two minibatches: the second is compared with the frozen pi_old pass, the first with its
    own log-probs. With gradient checkpointing on (the paper preset) and bf16 autocast, a pi_old pass
    that shared each prompt's KV cache while the loss's forward could not (checkpointing turns the
    cache off) differed by ~0.03 nats a token; one path gives a ratio of exactly 1."""
    policy, tokenizer = sharp_tiny()
    enable_activation_checkpointing(policy)
    cfg = config("-K", "4", "--max-new-tokens", "8", "--sample-ratio", "2", "--mu", "2", "--beta", "0",
                 "--gradient-checkpointing", "--share-prompts")  # fmt: skip
    records = [hand_record(i, 3, ("A1",), pruned_extra=()) for i in range(2)]
    torch.manual_seed(0)
    rollout = sample(policy, tokenizer, records, PROMPTS, cfg, varied_reward, torch.bfloat16)
    _, updates, stats = step_on(rollout, policy, tokenizer, torch.optim.SGD(policy.parameters(), lr=0.0), cfg,
                                autocast_dtype=torch.bfloat16)  # fmt: skip
    assert len(updates) == 4
    for update in updates:
        assert update.ratio == 1.0 and update.clip_fraction == 0.0, update
    # and the bf16 sampler's gap is there to be logged
    assert stats.sampler_kl > 0


def test_pi_old_leaves_the_suppressed_tokens_out_of_its_softmax_as_the_sampler_does():
    """The sampler never draws a suppressed token (generation_config.suppress_tokens, srt/decode.py),
    so its log-probs are those of softmax(logits / T) over the other tokens. pi_old must be over the
    same distribution: the ratio's pi_old is what the sampler's tokens were drawn from (Eq. (9)),
    and the IS weight is pi_old / pi_sampler. Half the vocabulary suppressed: a pi_old over the whole
    vocabulary sits well below the sampler (by the mass it gives the suppressed half), so on an fp32
    CPU, where the sampler is the policy, only a pi_old that leaves them out agrees to rounding.
    Both pi_old paths run: the first minibatch's own log-probs and the no-grad pass of the second."""
    model, tokenizer = sharp_tiny()
    stops = generation.stop_token_ids(model, tokenizer)
    suppressed = [t for t in range(1, len(tokenizer), 2) if t not in stops]
    model.generation_config.suppress_tokens = suppressed
    cfg = config("-K", "4", "--max-new-tokens", "8", "--sample-ratio", "2", "--beta", "0")
    rollout = rollout_of(model, tokenizer, cfg)
    mask = rollout.policy_mask.bool()
    assert not torch.isin(rollout.completion_ids[mask], torch.tensor(suppressed)).any()  # never drawn
    whole_vocabulary = forward_logprobs(model, rollout)[mask]
    assert (rollout.sampler_logprobs[mask] - whole_vocabulary).mean() > 0.3  # nats a token (measured 0.74)
    _, _, result = step_on(rollout, model, tokenizer, torch.optim.SGD(model.parameters(), lr=0.0), cfg)
    assert result.updates == 2
    assert abs(result.sampler_log_ratio) < 1e-4 and 0 <= result.sampler_kl < 1e-8, result


def test_the_bf16_sampling_copy_is_fresh_after_any_optimizers_step(monkeypatch):
    """The rollouts of a step must come from the weights the step before left. torch's fused AdamW
    (srt.training.adamw on a CPU, as stage 2 builds it) writes the weights in place without moving
    their version counters, so a copy refreshed only when a version moves, or on a hook only
    train() registers, would sample from the weights before the step. Here grpo_step runs twice
    with an optimizer nobody registered (no train()) and the bf16 sampler forced
    (autocast bf16, as on a GPU or an AMX CPU): each rollout's copy must be the master weights in
    bf16 at the moment it samples."""
    policy, tokenizer = sharp_tiny()
    optimizer = adamw(policy.parameters(), lr=1e-2, weight_decay=0.0)
    assert optimizer.defaults["fused"]
    cfg = config("-K", "4", "--max-new-tokens", "6", "--sample-ratio", "2", "--beta", "0")
    records = [hand_record(i, 3, ("A1",), pruned_extra=()) for i in range(2)]
    real, fresh = decode.sampling_model, []

    def checked(model, dtype):
        low = real(model, dtype)
        bf16 = [p.detach().to(torch.bfloat16) for p in model.parameters()]
        fresh.append(low is not model and all(torch.equal(q, p) for p, q in zip(bf16, low.parameters())))
        return low

    monkeypatch.setattr(decode, "sampling_model", checked)
    before = copy.deepcopy(policy.state_dict())
    torch.manual_seed(0)
    for _ in range(2):
        result = run_step(policy, None, tokenizer, optimizer, records, PROMPTS, cfg,
                             reward_fn=varied_reward, autocast_dtype=torch.bfloat16)  # fmt: skip
        assert result.updates == 2 and result.skipped_updates == 0
    after = policy.state_dict()
    assert any(not torch.equal(after[k], before[k]) for k in before)  # the steps moved the weights
    assert fresh == [True, True]


def test_dropout_of_a_checkpoint_is_zeroed_so_pi_old_is_pi_theta_before_an_update(tmp_path, capsys):
    """pi_old runs in train mode (one path with the loss's forward), so a checkpoint with dropout
    (attention_dropout 0.1 here) would make it a random draw, and Eq. (9)'s ratio no longer 1 before
    any update. Stage 2 loads its models with every dropout probability at 0 and says so in one
    line. With lr 0, two minibatches and mu = 2, every update's ratio must be exactly 1."""
    model, tokenizer = sharp_tiny()
    model.config.attention_dropout = 0.1
    model.save_pretrained(tmp_path / "dropout")
    tokenizer.save_pretrained(tmp_path / "dropout")
    reloaded, _ = load_model_and_tokenizer(str(tmp_path / "dropout"))
    assert reloaded.model.layers[0].self_attn.attention_dropout == 0.1  # as the checkpoint says
    data = tmp_path / "train.jsonl"
    write_jsonl(data, [hand_record(i, 3, ("A1",), pruned_extra=()) for i in range(2)])
    seen = {}

    def frozen_step(models, *args):
        policy = models.policy
        seen["rates"] = {m.attention_dropout for m in policy.modules() if hasattr(m, "attention_dropout")}
        seen["config"] = policy.config.attention_dropout
        models = g.Models(policy, models.tokenizer, torch.optim.SGD(policy.parameters(), lr=0.0))
        seen["result"] = g.grpo_step(models, *args)
        return seen["result"]

    flags = ["--model", str(tmp_path / "dropout"), "--data", str(data), "--out", str(tmp_path / "run"),
             "--dtype", "float32", "-K", "4", "--prompts-per-step", "2", "--max-new-tokens", "6",
             "--sample-ratio", "2", "--mu", "2", "--beta", "0", "--max-steps", "1", "--save-every", "0",
             "--eval-limit", "0", "--max-prompt-length", "0"]  # fmt: skip
    g.train(g.parse_args(flags), reward_fn=varied_reward, step_fn=frozen_step)
    assert "dropout set to 0 (config.attention_dropout=0.1" in capsys.readouterr().out
    assert seen["rates"] == {0.0} and seen["config"] == 0.0
    assert seen["result"].updates == 4 and seen["result"].ratio == 1.0, seen["result"]


def test_zero_dropout_finds_every_kind_of_dropout_setting():
    """GPT-2 keeps its rates as nn.Dropout modules (resid_pdrop, embd_pdrop, attn_pdrop), Llama as
    a float its attention took from the config: both, and the config itself, go to 0; a model with
    none is left as it is and nothing is reported."""
    from transformers import GPT2Config, GPT2LMHeadModel

    gpt2 = GPT2LMHeadModel(GPT2Config(n_layer=1, n_embd=8, n_head=2, vocab_size=16, n_positions=8))
    assert any(isinstance(m, torch.nn.Dropout) and m.p > 0 for m in gpt2.modules())
    zeroed = loading.zero_dropout(gpt2)
    rates = {"config.resid_pdrop=0.1", "config.embd_pdrop=0.1", "config.attn_pdrop=0.1", "Dropout.p=0.1"}
    assert rates <= set(zeroed)
    assert all(m.p == 0 for m in gpt2.modules() if isinstance(m, torch.nn.Dropout))
    assert (gpt2.config.resid_pdrop, gpt2.config.embd_pdrop, gpt2.config.attn_pdrop) == (0.0, 0.0, 0.0)
    tiny, _ = load_model_and_tokenizer("tiny-random", dtype="float32")
    assert loading.zero_dropout(tiny) == []


# ---------------------------------------------------------------------------------------------
# Flags, and </think> as a special token
# ---------------------------------------------------------------------------------------------
def test_stage2_refuses_top_p_below_one_and_a_cap_below_one(capsys):
    for flags, words in ((["--top-p", "0.9"], "--top-p 0.9"), (["--is-cap", "0.5"], "--is-cap 0.5")):
        with pytest.raises(SystemExit) as error:
            g.parse_args(flags)
        assert words in str(error.value)
    assert g.parse_args(["--is-cap", "0"]).is_cap == 0 and g.parse_args([]).is_cap == 2.0
    assert "is_cap" in g.RESUME_MUST_MATCH


def test_think_lengths_find_the_closing_tag_when_the_tokenizer_makes_it_special(tiny):
    tokenizer = copy.deepcopy(tiny[1])
    tokenizer.add_special_tokens({"additional_special_tokens": ["</think>"]})
    close = tokenizer.convert_tokens_to_ids("</think>")
    assert "</think>" not in tokenizer.decode([close], skip_special_tokens=True)  # special indeed
    text = tokenizer("<think>\nrecall\n", add_special_tokens=False).input_ids
    answer = tokenizer("\nFinal answer: at 9", add_special_tokens=False).input_ids
    ids = torch.tensor([text + [close] + answer, answer + [tokenizer.pad_token_id] * (len(text) + 1)])
    assert think_lengths(tokenizer, ids).tolist() == [len(text) + 1, ids.shape[1]]
