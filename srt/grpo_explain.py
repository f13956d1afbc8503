"""`stage2_grpo.py --explain`: one GRPO step on one group, every quantity of Eqs. (4)-(9) printed as a
student would compute it by hand (docs/grpo-step.md is its output, with commentary), and drawn as a
page (srt/step_page.py).

The package imports no script, so the script hands its own algorithm in as `grpo` (its module, or
any object with the same names): the step is `grpo.grpo_step`, the advantages `grpo.group_advantages`
and `grpo.rollout_advantages`, the log-probs `grpo.token_logprobs_of`, and Eq. (9) after the update is
`grpo.grpo_loss` itself, called with the arguments the update gives it (truncated importance weights
included), so that the page a student studies is the loss that trains. Only the one token written
out is done by hand, and its last line is grpo_loss's own term for that token."""

from __future__ import annotations

import functools
import os

import torch

from srt.config import at_least
from srt.data_io import read_mixture
from srt.distributed import setup_distributed
from srt.modeling import GRPO_DROPOUT_NOTE, load_model_and_tokenizer, resolve_dtype, zero_dropout
from srt.rollouts import PromptStream
from srt.step_page import write_step_page
from srt.training import adamw, seed_everything, warmup_lr

# How each --loss-type averages Eq. (9)'s token terms (grpo_loss), and so a token's weight in it.
LOSS_TYPES = {
    "grpo": "each completion's token mean, then their mean over the K (Eq. (9))",
    "dapo": "one mean over every policy token of the group",
    "dr_grpo": "the sum over every policy token, divided by K times --max-new-tokens",
}


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
        help="--explain: the step as a self-contained page, tokens shaded by their ratio (srt/step_page.py)",
    )


def token_weight_formula(loss_type: str, mask, k: int, max_new_tokens: int) -> str:
    """A token of completion k's weight in the normalisation (grpo_loss's terms["weight"]), written
    with its numbers: 1 / (|o_k| K) under --loss-type grpo, 1 / N (the group's policy tokens) under
    dapo, 1 / (K L) with L = --max-new-tokens under dr_grpo."""
    if loss_type == "grpo":
        return f"1 / (|o_k| K) = 1 / ({int(mask[k].sum().item())} * {len(mask)})"
    if loss_type == "dapo":
        return f"1 / N = 1 / {int(mask.sum().item())}"
    return f"1 / (K L) = 1 / ({len(mask)} * {max_new_tokens})"


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


def explain(cfg, grpo, reward_fn=None, print_fn=print) -> dict:
    """Run one GRPO step (grpo.grpo_step) on one group of K completions (one process), print Eqs.
    (4)-(9) for it and write its page (srt/step_page.py) to --explain-html. `grpo` is stage2_grpo.py's
    module (see the module docstring for the names it reads); `reward_fn` defaults to its
    compute_rewards with --answer-reward and --answer-gate. -> {"rewards": [K], "advantages": [K],
    "after": [per-completion token means of Eq. (9)'s terms], "loss" (grpo_loss's, after the update),
    "tries", "differs", "texts": [K], "tokens": [K per-token dicts: text, new / old / ref log-probs,
    ratio, is_weight, kl, clipped, objective, weight, policy_mask], "worked": the one token written
    out, "html": the page's path}."""
    reward_fn = reward_fn or functools.partial(
        grpo.compute_rewards, answer_reward=cfg.answer_reward, answer_gate=cfg.answer_gate
    )
    cfg.prompts_per_step, cfg.world_size = 1, 1
    _, _, _, device = setup_distributed()
    seed_everything(cfg.seed)
    _, autocast_dtype = resolve_dtype(cfg.dtype, device)
    policy, tokenizer = load_model_and_tokenizer(cfg.model, dtype=cfg.dtype, device=device)
    zero_dropout(policy, GRPO_DROPOUT_NOTE)  # pi_old runs in train mode, as in stage 2's train()
    ref_model, _ = load_model_and_tokenizer(cfg.model, dtype=cfg.dtype, device=device)
    ref_model.eval().requires_grad_(False)
    optimizer = adamw(policy.parameters(), cfg.lr, cfg.weight_decay)
    # Turns that need recall (§3), so that every term of Eq. (4) has something to say.
    records = read_mixture(cfg.data, cfg.seed)
    records = [r for r in records if r["recall"]] or records
    stream = PromptStream(records, tokenizer, cfg.max_prompt_length, cfg.seed)
    K, eps, beta = cfg.num_generations, cfg.clip_eps, cfg.beta
    lr = warmup_lr(1, cfg.lr, cfg.warmup_steps)
    for group in optimizer.param_groups:
        group["lr"] = lr

    print_fn(
        f"One GRPO step on one group: K = {K}, model {cfg.model}, lr {lr:g} (step 1 of the warm-up), "
        f"beta {beta}, clip eps {eps}, temperature {cfg.temperature}, answer reward {cfg.answer_reward}"
    )

    # Eqs. (4)-(7): sample K completions from pi_old and score each. Eq. (8) gives a group whose K
    # rewards are all equal advantage 0 on every token, a step in which nothing moves; so take the
    # stream's next prompt until a group differs, as --dynamic-sampling total does during training.
    for tries in range(1, cfg.explain_tries + 1):
        record, prompt = stream.next_batch(1)[0]
        rollout = grpo.sample_batch(policy, tokenizer, [record], [prompt], cfg, reward_fn, autocast_dtype)
        totals = rollout.rewards("total")[0]
        differs = not bool((totals == totals[0]).all())  # group_advantages' test for a zero group
        if differs:
            break
        print_fn(
            f"record {record['id']}: all {K} rewards equal (R = {totals[0].item():.4f}): zero advantages, "
            "nothing to learn; "
            + ("trying the next prompt" if tries < cfg.explain_tries else "that was the last try")
        )
    if not differs:
        print_fn(
            f"None of the {tries} groups sampled (--explain-tries {cfg.explain_tries}) has rewards that "
            "differ: the last one is explained anyway, and it teaches nothing (every advantage is 0)."
        )
    print_fn(
        f"\nThe prompt: record {record['id']}, {len(record['history'])} utterances of history, "
        f"query Q{record['query_turn']}: {record['query']!r}"
    )
    print_fn(
        f"H* = {record['recall']}, A* = {record['answer']!r} (the reward's answer key; never in the prompt)"
    )
    scores = rollout.scores
    print_fn("\nEqs. (4)-(7): R = format + recall + answer for each completion")
    print_fn(f"{'k':>2}  {'format':>6}  {'recall':>7}  {'answer':>7}  {'R':>7}  completion (shortened)")
    for k, (score, text) in enumerate(zip(scores, rollout.texts), 1):
        print_fn(
            f"{k:>2}  {score['format']:>6.2f}  {score['recall']:>7.4f}  {score['answer']:>7.4f}  "
            f"{score['total']:>7.4f}  {shorten(text)!r}"
        )

    # Eq. (8): the group's mean and population std, and each completion's advantage.
    rewards = rollout.rewards("total")[0]
    mean, std = rewards.mean().item(), rewards.std(unbiased=False).item()
    advantages = grpo.group_advantages(rewards.view(1, K), scale=cfg.scale_rewards)[0]
    print_fn(f"\nEq. (8): mean R = {mean:.4f}, std R = {std:.4f} (population: divide by K)")
    # --scale-rewards none (Dr. GRPO) keeps R - mean; batch is group here: one group is the batch
    formula = "A~ = R - mean (no std)" if cfg.scale_rewards == "none" else "A~ = (R - mean) / (std + 1e-8)"
    print_fn(f"{'k':>2}  {'R - mean':>9}  {formula:>31}")
    for k in range(K):
        print_fn(f"{k + 1:>2}  {rewards[k].item() - mean:>9.4f}  {advantages[k].item():>31.4f}")
    if cfg.credit == "segment":
        print_fn(
            "(--credit segment: the think tokens take the advantage of format + recall, the answer "
            "tokens that of format + answer; the table shows Eq. (8) on R)"
        )

    # pi_old (the policy before the step) and pi_ref (--model, frozen) on the sampled tokens.
    rows = torch.arange(K, device=device)
    logprobs_of = grpo.token_logprobs_of(policy, policy, rollout, cfg, autocast_dtype)  # the update's path
    policy.train()
    with torch.no_grad():
        old_logprobs, ref_logprobs = logprobs_of(policy, rows).logprobs, logprobs_of(ref_model, rows).logprobs

    # The update of grpo_step, on these samples.
    result = grpo.grpo_step(
        policy,
        ref_model,
        tokenizer,
        optimizer,
        [record],
        [prompt],
        cfg,
        reward_fn=reward_fn,
        autocast_dtype=autocast_dtype,
        batch=rollout,
    )
    minibatches = min(cfg.sample_ratio, K)
    print_fn(
        f"\nThe update: {K} completions in {minibatches} minibatch(es) (--sample-ratio), mu = {cfg.mu} "
        f"pass(es): {result['updates']} AdamW step(s), mean loss {result['loss']:.6f}, "
        f"mean gradient norm {result['grad_norm']:.4f} (clipped at {cfg.max_grad_norm})"
    )

    # Eq. (9) after the update, what a further pass over these samples computes: grpo_loss with the
    # arguments the update gives it (its advantages, --clip-eps, --beta, --loss-type and the truncated
    # importance weights), on the group at once.
    policy.train()
    with torch.no_grad():
        new_logprobs = logprobs_of(policy, rows).logprobs
    policy.eval()
    mask = rollout.policy_mask.to(device).float()
    sampler = None if rollout.sampler_logprobs is None else rollout.sampler_logprobs.to(device)
    is_weights = grpo.truncated_is_weights(old_logprobs, sampler, cfg.is_cap)
    token_advantages = grpo.rollout_advantages(rollout, tokenizer, cfg, device)
    with torch.no_grad():
        loss, _, terms = grpo.grpo_loss(
            logprobs=new_logprobs,
            old_logprobs=old_logprobs,
            ref_logprobs=ref_logprobs,
            advantages=token_advantages,
            mask=mask,
            clip_eps=eps,
            beta=beta,
            loss_type=cfg.loss_type,
            max_completion_length=cfg.max_new_tokens,
            is_weights=is_weights,
            return_terms=True,
        )
    loss = loss.item()
    ratio, clipped, kl = terms["ratio"], terms["clipped"], terms["kl"]
    # w * min(r A~, clip(r) A~): grpo_loss's term before its KL, for the table's surrogate column
    surrogate = terms["objective"] + beta * kl
    share = (terms["objective"] * terms["weight"]).sum(1)  # each completion's part of -loss
    tokens = mask.sum(1).clamp(min=1)

    def token_means(x):  # over each completion's policy tokens, the tokens Eq. (9) averages
        return (torch.where(mask > 0, x.float(), 0.0).sum(1) / tokens).tolist()

    means = {
        "ratio": token_means(ratio),
        "clip_fraction": token_means(clipped),
        "is_weight": token_means(terms["is_weight"]),
        "kl": token_means(kl),
        "surrogate": token_means(surrogate),
        "objective": token_means(terms["objective"]),
    }
    after = []
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
    for k in range(K):
        row = {"tokens": int(mask[k].sum().item()), **{name: values[k] for name, values in means.items()}}
        row["kl_term"] = beta * row["kl"]
        row["kl_share"] = row["kl_term"] / (abs(row["surrogate"]) + row["kl_term"] or 1.0)
        row["of_loss"] = share[k].item()
        after.append(row)
        print_fn(
            f"{k + 1:>2}  {row['tokens']:>6}  {row['ratio']:>9.6f}  {row['clip_fraction']:>7.1%}  "
            f"{row['is_weight']:>9.6f}  {row['kl']:>9.2e}  {row['surrogate']:>10.6f}  "
            f"{row['kl_term']:>9.2e}  {row['kl_share']:>8.1%}  {row['of_loss']:>10.6f}"
        )
    print_fn(
        f"Eq. (9) on this group now, grpo_loss (--loss-type {cfg.loss_type}: {LOSS_TYPES[cfg.loss_type]}) "
        f"= -sum of the last column = {loss:.6f}"
    )
    print_fn(f"Each token's weight under --loss-type {cfg.loss_type} (--scale-rewards {cfg.scale_rewards}):")
    for k in range(K):
        weight = terms["weight"][k][mask[k] > 0]
        shown = f"{weight[0].item():.6g}" if len(weight) else "(no policy token)"
        formula = token_weight_formula(cfg.loss_type, mask, k, cfg.max_new_tokens)
        print_fn(f"  completion {k + 1}: {formula} = {shown}")

    # Every token of every completion, as the page shows it: the pieces join to the reward's text.
    lengths = rollout.completion_mask.sum(1).tolist()
    per_token = []
    for k, n in enumerate(lengths):
        pieces, marks = token_pieces(tokenizer, rollout.completion_ids[k, :n].tolist())
        per_token.append(
            {
                "text": pieces,
                "marks": marks,
                "new_logprobs": new_logprobs[k, :n].tolist(),
                "old_logprobs": old_logprobs[k, :n].tolist(),
                "ref_logprobs": ref_logprobs[k, :n].tolist(),
                "ratio": ratio[k, :n].tolist(),
                "is_weight": terms["is_weight"][k, :n].tolist(),
                "kl": kl[k, :n].tolist(),
                "clipped": clipped[k, :n].tolist(),
                "objective": terms["objective"][k, :n].tolist(),
                "weight": terms["weight"][k, :n].tolist(),
                "policy_mask": [int(x) for x in rollout.policy_mask[k, :n].tolist()],
            }
        )

    # Eq. (9) for one token, by hand from grpo_loss's ratio, weight and KL: the min() of the clipped
    # surrogate, and the token's term, which is grpo_loss's own.
    A = token_advantages.unsqueeze(1) if token_advantages.dim() == 1 else token_advantages
    k, t, why = worked_token(ratio, A, clipped, mask)
    at, r, a = (k, t), ratio[k, t], A[k, t] if A.shape[1] > 1 else A[k, 0]
    clip_r = torch.clamp(r, 1 - eps, 1 + eps)
    worked = {
        "k": k + 1,
        "t": t + 1,
        "new": new_logprobs[at].item(),
        "old": old_logprobs[at].item(),
        "ref": ref_logprobs[at].item(),
        "sampler": None if sampler is None else sampler[at].item(),
        "log_ratio": (new_logprobs - old_logprobs)[at].item(),
        "ratio": r.item(),
        "advantage": a.item(),
        "unclipped": (r * a).item(),
        "clip_ratio": clip_r.item(),
        "clipped_term": (clip_r * a).item(),
        "surrogate": torch.min(r * a, clip_r * a).item(),
        "clipped": bool(clipped[at].item()),
        "is_weight": terms["is_weight"][at].item(),
        "ref_minus_new": (ref_logprobs - new_logprobs)[at].item(),
        "kl": kl[at].item(),
        "term": terms["objective"][at].item(),
        "weight": terms["weight"][at].item(),
    }
    w = worked
    print_fn(
        f"\nEq. (9) for one token, written out: completion {w['k']}, token {w['t']} of {lengths[k]}, "
        f"{per_token[k]['text'][t]!r} ({why})"
    )
    print_fn(
        f"  log pi_theta = {w['new']:.9g} (after the update), log pi_old = {w['old']:.9g} (before it), "
        f"log pi_ref = {w['ref']:.9g}"
    )
    print_fn(f"  r = exp(log pi_theta - log pi_old) = exp({w['log_ratio']:.9g}) = {w['ratio']:.9g}")
    whose = "this token's segment" if A.shape[1] > 1 else f"completion {w['k']}'s"
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
    if is_weights is None:
        print_fn(f"  w = 1: no importance weight (--is-cap {cfg.is_cap:g}, or no sampler log-probs)")
    else:  # the tokens came from pi_sampler; Eq. (9)'s expectation is over pi_old
        print_fn(
            f"  w = min(pi_old / pi_sampler, {cfg.is_cap:g}) = min(exp({w['old'] - w['sampler']:.9g}), "
            f"{cfg.is_cap:g}) = {w['is_weight']:.9g} (--is-cap; log pi_sampler = {w['sampler']:.9g}, 1 up to "
            "rounding where the sampler is the policy)"
        )
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
        f"{token_weight_formula(cfg.loss_type, mask, k, cfg.max_new_tokens)} = {w['weight']:.9g}; "
        f"term * weight = {w['term'] * w['weight']:.9g}, its part of -loss"
    )

    step = {
        "title": f"One GRPO step on one group of K = {K}: {cfg.model}",
        "settings": [
            ("model", cfg.model),
            ("K", K),
            ("lr", f"{lr:g} (step 1 of the warm-up)"),
            ("beta", beta),
            ("clip eps", eps),
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
        "clip_eps": eps,
        "beta": beta,
        "mean": mean,
        "std": std,
        "update": {"loss": result["loss"], "grad_norm": result["grad_norm"], "updates": result["updates"]},
        "completions": [
            {
                "k": k + 1,
                **{key: float(scores[k][key]) for key in ("format", "recall", "answer", "total")},
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
    page = write_step_page(cfg.explain_html, step)
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
