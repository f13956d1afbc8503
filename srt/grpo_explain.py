"""`stage2_grpo.py --explain`: one GRPO step on one group, every quantity of Eqs. (4)-(9) printed as a
student would compute it by hand (docs/grpo-step.md is its output, with commentary), and drawn as a
page (srt/step_page.py).

The package imports no script, so the script hands its step in (GRPOStep): its sampling, the
Experience record it fills before the update (advantages, pi_old, pi_ref, importance and
normalisation weights), its update, and Eq. (9) on that record after the update. This module prints
what those return and computes nothing of its own; the one token written out shows each step of
Eq. (9) by hand, but its clip and its min() are grpo_loss's own (worked_numbers), and its last line
is grpo_loss's own term for that token."""

from __future__ import annotations

import dataclasses
import functools
import os
import sys
from dataclasses import dataclass
from typing import Callable

import torch

from srt.config import at_least
from srt.data_io import read_mixture
from srt.distributed import setup_distributed
from srt.loading import GRPO_DROPOUT_NOTE, load_model_and_tokenizer, zero_dropout
from srt.precision import resolve_dtype
from srt.rollouts import PromptStream
from srt.step_page import unwritable, write_step_page
from srt.training import adamw, seed_everything, warmup_lr


@dataclass(frozen=True)
class GRPOStep:
    """stage2_grpo.py's own step, as --explain calls it (see the script for each)."""

    settings_of: Callable  # StepSettings.of(cfg, autocast_dtype)
    models: Callable  # Models(policy, tokenizer, optimizer, ref_model)
    sample_batch: Callable  # the rollout, Eqs. (4)-(7)
    make_experience: Callable  # Eq. (8), pi_old, pi_ref and the weights, filled once
    update: Callable  # Eq. (9), one AdamW step a minibatch
    experience_loss: Callable  # Eq. (9) on the record at the weights now: (loss, TokenTerms, log pi_theta)
    loss: Callable  # grpo_loss, Eq. (9) itself: the worked token's clip and min() are its own
    loss_types: dict  # --loss-type -> its normalisation weight, written out
    compute_rewards: Callable  # reward.py


# What a Ctrl-C or a full disk during --explain leaves (the script's one line after "interrupted:"
# or the disk's error): a page is renamed into place only when whole (step_page.write_step_page).
LEAVES = (
    "--explain saves no run, and an earlier page stays until a new one is whole; the same command "
    "runs it again"
)


def add_flags(group) -> None:
    """stage2_grpo.py's --explain flags, in its run group."""
    group.add_argument(
        "--explain",
        action="store_true",
        help="run one step on one group and print every quantity of "
        "Eqs. (4)-(9), as computed by hand (docs/grpo-step.md); only --explain-html is written",
    )
    group.add_argument(
        "--explain-tries",
        type=at_least(1),
        default=8,
        help="--explain: groups to sample, one prompt each, until one whose K rewards differ "
        "(an all-equal group has advantage 0, Eq. (8)); the last is explained if none does",
    )
    group.add_argument(
        "--explain-html",
        default="runs/explain/grpo-step.html",
        metavar="PATH",
        help="--explain: the step as a self-contained page, tokens shaded by their ratio "
        "(srt/step_page.py); it replaces an earlier page, any other file only with --overwrite",
    )


def shorten(text: str, width: int = 70) -> str:
    """One line: the start of the completion and its final answer line."""
    flat = " ".join(text.split())
    if len(flat) <= width:
        return flat
    answer_at = flat.rfind("Final answer:")
    tail = flat[answer_at:][: width // 2] if answer_at > 0 else flat[-(width // 2) :]
    return flat[: width - len(tail) - 5] + " ... " + tail


def token_pieces(tokenizer, ids) -> tuple[list[str], list[str]]:
    """-> (the text of each token of one completion, a mark for each token that shows no text: a
    special token's name, else a dot; "" for the others). The pieces join to exactly the text the reward read
    (decode(ids, skip_special_tokens=True)), which decoding each token alone would not give: a
    character of several bytes spans tokens, and the tokenizer's clean-up of spaces rewrites the end
    of a prefix. So each token takes what its prefix adds to the longest common prefix with the whole
    text; a byte left incomplete waits for the token that completes it."""
    full = tokenizer.decode(ids, skip_special_tokens=True)
    special = set(tokenizer.all_special_ids)
    pieces, marks, done = [], [], 0
    for i, token in enumerate(ids):
        if i == len(ids) - 1:
            end = len(full)
        else:
            prefix = tokenizer.decode(ids[: i + 1], skip_special_tokens=True)
            end = max(done, len(os.path.commonprefix([prefix, full])))
        pieces.append(full[done:end])
        if done < end:
            marks.append("")
        else:  # its name (the stop token), or a dot: text a later token completes, or a space cleaned up
            marks.append(tokenizer.convert_ids_to_tokens(token) if token in special else "\u00b7")
        done = end
    return pieces, marks


def worked_token(ratio, advantages, clipped, mask) -> tuple[int, int, str]:
    """The token whose Eq. (9) term --explain writes out: one of a completion with A~ != 0, a clipped
    one if any (the case the min() is there for), else the one the update moved most (largest
    |r - 1|). -> (completion, token, why it was picked)."""
    policy = mask > 0
    useful = policy & (advantages != 0)
    if (useful & clipped).any():
        pool, why = useful & clipped, "clipped; of the clipped tokens, the largest |r - 1|"
    elif useful.any():
        pool, why = useful, "none is clipped; the largest |r - 1| among tokens with A~ != 0"
    else:
        pool, why = policy, "every A~ is 0, so its surrogate is 0 whatever r; the largest |r - 1|"
    moved = torch.where(pool, (ratio - 1).abs().nan_to_num(0.0), -1.0)
    k, t = divmod(int(moved.argmax()), moved.shape[1])
    return k, t, why


def explain(cfg, step: GRPOStep, reward_fn=None, print_fn=print) -> dict:
    """Run one GRPO step of stage2_grpo.py on one group of K completions (one process), print Eqs.
    (4)-(9) for it and write its page (srt/step_page.py) to --explain-html. `reward_fn` defaults to
    the script's compute_rewards with --answer-reward and --answer-gate. -> {"rewards": [K],
    "advantages": [K], "after": [per-completion token means of Eq. (9)'s terms], "loss" (Eq. (9) on
    the record after the update), "tries", "differs", "texts": [K], "tokens": [K per-token dicts:
    text, new / old / ref log-probs, ratio, is_weight, kl, clipped, objective, weight, policy_mask],
    "worked": the one token written out, "html": the page's path}."""
    problem = unwritable(cfg.explain_html)  # now, not after the model has loaded and the step run
    if problem:
        sys.exit(f"error: {problem}")
    reward_fn = reward_fn or functools.partial(
        step.compute_rewards, answer_reward=cfg.answer_reward, answer_gate=cfg.answer_gate
    )
    models, settings, stream, lr = load_step(cfg, step)
    print_fn(
        f"One GRPO step on one group: K = {cfg.num_generations}, model {cfg.model}, lr {lr:g} (step 1 of "
        f"the warm-up), beta {cfg.beta}, clip eps {cfg.clip_eps}, temperature {cfg.temperature}, answer "
        f"reward {cfg.answer_reward}"
    )
    rollout, record, tries, differs = sample_a_group_that_differs(
        cfg, step, models, settings, stream, reward_fn, print_fn
    )
    print_rewards(record, rollout, print_fn)
    experience = step.make_experience(models, rollout, settings)  # the record the update reads
    rewards, advantages = print_advantages(cfg, rollout, experience, print_fn)
    updates = [u for u in step.update(models, experience, settings) if u is not None]
    update = {
        "loss": sum(u.loss for u in updates) / max(len(updates), 1),
        "grad_norm": sum(u.grad_norm for u in updates) / max(len(updates), 1),
        "updates": len(updates),
    }
    print_fn(
        f"\nThe update: {cfg.num_generations} completions in {len(experience.minibatches)} minibatch(es) "
        f"(--sample-ratio), mu = {cfg.mu} pass(es): {update['updates']} AdamW step(s), mean loss "
        f"{update['loss']:.6f}, mean gradient norm {update['grad_norm']:.4f} (clipped at {cfg.max_grad_norm})"
    )
    loss, terms, new_logprobs = step.experience_loss(models, experience, settings)
    after = print_after(cfg, step, experience, terms, loss, print_fn)
    per_token = token_rows(models.tokenizer, rollout, experience, terms, new_logprobs)
    worked = print_worked_token(cfg, step, rollout, experience, terms, new_logprobs, per_token, print_fn)
    page = write_step_page(
        cfg.explain_html,
        page_of(cfg, lr, record, rollout, rewards, advantages, per_token, tries, differs, update),
    )
    print_fn(f"\nThe step as a page (each token shaded by its ratio, the K completions side by side): {page}")
    return {
        "rewards": rewards.tolist(),
        "advantages": advantages.tolist(),
        "after": after,
        "loss": loss,
        "tries": tries,
        "differs": differs,
        "texts": list(rollout.texts),
        "tokens": per_token,
        "worked": worked,
        "html": page,
    }


def load_step(cfg, step: GRPOStep):
    """The policy, pi_ref (--model, frozen), AdamW at the first warm-up step's lr, the step's
    settings, and a prompt stream over the turns that need recall (§3), so that every term of Eq. (4)
    has something to say. -> (models, settings, stream, lr)."""
    cfg.prompts_per_step, cfg.world_size = 1, 1
    _, _, _, device = setup_distributed()
    seed_everything(cfg.seed)
    _, autocast_dtype = resolve_dtype(cfg.dtype, device)
    policy, tokenizer = load_model_and_tokenizer(cfg.model, dtype=cfg.dtype, device=device)
    zero_dropout(policy, GRPO_DROPOUT_NOTE)  # pi_old runs in train mode, as in stage 2's train()
    ref_model, _ = load_model_and_tokenizer(cfg.model, dtype=cfg.dtype, device=device)
    ref_model.eval().requires_grad_(False)
    optimizer = adamw(policy.parameters(), cfg.lr, cfg.weight_decay)
    lr = warmup_lr(1, cfg.lr, cfg.warmup_steps)
    for group in optimizer.param_groups:
        group["lr"] = lr
    records = read_mixture(cfg.data, cfg.seed)
    records = [r for r in records if r["recall"]] or records
    stream = PromptStream(records, tokenizer, cfg.max_prompt_length, cfg.seed)
    models = step.models(policy, tokenizer, optimizer, ref_model=ref_model)
    return models, step.settings_of(cfg, autocast_dtype), stream, lr


def sample_a_group_that_differs(cfg, step: GRPOStep, models, settings, stream, reward_fn, print_fn):
    """Eqs. (4)-(7): sample K completions from pi_old and score each. Eq. (8) gives a group whose K
    rewards are all equal advantage 0 on every token, a step in which nothing moves; so take the
    stream's next prompt until a group differs, as --dynamic-sampling total does during training.
    -> (rollout, record, tries, differs)."""
    for tries in range(1, cfg.explain_tries + 1):
        record, prompt = stream.next_batch(1)[0]
        rollout = step.sample_batch(models, [record], [prompt], settings, reward_fn)
        totals = rollout.rewards("total")[0]
        differs = not bool((totals == totals[0]).all())  # group_advantages' test for a zero group
        if differs:
            return rollout, record, tries, differs
        print_fn(
            f"record {record['id']}: all {cfg.num_generations} rewards equal (R = {totals[0].item():.4f}): "
            "zero advantages, nothing to learn; "
            + ("trying the next prompt" if tries < cfg.explain_tries else "that was the last try")
        )
    print_fn(
        f"None of the {tries} groups sampled (--explain-tries {cfg.explain_tries}) has rewards that "
        "differ: the last one is explained anyway, and it teaches nothing (every advantage is 0)."
    )
    return rollout, record, tries, differs


def print_rewards(record, rollout, print_fn) -> None:
    """The prompt, its gold (the reward's, never the prompt's), and Eqs. (4)-(7) per completion."""
    print_fn(
        f"\nThe prompt: record {record['id']}, {len(record['history'])} utterances of history, "
        f"query Q{record['query_turn']}: {record['query']!r}"
    )
    print_fn(
        f"H* = {record['recall']}, A* = {record['answer']!r} (the reward's answer key; never in the prompt)"
    )
    print_fn("\nEqs. (4)-(7): R = format + recall + answer for each completion")
    print_fn(f"{'k':>2}  {'format':>6}  {'recall':>7}  {'answer':>7}  {'R':>7}  completion (shortened)")
    for k, (score, text) in enumerate(zip(rollout.scores, rollout.texts), 1):
        print_fn(
            f"{k:>2}  {score['format']:>6.2f}  {score['recall']:>7.4f}  {score['answer']:>7.4f}  "
            f"{score['total']:>7.4f}  {shorten(text)!r}"
        )


def print_advantages(cfg, rollout, experience, print_fn):
    """Eq. (8): the group's mean and population std, and each completion's advantage as the record
    holds it. -> (rewards [K], advantages [K])."""
    rewards = rollout.rewards("total")[0]
    mean, std = rewards.mean().item(), rewards.std(unbiased=False).item()
    advantages = experience.advantages[:, 0].detach().cpu()  # its first token's: one per completion
    print_fn(f"\nEq. (8): mean R = {mean:.4f}, std R = {std:.4f} (population: divide by K)")
    # --scale-rewards none (Dr. GRPO) keeps R - mean; batch is group here: one group is the batch
    formula = "A~ = R - mean (no std)" if cfg.scale_rewards == "none" else "A~ = (R - mean) / (std + 1e-8)"
    print_fn(f"{'k':>2}  {'R - mean':>9}  {formula:>31}")
    for k in range(len(rewards)):
        print_fn(f"{k + 1:>2}  {rewards[k].item() - mean:>9.4f}  {advantages[k].item():>31.4f}")
    if cfg.credit == "segment":
        print_fn(
            "(--credit segment: the think tokens take the advantage of format + recall, the answer "
            "tokens that of format + answer; the table shows the first token's, the think block's)"
        )
    return rewards, advantages


def print_after(cfg, step: GRPOStep, experience, terms, loss, print_fn) -> list[dict]:
    """Eq. (9) after the update, per completion: the token means of its terms, and its part of
    -loss, sum_t weight * term, with the record's own weights. -> one dict a completion."""
    mask = experience.policy_mask
    tokens = mask.sum(1).clamp(min=1)
    surrogate = terms.objective + cfg.beta * terms.kl  # w * min(r A~, clip(r) A~), before the KL

    def token_means(x):  # over each completion's policy tokens, the tokens Eq. (9) averages
        return (torch.where(mask > 0, x.float(), 0.0).sum(1) / tokens).tolist()

    means = {
        "ratio": token_means(terms.ratio),
        "clip_fraction": token_means(terms.clipped),
        "is_weight": token_means(experience.is_weights),
        "kl": token_means(terms.kl),
        "surrogate": token_means(surrogate),
        "objective": token_means(terms.objective),
    }
    share = (terms.objective * experience.loss_weights).sum(1)  # each completion's part of -loss
    print_fn(
        "\nEq. (9) after the update, per completion (token means of grpo_loss's terms; w = "
        f"min(pi_old / pi_sampler, {cfg.is_cap:g}), the truncated importance weight; surrogate = "
        "w * min(r A~, clip(r) A~); KL is the k3 estimator to pi_ref; the last column is the "
        "completion's part of -loss)"
    )
    print_fn(
        f"{'k':>2}  {'tokens':>6}  {'mean r':>9}  {'clipped':>7}  {'mean w':>9}  {'k3 KL':>9}  "
        f"{'surrogate':>10}  {'beta*KL':>9}  {'KL share':>8}  {'of -loss':>10}"
    )
    after = []
    for k in range(len(mask)):
        row = {"tokens": int(mask[k].sum().item()), **{name: values[k] for name, values in means.items()}}
        row["kl_term"] = cfg.beta * row["kl"]
        row["kl_share"] = row["kl_term"] / (abs(row["surrogate"]) + row["kl_term"] or 1.0)
        row["of_loss"] = share[k].item()
        after.append(row)
        print_fn(
            f"{k + 1:>2}  {row['tokens']:>6}  {row['ratio']:>9.6f}  {row['clip_fraction']:>7.1%}  "
            f"{row['is_weight']:>9.6f}  {row['kl']:>9.2e}  {row['surrogate']:>10.6f}  "
            f"{row['kl_term']:>9.2e}  {row['kl_share']:>8.1%}  {row['of_loss']:>10.6f}"
        )
    print_fn(
        f"Eq. (9) on this group now, grpo_loss over the record's {len(experience.minibatches)} minibatch(es) "
        f"(--loss-type {cfg.loss_type}) = -sum of the last column = {loss:.6f}"
    )
    print_fn(f"Each token's weight under --loss-type {cfg.loss_type} (--scale-rewards {cfg.scale_rewards}), "
             f"{step.loss_types[cfg.loss_type]}:")  # fmt: skip
    for k in range(len(mask)):
        weight = experience.loss_weights[k][mask[k] > 0]
        shown = (
            f"{weight[0].item():.6g} = 1 / {1 / weight[0].item():.6g}" if len(weight) else "(no policy token)"
        )
        print_fn(f"  completion {k + 1}: w = {shown}")
    return after


def token_rows(tokenizer, rollout, experience, terms, new_logprobs) -> list[dict]:
    """Every token of every completion, as the page shows it: the pieces join to the reward's text,
    each with the record's and the loss's numbers."""
    per_token = []
    ref = experience.ref_logprobs
    for k, n in enumerate(rollout.completion_mask.sum(1).tolist()):
        pieces, marks = token_pieces(tokenizer, rollout.completion_ids[k, :n].tolist())
        per_token.append(
            {
                "text": pieces,
                "marks": marks,
                "new_logprobs": new_logprobs[k, :n].tolist(),
                "old_logprobs": experience.old_logprobs[k, :n].tolist(),
                "ref_logprobs": [None] * n if ref is None else ref[k, :n].tolist(),
                "ratio": terms.ratio[k, :n].tolist(),
                "is_weight": experience.is_weights[k, :n].tolist(),
                "kl": terms.kl[k, :n].tolist(),
                "clipped": terms.clipped[k, :n].tolist(),
                "objective": terms.objective[k, :n].tolist(),
                "weight": experience.loss_weights[k, :n].tolist(),
                "policy_mask": [int(x) for x in rollout.policy_mask[k, :n].tolist()],
            }
        )
    return per_token


def print_worked_token(
    cfg, step: GRPOStep, rollout, experience, terms, new_logprobs, per_token, print_fn
) -> dict:
    """Eq. (9) for one token, by hand from grpo_loss's ratio and KL and the record's weights: the
    min() of the clipped surrogate, and the token's term, which is grpo_loss's own."""
    eps, beta = cfg.clip_eps, cfg.beta
    k, t, why = worked_token(terms.ratio, experience.advantages, terms.clipped, experience.policy_mask)
    w = worked_numbers(step.loss, eps, rollout, experience, terms, new_logprobs, (k, t))
    ref, sampler = experience.ref_logprobs, rollout.sampler_logprobs
    print_fn(
        f"\nEq. (9) for one token, written out: completion {w['k']}, token {w['t']} of "
        f"{len(per_token[k]['text'])}, {per_token[k]['text'][t]!r} ({why})"
    )
    ref_text = "not computed (beta 0)" if ref is None else f"{w['ref']:.9g}"
    print_fn(
        f"  log pi_theta = {w['new']:.9g} (after the update), log pi_old = {w['old']:.9g} (before it), "
        f"log pi_ref = {ref_text}"
    )
    print_fn(f"  r = exp(log pi_theta - log pi_old) = exp({w['log_ratio']:.9g}) = {w['ratio']:.9g}")
    whose = "this token's segment" if cfg.credit == "segment" else f"completion {w['k']}'s"
    print_fn(f"  A~ = {w['advantage']:.9g} ({whose} advantage, Eq. (8))")
    print_fn(f"  r * A~ = {w['unclipped']:.9g}")
    print_fn(
        f"  clip(r, 1 - {eps:g}, 1 + {eps:g}) * A~ = {w['clip_ratio']:.9g} * A~ = {w['clipped_term']:.9g}"
    )
    print_fn(
        f"  min(r * A~, clip(r) * A~) = {w['surrogate']:.9g}: "
        + (
            "clipped, min() took the constant clip(r) * A~, so this token's surrogate gives no gradient"
            if w["clipped"]
            else "A~ = 0, so the term and its gradient are 0"
            if w["advantage"] == 0
            else "not clipped, min() is r * A~ and the gradient flows through r"
        )
    )
    if sampler is None or cfg.is_cap == 0:
        print_fn(f"  w = 1: no importance weight (--is-cap {cfg.is_cap:g}, or no sampler log-probs)")
    else:  # the tokens came from pi_sampler; Eq. (9)'s expectation is over pi_old
        print_fn(
            f"  w = min(pi_old / pi_sampler, {cfg.is_cap:g}) = min(exp({w['old'] - w['sampler']:.9g}), "
            f"{cfg.is_cap:g}) = {w['is_weight']:.9g} (--is-cap; log pi_sampler = {w['sampler']:.9g}, 1 up to "
            "rounding where the sampler is the policy)"
        )
    if ref is not None:
        print_fn(
            f"  k3 KL = exp(d) - d - 1, d = log pi_ref - log pi_theta = {w['ref_minus_new']:.9g}: "
            f"KL = {w['kl']:.9g}"
        )
    print_fn(
        f"  its term of Eq. (9): w * min(...) - beta * KL = {w['is_weight']:.9g} * {w['surrogate']:.9g} - "
        f"{beta:g} * {w['kl']:.9g} = {w['term']:.9g}"
    )
    print_fn(
        f"  its weight in the normalisation (--loss-type {cfg.loss_type}): "
        f"{step.loss_types[cfg.loss_type]}; here {w['weight']:.9g}; "
        f"term * weight = {w['term'] * w['weight']:.9g}, its part of -loss"
    )
    return w


def worked_numbers(loss, eps, rollout, experience, terms, new_logprobs, at) -> dict:
    """Every number of the token written out: the record's, grpo_loss's, and the steps of the
    clipped surrogate between them, the clip and the min() taken from grpo_loss (surrogates)."""
    r, a = terms.ratio[at], experience.advantages[at]
    clip_r, surrogate = surrogates(loss, eps, experience, new_logprobs, at, r)
    ref, sampler = experience.ref_logprobs, rollout.sampler_logprobs
    return {
        "k": at[0] + 1,
        "t": at[1] + 1,
        "new": new_logprobs[at].item(),
        "old": experience.old_logprobs[at].item(),
        "ref": None if ref is None else ref[at].item(),
        "sampler": None if sampler is None else sampler[at].item(),
        "log_ratio": (new_logprobs - experience.old_logprobs)[at].item(),
        "ratio": r.item(),
        "advantage": a.item(),
        "unclipped": (r * a).item(),
        "clip_ratio": clip_r.item(),
        "clipped_term": (clip_r * a).item(),
        "surrogate": surrogate.item(),
        "clipped": bool(terms.clipped[at].item()),
        "is_weight": experience.is_weights[at].item(),
        "ref_minus_new": None if ref is None else (ref - new_logprobs)[at].item(),
        "kl": terms.kl[at].item(),
        "term": terms.objective[at].item(),
        "weight": experience.loss_weights[at].item(),
    }


def surrogates(loss, eps, experience, new_logprobs, at, r) -> tuple[torch.Tensor, torch.Tensor]:
    """(clip(r, 1 - eps, 1 + eps), min(r A~, clip(r) A~)) at token `at` (ratio r), one the policy sampled
    (worked_token picks one), both read off grpo_loss (`loss`) instead of written a second time here.
    With no importance weight (w = 1) and no KL (beta 0, no pi_ref), a token's term of Eq. (9) is
    min(r A~, clip(r) A~) alone: at the record's own A~ that is the min(); at A~ = +1 it is
    min(r, clip(r)), which is clip(r) when r >= 1; at A~ = -1 it is -max(r, clip(r)), which is
    -clip(r) when r < 1. The record is taken whole, so r is the very float of the step's TokenTerms."""

    def term_at(advantages) -> torch.Tensor:
        alone = dataclasses.replace(
            experience, advantages=advantages, is_weights=torch.ones_like(experience.is_weights),
            ref_logprobs=None,
        )  # fmt: skip
        with torch.no_grad():
            return loss(new_logprobs, alone, eps, 0.0)[1].objective[at]

    ones = torch.ones_like(experience.advantages)
    clip_r = term_at(ones) if r >= 1 else -term_at(-ones)
    return clip_r, term_at(experience.advantages)


def page_of(cfg, lr, record, rollout, rewards, advantages, per_token, tries, differs, update) -> dict:
    """What srt/step_page.py draws."""
    K = cfg.num_generations
    return {
        "title": f"One GRPO step on one group of K = {K}: {cfg.model}",
        "settings": [
            ("model", cfg.model),
            ("K", K),
            ("lr", f"{lr:g} (step 1 of the warm-up)"),
            ("beta", cfg.beta),
            ("clip eps", cfg.clip_eps),
            ("loss type", cfg.loss_type),
            ("scale rewards", cfg.scale_rewards),
            ("is cap", cfg.is_cap),
            ("temperature", cfg.temperature),
            ("answer reward", cfg.answer_reward),
            ("recall", cfg.recall),
            ("credit", cfg.credit),
            ("seed", cfg.seed),
        ],
        "prompt": {
            "id": record["id"],
            "history_turns": len(record["history"]),
            "query_turn": record["query_turn"],
            "query": record["query"],
            "recall": list(record["recall"]),
            "answer": record["answer"],
        },
        "tries": tries,
        "differs": differs,
        "clip_eps": cfg.clip_eps,
        "beta": cfg.beta,
        "mean": rewards.mean().item(),
        "std": rewards.std(unbiased=False).item(),
        "update": update,
        "completions": [
            {
                "k": k + 1,
                **{key: float(rollout.scores[k][key]) for key in ("format", "recall", "answer", "total")},
                "advantage": advantages[k].item(),
                "tokens": per_token[k]["text"],
                "marks": per_token[k]["marks"],
                "ratio": per_token[k]["ratio"],
                "kl": per_token[k]["kl"],
                "clipped": per_token[k]["clipped"],
                "policy_mask": per_token[k]["policy_mask"],
            }
            for k in range(K)
        ],
    }
