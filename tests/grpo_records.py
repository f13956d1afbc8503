"""Experience records built by hand, for the tests of Eq. (9) on hand-computed values: grpo_loss
reads one record, as the update hands it; these build it from the few tensors a hand example has."""

import torch

import stage2_grpo as g


def hand_experience(
    old_logprobs,
    ref_logprobs,
    advantages,
    mask,
    loss_type="grpo",
    is_weights=None,
    max_new_tokens=None,
    all_rank_tokens=None,
    world_size=1,
):
    """One minibatch's Experience: A~ per completion ([B]) or per token ([B, C]); the loss weights
    of `loss_type` (stage2_grpo.loss_weights), with L = max_new_tokens (default: the width C)."""
    mask = torch.as_tensor(mask).float()
    sampled = mask > 0
    advantages = advantages.view(-1, 1) if advantages.dim() == 1 else advantages
    weights = g.loss_weights(mask, loss_type, max_new_tokens or mask.shape[1], all_rank_tokens, world_size)
    return g.Experience(
        input_ids=None,
        attention_mask=None,
        policy_mask=mask,
        advantages=advantages.expand_as(mask),
        old_logprobs=torch.where(sampled, old_logprobs, 0.0),
        ref_logprobs=None if ref_logprobs is None else torch.where(sampled, ref_logprobs, 0.0),
        is_weights=torch.ones_like(mask) if is_weights is None else torch.where(sampled, is_weights, 1.0),
        loss_weights=weights,
        minibatches=(torch.arange(len(mask)),),
    )


def token_mean(x, mask) -> float:
    """The mean of x over the policy tokens, as the step's statistics take it."""
    mask = torch.as_tensor(mask) > 0
    return (torch.where(mask, x.double(), 0.0).sum() / mask.sum().clamp(min=1)).item()


def hand_loss(logprobs, old, ref, advantages, mask, clip_eps=0.2, beta=0.04, **record):
    """grpo_loss on a hand_experience -> (loss, {"kl", "clip_fraction", "ratio"} token means)."""
    loss, terms = g.grpo_loss(logprobs, hand_experience(old, ref, advantages, mask, **record), clip_eps, beta)
    stats = {name: token_mean(getattr(terms, name), mask) for name in ("kl", "ratio")}
    stats["clip_fraction"] = token_mean(terms.clipped, mask)
    return loss, stats


def run_step(policy, ref_model, tokenizer, optimizer, records, prompts, cfg, reward_fn=None, **more):
    """One grpo_step with the models and the settings of `cfg` (parse_args) -> StepStats. `more`:
    draw_more, train_model (a wrapper), autocast_dtype."""
    models = g.Models(policy, tokenizer, optimizer, ref_model=ref_model, train_model=more.get("train_model"))
    settings = g.StepSettings.of(cfg, more.get("autocast_dtype"))
    return g.grpo_step(models, records, prompts, settings, reward_fn, more.get("draw_more"))


def sample(policy, tokenizer, records, prompts, cfg, reward_fn, autocast_dtype=None):
    """stage2_grpo.sample_batch with the settings of `cfg` -> Rollout."""
    models = g.Models(policy, tokenizer, optimizer=None)
    return g.sample_batch(models, records, prompts, g.StepSettings.of(cfg, autocast_dtype), reward_fn)


def step_on(rollout, policy, tokenizer, optimizer, cfg, ref_model=None, autocast_dtype=None):
    """The experience and the update of a step on a rollout drawn before -> (Experience, [UpdateStats],
    StepStats)."""
    models = g.Models(policy, tokenizer, optimizer, ref_model=ref_model)
    settings = g.StepSettings.of(cfg, autocast_dtype)
    experience = g.make_experience(models, rollout, settings)
    updates = g.update(models, experience, settings)
    return experience, updates, g.step_stats(rollout, experience, updates, settings)
