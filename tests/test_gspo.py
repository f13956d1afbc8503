"""The unit of Eq. (9)'s ratio and the clip around it, against hand-computed values:
--importance-sampling-level token | sequence (GSPO's s_i = exp(the mean log-ratio of a completion),
clipped with --gspo-clip-eps), --clip-higher (DAPO's upper epsilon), and --is-mode token |
sequence_mask (TRL's correction of the sampler to pi_old). Each test names the mistake it catches."""

import functools
import math
import os
import tempfile

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from grpo_records import hand_experience
from test_grpo_loss_family import (
    EXPECTED_WEIGHTS,
    LONG,
    MAX_LENGTH,
    SHORT,
    experience_and_updates,
    padded_logprobs,
    two_rank_worker,
    weights_of,
)
from test_stage2 import config

import stage2_grpo as g

pytestmark = pytest.mark.usefixtures("one_thread")

# Token ratios 2, 0.5 and 1.5 (pi_old = 1): their geometric mean, which GSPO's s_i is, their
# arithmetic mean and their product (the sum of the log-ratios, exponentiated).
GEOMETRIC, ARITHMETIC, PRODUCT = 1.1447142425533319, 4 / 3, 1.5
LOG_RATIOS = [math.log(2.0), math.log(0.5), math.log(1.5)]


def sequence_loss(logprobs, advantages, mask, **record):
    """hand_loss at the sequence level, GSPO's epsilons (3e-4 below, 4e-4 above), beta 0."""
    old = torch.zeros_like(logprobs.detach())
    experience = hand_experience(old, None, advantages, mask, **record)
    return g.grpo_loss(logprobs, experience, 0.2, 0.0, "sequence", gspo_clip_eps=3e-4, clip_eps_high=4e-4)


# ---------------------------------------------------------------------------------------------
# GSPO's sequence ratio
# ---------------------------------------------------------------------------------------------
def test_the_sequence_ratio_is_the_exp_of_the_mean_log_ratio_not_the_mean_of_the_ratios():
    """One completion whose tokens' ratios are 2, 0.5 and 1.5: s = 1.1447 on each token. Mutants:
    the mean of the ratios gives 1.333, a sum of the log-ratios for their mean gives 1.5."""
    logprobs = torch.tensor([LOG_RATIOS])
    _, terms = sequence_loss(logprobs, torch.tensor([1.0]), torch.ones(1, 3))
    assert terms.ratio[0].tolist() == pytest.approx([GEOMETRIC] * 3, rel=1e-6)
    assert terms.ratio[0, 0].item() != pytest.approx(ARITHMETIC, rel=1e-3)
    assert terms.ratio[0, 0].item() != pytest.approx(PRODUCT, rel=1e-3)
    # clipped with GSPO's 4e-4 above (A > 0): every token's term is 1.0004, and the clip took it
    assert terms.objective[0].tolist() == pytest.approx([1.0004] * 3, rel=1e-6)
    assert terms.clipped[0].tolist() == [True] * 3


def test_a_masked_padding_token_changes_nothing_at_the_sequence_level():
    """The completion above with a padding column whose log-prob is -inf: the same ratio, loss and
    gradient on the three tokens, 0 (no NaN) on the padding. Inside the clip (A < 0, s = 1.1447 is
    above the band, so min() keeps the unclipped s A), each token's gradient is -s / 3 times its
    weight 1/3. Mutant: a mean over the width (4 columns) gives s = 1.5^(1/4) = 1.107."""
    mask = torch.tensor([[1.0, 1.0, 1.0, 0.0]])
    padded = torch.tensor([[*LOG_RATIOS, -math.inf]], requires_grad=True)
    plain = torch.tensor([LOG_RATIOS], requires_grad=True)
    loss_padded, terms_padded = sequence_loss(padded, torch.tensor([-1.0]), mask)
    loss_plain, terms_plain = sequence_loss(plain, torch.tensor([-1.0]), torch.ones(1, 3))
    (loss_padded + loss_plain).backward()
    assert loss_padded.item() == pytest.approx(GEOMETRIC, rel=1e-6) == loss_plain.item()
    assert terms_padded.ratio[0, :3].tolist() == pytest.approx(terms_plain.ratio[0].tolist(), rel=1e-7)
    assert torch.isfinite(padded.grad).all() and padded.grad[0, 3].item() == 0.0
    assert padded.grad[0, :3].tolist() == pytest.approx([GEOMETRIC / 3] * 3, rel=1e-6)
    assert padded.grad[0, :3].tolist() == pytest.approx(plain.grad[0].tolist(), rel=1e-7)


def test_the_sequence_level_takes_gspos_epsilon_from_the_flags():
    """--importance-sampling-level sequence with the defaults: s = 1.1447 (A = 1) is clipped at
    1 + 3e-4 (--gspo-clip-eps; symmetric, no --clip-higher). Mutant: the token epsilon 0.2 at the
    sequence level leaves s = 1.1447 unclipped; --clip-higher 4e-4 moves the bound to 1.0004."""
    experience = hand_experience(torch.zeros(1, 3), None, torch.tensor([1.0]), torch.ones(1, 3))
    for flags, want in (((), 1.0003), (("--clip-higher", "4e-4"), 1.0004)):
        settings = g.StepSettings.of(config("--importance-sampling-level", "sequence", *flags))
        loss, terms = g.settings_loss(torch.tensor([LOG_RATIOS]), experience, settings)
        assert terms.objective[0].tolist() == pytest.approx([want] * 3, rel=1e-6), flags
        assert loss.item() == pytest.approx(-want, rel=1e-6)


def test_gspo_on_policy_is_grpo():
    """At ratio 1 (the first pass over a sample batch) the sequence level's loss and gradient are the
    token level's, to rounding, under every loss type: GSPO shows only off-policy."""
    torch.manual_seed(0)
    mask = torch.tensor([[1, 1, 1, 1, 1], [1, 1, 0, 0, 0], [1, 1, 1, 0, 0]])
    for loss_type in g.LOSS_TYPES:
        grads, losses = [], []
        for level in g.IMPORTANCE_SAMPLING_LEVELS:
            logprobs = (-torch.rand(3, 5, generator=torch.Generator().manual_seed(1)) * 2).requires_grad_()
            record = hand_experience(logprobs.detach(), None, torch.tensor([1.0, -0.5, 2.0]), mask, loss_type)
            loss, _ = g.grpo_loss(logprobs, record, 0.2, 0.0, level)
            loss.backward()
            grads.append(logprobs.grad)
            losses.append(loss.item())
        assert losses[0] == pytest.approx(losses[1], rel=1e-6), loss_type
        assert torch.allclose(grads[0], grads[1], atol=1e-7), loss_type


def test_an_unknown_level_is_refused():
    with pytest.raises(ValueError, match="unknown level"):
        g.importance_ratio(torch.zeros(1, 2), torch.zeros(1, 2), torch.ones(1, 2), "sentence")


# ---------------------------------------------------------------------------------------------
# DAPO's clip-higher
# ---------------------------------------------------------------------------------------------
def test_clip_higher_moves_the_upper_bound_for_a_positive_advantage_and_not_the_lower():
    """--clip-eps 0.2 --clip-higher 0.28, one token each: A = +1 at r = 1.25 is inside the raised band
    (term 1.25, gradient kept; a symmetric clip would cut it to 1.2), A = +1 at r = 1.5 is clipped to
    1.28; A = -1 at r = 0.75 is clipped at the unchanged lower bound 0.8 (term -0.8, no gradient).
    Mutant: clip-higher applied to the lower side clips at 0.72, so r = 0.75 keeps its gradient."""
    ratios = torch.tensor([[1.25], [1.5], [0.75]])
    logprobs = ratios.log().requires_grad_()
    record = hand_experience(torch.zeros(3, 1), None, torch.tensor([1.0, 1.0, -1.0]), torch.ones(3, 1))
    loss, terms = g.grpo_loss(logprobs, record, 0.2, 0.0, clip_eps_high=0.28)
    loss.backward()
    assert terms.objective.view(-1).tolist() == pytest.approx([1.25, 1.28, -0.8], rel=1e-6)
    assert terms.clipped.view(-1).tolist() == [False, True, True]
    # grpo weights 1/3 a row: -A r / 3 where the gradient is kept
    assert logprobs.grad.view(-1).tolist() == pytest.approx([-1.25 / 3, 0.0, 0.0], rel=1e-6)
    symmetric, _ = g.grpo_loss(ratios.log(), record, 0.2, 0.0)
    assert symmetric.item() == pytest.approx(-(1.2 + 1.2 - 0.8) / 3, rel=1e-6)


# ---------------------------------------------------------------------------------------------
# The token level with the new flags unset is the loss as it was
# ---------------------------------------------------------------------------------------------
def reference_loss(logprobs, experience, clip_eps, beta):
    """grpo_loss as written before the ratio had a level: Eq. (9) with r_{i,t} and a symmetric clip."""
    sampled = experience.policy_mask > 0
    logprobs = torch.where(sampled, logprobs, 0.0)
    ratio = torch.exp(logprobs - experience.old_logprobs)
    A = experience.advantages
    clipped_ratio = torch.clamp(ratio, 1 - clip_eps, 1 + clip_eps)
    surrogate = torch.min(ratio * A, clipped_ratio * A) * experience.is_weights
    kl = g.k3_kl(logprobs, experience.ref_logprobs)
    objective = torch.where(sampled, surrogate - beta * kl, 0.0)
    clipped = ((ratio > 1 + clip_eps) & (A > 0)) | ((ratio < 1 - clip_eps) & (A < 0))
    return -(experience.loss_weights * objective).sum(), ratio, clipped, objective


@pytest.mark.parametrize("loss_type", g.LOSS_TYPES)
def test_the_token_level_with_the_defaults_is_the_earlier_loss_bit_for_bit(loss_type):
    """Random off-policy log-probs (ratios up to e^1.5, many clipped), importance weights, a KL, and
    completions of 5, 2 and 0 tokens with -inf on their padding: the defaults' loss, terms and
    gradient equal the earlier code's exactly (torch.equal, not approx)."""
    generator = torch.Generator().manual_seed(3)
    mask = torch.tensor([[1, 1, 1, 1, 1], [1, 1, 0, 0, 0], [0, 0, 0, 0, 0]])
    old, ref = -torch.rand(3, 5, generator=generator) * 2, -torch.rand(3, 5, generator=generator) * 2
    new = (old + (torch.rand(3, 5, generator=generator) - 0.5) * 3).masked_fill(mask == 0, -math.inf)
    record = hand_experience(old, ref, torch.tensor([1.0, -0.5, 2.0]), mask, loss_type, max_new_tokens=8,
                             is_weights=torch.rand(3, 5, generator=generator) + 0.5)  # fmt: skip
    settings = g.StepSettings.of(config("--loss-type", loss_type, "--beta", "0.1"))
    results = []
    for compute in (
        lambda x: g.settings_loss(x, record, settings),
        lambda x: reference_loss(x, record, 0.2, 0.1),
    ):
        logprobs = new.clone().requires_grad_()
        loss, *terms = compute(logprobs)
        loss.backward()
        terms = terms if len(terms) == 3 else [terms[0].ratio, terms[0].clipped, terms[0].objective]
        results.append((loss.detach(), *terms, logprobs.grad))
    mine, earlier = results
    assert 0 < earlier[2].sum() < mask.sum()  # some tokens clipped, not all
    for a, b in zip(mine, earlier):
        assert torch.equal(a, b)


# ---------------------------------------------------------------------------------------------
# --is-mode sequence_mask: TRL's correction of the sampler
# ---------------------------------------------------------------------------------------------
def test_sequence_mask_masks_the_completion_over_the_cap_and_keeps_the_others():
    """Three completions, log pi_old - log pi_sampler per token: [log 2, log 2] sums to log 4, over the
    cap 3: weight 0 on both tokens (a per-token mean, log 2, would keep it at 2); [log 2, log 0.75]
    gives 1.5, kept as the weight of both; [log 1.1] and a padding token whose gap is 50 gives 1.1
    (the padding counts in no sum). The share of policy tokens masked out is 2 / 5."""
    mask = torch.tensor([[1.0, 1.0], [1.0, 1.0], [1.0, 0.0]])
    old = torch.zeros(3, 2)
    sampler = -torch.tensor(
        [[math.log(2), math.log(2)], [math.log(2), math.log(0.75)], [math.log(1.1), 50.0]]
    )
    weights = g.sequence_mask_is_weights(old, sampler, mask, 3.0)
    assert weights.tolist() == [[0.0, 0.0], pytest.approx([1.5, 1.5]), pytest.approx([1.1, 1.1])]
    stats = g.sampler_mismatch(old, sampler, mask, 3.0, "sequence_mask")
    assert stats["is_capped_fraction"] == pytest.approx(2 / 5)
    assert g.sequence_mask_is_weights(old, None, mask, 3.0) is None
    assert g.sequence_mask_is_weights(old, sampler, mask, 0) is None
    # in the loss: the masked completion's surrogate is gone, the others are weighted
    logprobs = torch.zeros(3, 2, requires_grad=True)
    record = hand_experience(old, None, torch.ones(3), mask, is_weights=weights)
    loss, _ = g.grpo_loss(logprobs, record, 0.2, 0.0)
    loss.backward()
    assert loss.item() == pytest.approx(-(0.0 + 1.5 + 1.1) / 3, rel=1e-6)
    assert logprobs.grad[0].tolist() == [0.0, 0.0]


def test_the_is_mode_flags():
    """--is-cap unset is 2 under --is-mode token (as before) and 3 under sequence_mask (TRL's); the new
    flags are the run's identity, and --explain refuses them."""
    cfg = config()
    assert (cfg.importance_sampling_level, cfg.gspo_clip_eps, cfg.clip_higher) == ("token", 3e-4, None)
    assert (cfg.is_mode, cfg.is_cap) == ("token", 2.0)
    assert config("--is-mode", "sequence_mask").is_cap == 3.0
    assert config("--is-mode", "sequence_mask", "--is-cap", "5").is_cap == 5.0
    keys = {"importance_sampling_level", "gspo_clip_eps", "clip_higher", "is_mode", "is_cap"}
    assert keys <= set(g.RESUME_MUST_MATCH)
    with pytest.raises(SystemExit):  # an upper epsilon below the lower one
        config("--importance-sampling-level", "token", "--clip-higher", "4e-4")
    with pytest.raises(SystemExit):
        config("--explain", "--importance-sampling-level", "sequence")
    beyond = next(group for group in g.build_parser()._action_groups if group.title == "beyond the paper")
    flags = {option for action in beyond._group_actions for option in action.option_strings}
    assert {"--importance-sampling-level", "--gspo-clip-eps", "--clip-higher", "--is-mode"} <= flags


def test_a_sequence_level_step_off_policy(monkeypatch):
    """--mu 2 at the sequence level, --is-mode sequence_mask, on fixed rollouts: the first pass is on
    policy (ratio exactly 1, no spread, nothing clipped), the second pass's s_i moved by the first
    step, apart from one completion to the next and past GSPO's narrow band for some."""
    _, updates, _ = experience_and_updates(
        monkeypatch, "--sample-ratio", "1", "--mu", "2", "--importance-sampling-level", "sequence",
        "--is-mode", "sequence_mask", lr=0.5,
    )  # fmt: skip
    assert updates[0].ratio == 1.0 and updates[0].ratio_std == 0.0 and updates[0].clip_fraction == 0.0
    assert abs(updates[1].ratio - 1.0) > 1e-4 and updates[1].clip_fraction > 0.0
    assert updates[1].ratio_std > 1e-5


# ---------------------------------------------------------------------------------------------
# The length bias at the sequence level, one rank and two under gloo (the loss family's check)
# ---------------------------------------------------------------------------------------------
def token_weights(lengths, loss_type, level, offset=0):
    """test_grpo_loss_family.token_gradients at `level`, with --clip-higher 0.28: each token's weight
    in the step's objective (A = 1, on policy), DDP's mean over ranks taken."""
    theta = torch.zeros(SHORT + LONG, requires_grad=True)
    logprobs, mask = padded_logprobs(theta, lengths, offset)
    tokens = g.all_ranks_tokens(mask) if loss_type == "dapo" else None
    record = hand_experience(
        logprobs.detach(),
        None,
        torch.ones(len(lengths)),
        mask,
        loss_type,
        max_new_tokens=MAX_LENGTH,
        all_rank_tokens=tokens,
        world_size=g.world_size(),
    )
    loss, _ = g.grpo_loss(logprobs, record, 0.2, 0.0, level, clip_eps_high=0.28)
    loss.backward()
    grad = theta.grad
    if dist.is_initialized():
        dist.all_reduce(grad)
        grad /= dist.get_world_size()
    return -grad


@pytest.mark.parametrize("loss_type", g.LOSS_TYPES)
def test_the_sequence_level_keeps_each_loss_types_token_weights_on_one_rank(loss_type):
    short, long = weights_of(token_weights([SHORT, LONG], loss_type, "sequence"))
    want_short, want_long = EXPECTED_WEIGHTS[loss_type]
    assert short.tolist() == pytest.approx([want_short] * SHORT, rel=1e-6)
    assert long.tolist() == pytest.approx([want_long] * LONG, rel=1e-6)


def test_the_sequence_level_keeps_each_loss_types_token_weights_on_two_ranks_under_gloo():
    """The short completion on rank 0, the long one on rank 1, at the sequence level: the weights of
    one rank holding both (dapo's 1/24 on every token, grpo's ratio of 5, dr_grpo's 1)."""
    with tempfile.TemporaryDirectory() as folder:
        results = mp.Manager().dict()
        sequence = functools.partial(token_weights, level="sequence")
        mp.spawn(two_rank_worker, args=(os.path.join(folder, "init"), results, sequence), nprocs=2, join=True)
        for loss_type, (want_short, want_long) in EXPECTED_WEIGHTS.items():
            for rank in (0, 1):
                short, long = weights_of(torch.tensor(results[f"{rank}:{loss_type}"]))
                assert short.tolist() == pytest.approx([want_short] * SHORT, rel=1e-6), loss_type
                assert long.tolist() == pytest.approx([want_long] * LONG, rel=1e-6), loss_type
