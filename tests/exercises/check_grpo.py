"""Checks of the GRPO exercises (stage2_grpo.py): Eq. (8), the k3 KL, Eq. (9) and its normalisation,
on hand-computed values, invariants and one step on a tiny random model. The checks of Eq. (9) build
their Experience and loss weights by hand, so that they grade grpo_loss alone."""

import math

import torch
from tiny import VOCAB, completion_logprobs, tiny_model

import stage2_grpo as g


def close(got, expected, atol=1e-5) -> bool:
    return torch.allclose(torch.as_tensor(got).double(), torch.as_tensor(expected).double(), atol=atol)


# ==== Eq. (8) ====
def advantages_by_hand():
    """Eq. (8) by hand with the population std (divide by K): [1, 2, 3, 4] and [0, 0, 1, 0], returned in
    float32."""
    got = g.group_advantages(torch.tensor([[1.0, 2.0, 3.0, 4.0], [0.0, 0.0, 1.0, 0.0]]))
    assert tuple(got.shape) == (2, 4) and got.dtype == torch.float32
    std = math.sqrt(1.25)  # of 1, 2, 3, 4 around 2.5
    assert close(got[0], [-1.5 / std, -0.5 / std, 0.5 / std, 1.5 / std])
    # mean 0.25, std sqrt(0.1875): 1 becomes 0.75 / sqrt(0.1875) = sqrt(3), 0 becomes -1 / sqrt(3)
    assert close(got[1], [-1 / math.sqrt(3), -1 / math.sqrt(3), math.sqrt(3), -1 / math.sqrt(3)])


def advantages_of_a_group_sum_to_zero():
    """Eq. (8): the advantages of each group sum to zero, with unit (population) spread."""
    rewards = torch.randn(5, 8, generator=torch.Generator().manual_seed(0)) * 2 + 1
    got = g.group_advantages(rewards).double()
    assert close(got.sum(dim=1), torch.zeros(5))
    assert close(got.std(dim=1, unbiased=False), torch.ones(5), atol=1e-4)


def an_all_equal_group_gets_exactly_zero():
    """Eq. (8) gives a group whose rewards are all equal exactly 0 (not rounding noise blown up by a tiny
    std), and a group of one 0, under every scale."""
    rewards = torch.tensor([[0.1] * 8, [0.7] * 8, [-1.25] * 8, [0.0, 1.0] * 4])
    for scale in ("group", "batch", "none"):
        got = g.group_advantages(rewards, scale=scale)
        assert bool((got[:3] == 0).all()) and bool(got[3].abs().min() > 0.4), scale
        single = g.group_advantages(torch.tensor([[2.0], [3.5]]), scale=scale)
        assert bool((single == 0).all()), scale
    thirds = g.group_advantages(torch.tensor([[0.1] * 3, [0.7] * 3]), scale="none")
    assert bool((thirds == 0).all())


def a_nan_reward_leaves_its_group_nan():
    """Eq. (8) keeps a NaN reward NaN across its group (so the step is skipped), and leaves the other
    groups alone: no NaN is turned into a number."""
    rewards = torch.tensor([[1.0, float("nan"), 0.0, 2.0], [1.0, 2.0, 3.0, 4.0]])
    got = g.group_advantages(rewards)
    assert bool(torch.isnan(got[0]).all()) and bool(torch.isfinite(got[1]).all())


def advantages_under_every_scale():
    """Eq. (8)'s denominator by scale: 'group' the group's std, 'batch' the std of all rewards, 'none' no
    division; others raise ValueError."""
    rewards = torch.tensor([[1.0, 3.0], [0.0, 10.0]])
    centred = torch.tensor([[-1.0, 1.0], [-5.0, 5.0]])
    assert close(g.group_advantages(rewards, scale="none"), centred)
    everything = rewards.double().std(unbiased=False)
    assert close(g.group_advantages(rewards, scale="batch"), centred / everything)
    wider = torch.tensor([0.0, 20.0])
    assert close(g.group_advantages(rewards, scale="batch", batch_rewards=wider), centred / 10.0)
    try:
        g.group_advantages(rewards, scale="sometimes")
    except ValueError:
        return
    raise AssertionError("no ValueError")


# ==== The k3 estimator of KL(pi_theta || pi_ref) ====
def k3_is_zero_when_the_policies_agree():
    """k3 is exactly 0 where pi_theta = pi_ref and >= 0 everywhere."""
    generator = torch.Generator().manual_seed(1)
    logprobs = -torch.rand(4, 6, generator=generator) * 5
    assert bool((g.k3_kl(logprobs, logprobs.clone()) == 0).all())
    ref = -torch.rand(4, 6, generator=generator) * 5
    assert bool((g.k3_kl(logprobs, ref) >= 0).all()) and bool((g.k3_kl(ref, logprobs) >= 0).all())


def k3_by_hand():
    """k3 on hand-computed values: log pi = -1, log pi_ref = -2 gives e^-1 + 1 - 1; the reverse, e - 2."""
    got = g.k3_kl(torch.tensor([-1.0, -2.0]), torch.tensor([-2.0, -1.0]))
    assert close(got, [math.exp(-1), math.e - 2])


# ==== The unit of Eq. (9)'s ratio: the token's r_{i,t}, or GSPO's s_i of the whole completion ====
# Two completions of three columns: token ratios 2, 0.5 and 1.5; then 1.2, 1.2 and a padding token
# whose log-prob is -inf. pi_old is 1 on every token (log 0), so each log-prob is its log-ratio.
RATIO_MASK = torch.tensor([[1.0, 1.0, 1.0], [1.0, 1.0, 0.0]])


def ratio_logprobs():
    return torch.tensor(
        [[math.log(2.0), math.log(0.5), math.log(1.5)], [math.log(1.2), math.log(1.2), -math.inf]]
    )


def token_ratio_and_its_clip():
    """The token level is Eq. (9)'s r_{i,t} = pi_theta / pi_old, one per token, clipped to [1 - eps,
    1 + eps]: ratios 2, 0.5, 1.5 and 1.2 give 1.2, 0.8, 1.2 and 1.2 at eps = 0.2; a padding token has
    ratio 1; an unknown level raises ValueError."""
    ratio, clipped = g.importance_ratio(ratio_logprobs(), torch.zeros(2, 3), RATIO_MASK, "token", 0.2)
    assert tuple(ratio.shape) == (2, 3) and bool(torch.isfinite(ratio).all())
    assert close(ratio, [[2.0, 0.5, 1.5], [1.2, 1.2, 1.0]])
    assert close(clipped, [[1.2, 0.8, 1.2], [1.2, 1.2, 1.0]])
    try:
        g.importance_ratio(ratio_logprobs(), torch.zeros(2, 3), RATIO_MASK, "tokens")
    except ValueError:
        return
    raise AssertionError("no ValueError")


def sequence_ratio_by_hand():
    """GSPO's s_i is one ratio per completion, on each of its tokens: token ratios 2, 0.5 and 1.5 give
    1.1447142 (neither their mean 1.3333 nor their product 1.5); 1.2, 1.2 and a padding token give 1.2
    (the padding counts in no mean)."""
    ratio, _ = g.importance_ratio(ratio_logprobs(), torch.zeros(2, 3), RATIO_MASK, "sequence")
    assert tuple(ratio.shape) == (2, 3) and bool(torch.isfinite(ratio).all())
    assert close(ratio[0], [1.1447142425533319] * 3, atol=1e-6)
    assert close(ratio[1, :2], [1.2, 1.2], atol=1e-6)


def sequence_ratio_clips_with_its_own_epsilon():
    """At the sequence level the clip takes GSPO's epsilon, not the token's: with gspo_clip_eps 3e-4,
    s = 1.1447142 is clipped to 1.0003 and s = 0.8735805 to 0.9997 (the token epsilon 0.2 leaves
    both as they are)."""
    logprobs = ratio_logprobs()[:1]
    both = torch.cat([logprobs, -logprobs])
    ratio, clipped = g.importance_ratio(both, torch.zeros(2, 3), torch.ones(2, 3), "sequence", 0.2, 3e-4)
    assert close(ratio[:, 0], [1.1447142425533319, 0.8735804647362989], atol=1e-6)
    assert close(clipped, [[1.0003] * 3, [0.9997] * 3], atol=1e-6)


def clip_higher_moves_the_upper_bound_alone():
    """DAPO's clip-higher (clip_eps_high) raises the clip's upper bound and leaves the lower: token ratios
    1.5 and 0.5 are clipped to 1.28 and 0.8 with eps 0.2 and eps_high 0.28; GSPO's s = 1.1447142 and
    0.8735805 to 1.0004 and 0.9997 with 3e-4 and 4e-4."""
    tokens = torch.tensor([[math.log(1.5), math.log(0.5)]])
    _, clipped = g.importance_ratio(tokens, torch.zeros(1, 2), torch.ones(1, 2), "token", 0.2, 3e-4, 0.28)
    assert close(clipped, [[1.28, 0.8]], atol=1e-6)
    logprobs = ratio_logprobs()[:1]
    both = torch.cat([logprobs, -logprobs])
    _, clipped = g.importance_ratio(both, torch.zeros(2, 3), torch.ones(2, 3), "sequence", 0.2, 3e-4, 4e-4)
    assert close(clipped, [[1.0004] * 3, [0.9997] * 3], atol=1e-6)


def sequence_ratio_has_every_tokens_gradient():
    """GSPO's s_i carries the gradient of each sampled token of its completion, s_i / |o_i| =
    0.3815714 each for s = 1.1447142 over 3 tokens, and none to a padding token (no NaN)."""
    logprobs = ratio_logprobs().requires_grad_()
    ratio, _ = g.importance_ratio(logprobs, torch.zeros(2, 3), RATIO_MASK, "sequence")
    ratio[:, 0].sum().backward()
    assert logprobs.grad is not None and bool(torch.isfinite(logprobs.grad).all())
    assert close(logprobs.grad, [[0.38157141418444396] * 3, [0.6, 0.6, 0.0]], atol=1e-6)


# ==== Eq. (9), on Experience records built by hand ====
def experience(old, advantages, mask=None, ref=None, is_weights=None, weights=None) -> g.Experience:
    """One minibatch: advantages one per row; loss weights as given, else 1 / (|o_i| G) on every token
    of an unmasked minibatch of equal lengths."""
    mask = torch.ones_like(old) if mask is None else mask
    weights = torch.full_like(old, 1 / old.numel()) if weights is None else weights
    return g.Experience(
        input_ids=None,
        attention_mask=None,
        policy_mask=mask,
        advantages=advantages.view(-1, 1).expand_as(mask).clone(),
        old_logprobs=torch.where(mask > 0, old, 0.0),
        ref_logprobs=ref,
        is_weights=torch.ones_like(mask) if is_weights is None else is_weights,
        loss_weights=weights,
        minibatches=(torch.arange(len(mask)),),
    )


def loss_by_hand():
    """Eq. (9) on hand-computed values: ratios 1.1 and 1 (inside the clip), advantages 1 and -0.5, beta 0."""
    old = torch.tensor([[-1.0, -2.0], [-0.5, -1.5]])
    logprobs = old + torch.tensor([[math.log(1.1)] * 2, [0.0] * 2])
    loss, terms = g.grpo_loss(logprobs, experience(old, torch.tensor([1.0, -0.5])), clip_eps=0.2, beta=0.0)
    assert math.isclose(loss.item(), -(0.25 * 2 * 1.1 + 0.25 * 2 * -0.5), abs_tol=1e-5)
    assert close(terms.ratio, [[1.1, 1.1], [1.0, 1.0]])


def the_clip_acts_for_both_signs():
    """Eq. (9)'s clip for both signs of A~: r = 1.5 with A~ > 0 and r = 0.5 with A~ < 0 get no gradient; the
    other two do."""
    old = torch.full((4, 1), -1.0)
    ratios = torch.tensor([[1.5], [0.5], [0.5], [1.5]])
    logprobs = (old + ratios.log()).requires_grad_()
    advantages = torch.tensor([1.0, -1.0, 1.0, -1.0])
    loss, terms = g.grpo_loss(logprobs, experience(old, advantages), clip_eps=0.2, beta=0.0)
    loss.backward()
    assert math.isclose(loss.item(), -0.25 * (1.2 - 0.8 + 0.5 - 1.5), abs_tol=1e-5)
    gradient = logprobs.grad.view(-1)
    assert float(gradient[0]) == 0.0 and float(gradient[1]) == 0.0
    assert float(gradient[2]) != 0.0 and float(gradient[3]) != 0.0
    assert terms.clipped.view(-1).tolist() == [True, True, False, False]


def a_masked_token_gets_no_gradient():
    """Eq. (9): a masked token gets no gradient and no NaN, even when its log-prob is -inf and k3 would
    overflow there."""
    mask = torch.tensor([[1.0, 1.0, 0.0]])
    old = torch.tensor([[-1.0, -2.0, 0.0]])
    logprobs = torch.tensor([[-1.0, -2.0, -math.inf]], requires_grad=True)
    ref = torch.tensor([[-1.0, -2.0, 0.0]])
    record = experience(old, torch.tensor([1.0]), mask, ref, weights=torch.tensor([[0.5, 0.5, 0.0]]))
    loss, _ = g.grpo_loss(logprobs, record, clip_eps=0.2, beta=0.04)
    loss.backward()
    assert bool(torch.isfinite(loss)) and bool(torch.isfinite(logprobs.grad).all())
    assert close(logprobs.grad, [[-0.5, -0.5, 0.0]])


def the_kl_term_and_the_importance_weights():
    """Eq. (9)'s KL term is beta * k3 to pi_ref, and the importance weights multiply the surrogate only, not
    the KL."""
    old = torch.tensor([[-1.0, -1.0]])
    ref = torch.tensor([[-2.0, -2.0]])
    kl = math.exp(-1) + 1 - 1  # k3 at log pi = -1, log pi_ref = -2
    loss, _ = g.grpo_loss(old.clone(), experience(old, torch.tensor([0.0]), ref=ref), clip_eps=0.2, beta=0.1)
    assert math.isclose(loss.item(), 0.1 * kl, abs_tol=1e-5)
    weighted = experience(old, torch.tensor([1.0]), ref=ref, is_weights=torch.full((1, 2), 2.0))
    loss, _ = g.grpo_loss(old.clone(), weighted, clip_eps=0.2, beta=0.1)
    assert math.isclose(loss.item(), -(2.0 * 1.0 - 0.1 * kl), abs_tol=1e-5)


def the_level_and_the_epsilons_reach_the_ratio():
    """Eq. (9) at GSPO's sequence level takes the ratio and its clip of importance_ratio: s = 0.5 with
    A~ = -1 and s = 2 with A~ = +1, clipped with 3e-4 below and 4e-4 above, give the terms -0.9997
    and 1.0004 on every token, all of them clipped."""
    old = torch.zeros(2, 2)
    logprobs = torch.tensor([[math.log(0.25), 0.0], [math.log(2.0), math.log(2.0)]])
    record = experience(old, torch.tensor([-1.0, 1.0]), weights=torch.full((2, 2), 0.25))
    loss, terms = g.grpo_loss(
        logprobs, record, clip_eps=0.2, beta=0.0, level="sequence", gspo_clip_eps=3e-4, clip_eps_high=4e-4
    )
    assert close(terms.ratio, [[0.5, 0.5], [2.0, 2.0]], atol=1e-6)
    assert close(terms.objective, [[-0.9997, -0.9997], [1.0004, 1.0004]], atol=1e-6)
    assert terms.clipped.tolist() == [[True, True], [True, True]]
    assert math.isclose(loss.item(), -0.00035, abs_tol=1e-6)


# Two completions of 1 and 3 tokens; each loss type's weights (G = 2, L = 3), written out.
UNEQUAL = torch.tensor([[1.0, 0.0, 0.0], [1.0, 1.0, 1.0]])
WEIGHTS = {
    "grpo": [[1 / 2, 0, 0], [1 / 6] * 3],
    "dapo": [[1 / 4, 0, 0], [1 / 4] * 3],
    "dr_grpo": [[1 / 6, 0, 0], [1 / 6] * 3],
}


def the_loss_weights_weigh_every_token():
    """Eq. (9) sums loss_weights * term over the tokens, whatever the weights: completions of 1 and 3
    tokens (A~ = 1 and -0.5, ratio 1, beta 0) under grpo's, dapo's and dr_grpo's weights."""
    old = torch.tensor([[-1.0, 0.0, 0.0], [-1.0, -2.0, -0.5]])
    advantages = torch.tensor([1.0, -0.5])
    for loss_type, weights in WEIGHTS.items():
        weights = torch.tensor(weights)
        record = experience(old, advantages, mask=UNEQUAL, weights=weights)
        loss, _ = g.grpo_loss(old.clone(), record, clip_eps=0.2, beta=0.0)
        expected = -(weights[0, 0] * 1.0 - weights[1].sum() * 0.5)
        assert math.isclose(loss.item(), float(expected), abs_tol=1e-6), loss_type


def one_step_raises_the_best_completion():
    """One GRPO step (Eq. (9), beta = 0.04) on a tiny random model raises the log-prob of the group's best
    completion and lowers the worst's."""
    model = tiny_model(seed=2)
    generator = torch.Generator().manual_seed(3)
    prompt = torch.randint(0, VOCAB, (1, 4), generator=generator).expand(4, 4)
    completions = torch.randint(0, VOCAB, (4, 5), generator=generator)
    input_ids = torch.cat([prompt, completions], dim=1)
    # rewards 0.5, 0, 1, 0.5: mean 0.5, population std sqrt(1/8); Eq. (8) by hand
    advantages = torch.tensor([0.0, -math.sqrt(2), math.sqrt(2), 0.0])
    with torch.no_grad():
        old = completion_logprobs(model, input_ids, 4)
    record = experience(old, advantages, ref=old.clone())
    optimizer = torch.optim.SGD(model.parameters(), lr=1.0)
    loss, _ = g.grpo_loss(completion_logprobs(model, input_ids, 4), record, clip_eps=0.2, beta=0.04)
    loss.backward()
    optimizer.step()
    with torch.no_grad():
        new = completion_logprobs(model, input_ids, 4)
    assert float(new[2].sum()) > float(old[2].sum()) + 1e-3
    assert float(new[1].sum()) < float(old[1].sum()) - 1e-3


# ==== Eq. (9)'s normalisation: grpo, dapo, dr_grpo ====
MASK = torch.tensor([[1.0, 1.0, 0.0, 0.0], [1.0, 1.0, 1.0, 1.0]])  # a 2-token and a 4-token completion


def grpo_weights_by_hand():
    """grpo weights 1 / (|o_i| G): 1/4 on the 2-token completion, 1/8 on the 4-token one, 0 where masked."""
    got = g.loss_weights(MASK, "grpo", max_new_tokens=4)
    assert close(got, [[0.25, 0.25, 0.0, 0.0], [0.125] * 4])


def grpo_weights_count_every_row():
    """grpo's G counts every row of the minibatch, one without tokens too (it gets weight 0, no NaN)."""
    with_an_empty_row = torch.cat([MASK, torch.zeros(1, 4)])
    got = g.loss_weights(with_an_empty_row, "grpo", max_new_tokens=4)
    assert bool(torch.isfinite(got).all())
    assert close(got, [[1 / 6, 1 / 6, 0.0, 0.0], [1 / 12] * 4, [0.0] * 4])


def dapo_weights_by_hand():
    """dapo weights 1 / N over the minibatch's N = 6 tokens; with 12 tokens on 2 ranks (a tensor or a
    number), world_size / 12."""
    assert close(g.loss_weights(MASK, "dapo", max_new_tokens=4), MASK / 6)
    for all_rank_tokens in (torch.tensor(12.0), 12):  # a tensor or a plain number
        got = g.loss_weights(MASK, "dapo", max_new_tokens=4, all_rank_tokens=all_rank_tokens, world_size=2)
        assert close(got, MASK * 2 / 12)


def dr_grpo_has_no_length_bias():
    """dr_grpo weights are the constant 1 / (G L) on every token whatever the completion's length (L = 8
    here); unknown types raise ValueError."""
    got = g.loss_weights(MASK, "dr_grpo", max_new_tokens=8)
    assert close(got, MASK / 16)
    try:
        g.loss_weights(MASK, "mean", max_new_tokens=8)
    except ValueError:
        return
    raise AssertionError("no ValueError")
