"""Greedy probes of a policy on held-out records, and the reward statistics GRPO logs.

A library module: the caller passes the prompts (fitted by srt/prompt.py's fit_prompt) and the reward
function (reward.compute_rewards, or a toy one in tests): the package imports no script.
"""

from __future__ import annotations

import math
import random
import sys
import time
from dataclasses import dataclass, field, fields, replace
from pathlib import Path

import numpy as np
from tqdm.auto import tqdm

from srt.config import MAX_NEW_TOKENS, at_least, up_to
from srt.data_io import data_paths, finite_or_none, write_json
from srt.distributed import full_weights, gather_objects
from srt.generation import generate
from srt.metrics import answer_text, f1_score
from srt.prompt import fit_prompt

REWARD_COMPONENTS = ("format", "recall", "answer", "total")
# What the learning curve follows: recall Jaccard on the queries that need recall (an empty H*
# would score 1.0 for silence), answer F1 against the reference, and the reward.
PROBE_KEYS = ("jaccard_needed", "f1", "format", "recall", "answer", "total")


def greedy_probe(
    model,
    tokenizer,
    records,
    prompts,
    reward_fn,
    max_new_tokens=160,
    batch_size=8,
    autocast_dtype=None,
    progress=True,
    recall="free",
) -> dict:
    """Greedy completions of `prompts` (one per record; None = skipped, too long) -> the mean of
    every reward component and of the recall Jaccard, the number scored and skipped, 3 examples.
    recall: "copy" lets the decoder write the turns the tags name (srt/recall.py)."""
    start = time.perf_counter()
    kept = sorted(((r, p) for r, p in zip(records, prompts) if p is not None), key=lambda rp: len(rp[1]))
    completions, examples = [], []  # sorted by length: similar lengths batch with less padding
    for i in tqdm(range(0, len(kept), batch_size), desc="eval", disable=not progress, leave=False):
        batch = kept[i : i + batch_size]
        out = generate(
            model,
            tokenizer,
            [p for _, p in batch],
            max_new_tokens=max_new_tokens,
            greedy=True,
            autocast_dtype=autocast_dtype,
            recall=recall,
        )
        completions += out["texts"]
        examples += [r for r, _ in batch]
    scores = reward_fn(completions, examples) if completions else []
    needed = [float(s["jaccard"]) for s, r in zip(scores, examples) if r["recall"] and "jaccard" in s]
    f1 = [f1_score(answer_text(c) or "", r["answer"]) for c, r in zip(completions, examples)]
    result = {
        "n": len(scores),
        "skipped": len(records) - len(kept),
        "n_needed": len(needed),
        "jaccard_needed": float(np.mean(needed)) if needed else float("nan"),
        "f1": float(np.mean(f1)) if f1 else float("nan"),
    }
    for key in REWARD_COMPONENTS + ("jaccard",):
        values = [float(s[key]) for s in scores if key in s]
        result[key] = float(np.mean(values)) if values else float("nan")
    result["seconds"] = time.perf_counter() - start
    result["examples"] = [
        {"id": r["id"], "completion": c, **{k: s.get(k) for k in REWARD_COMPONENTS}}
        for r, c, s in list(zip(examples, completions, scores))[:3]
    ]
    return result


def pick_eval_records(records, limit):
    """A fixed sample stratified by length bucket (seed 0, whatever --seed, so runs with different
    seeds compare on the same set): the buckets take turns until `limit` records are chosen."""
    if limit >= len(records):
        return records
    rng, by_bucket = random.Random(0), {}
    for i, record in enumerate(records):
        by_bucket.setdefault(record["meta"].get("bucket", 0), []).append(i)
    queues = [rng.sample(indices, len(indices)) for _, indices in sorted(by_bucket.items())]
    chosen = []
    while len(chosen) < limit:
        chosen += [queue.pop() for queue in queues if queue][: limit - len(chosen)]
    return [records[i] for i in sorted(chosen)]


def reward_metrics(scores) -> dict:
    """Mean and std of every reward component over all completions of the step, and mean Jaccard."""
    metrics = {}
    for key in REWARD_COMPONENTS:
        values = np.array([float(s[key]) for s in scores if key in s], dtype=np.float64)
        if len(values):
            metrics[f"reward_{key}_mean"], metrics[f"reward_{key}_std"] = (
                float(values.mean()),
                float(values.std()),
            )
    jaccard = [float(s["jaccard"]) for s in scores if "jaccard" in s]
    if jaccard:
        metrics["recall_jaccard_mean"] = float(np.mean(jaccard))
    return metrics


def over_ranks(how: str, default=float("nan")):
    """A StepStats field and how step_metrics merges the ranks' values of it: mean, sum or first
    (the same on every rank)."""
    return field(default=default, metadata={"over_ranks": how})


@dataclass
class StepStats:
    """What one GRPO step reports (stage2_grpo.grpo_step), one per rank: its samples with their
    reward terms, and its statistics, each field saying how metrics.jsonl merges the ranks."""

    scores: list  # each completion's reward terms, Eqs. (4)-(7)
    texts: list  # the completions
    records: list  # each completion's record
    loss: float = over_ranks("mean")  # Eq. (9), mean over the step's optimizer steps
    kl: float = over_ranks("mean")  # token mean of k3 to pi_ref
    clip_fraction: float = over_ranks("mean")  # share of tokens whose ratio the clip held
    ratio: float = over_ranks("mean")  # token mean of pi_theta / pi_old
    ratio_std: float = over_ranks("mean")  # its token std in an optimizer step, mean over steps
    entropy: float = over_ranks("mean")  # token mean, first pass
    grad_norm: float = over_ranks("mean")  # before clipping
    sampler_log_ratio: float = over_ranks("mean")  # log pi_old - log pi_sampler
    sampler_kl: float = over_ranks("mean")
    is_capped_fraction: float = over_ranks("mean")  # tokens whose importance weight the cap held
    completion_length: float = over_ranks("mean")  # tokens a completion
    copied_length: float = over_ranks("mean")  # of which --recall copy wrote
    generate_s: float = over_ranks("mean")
    score_s: float = over_ranks("mean")
    train_s: float = over_ranks("mean")
    draws: float = over_ranks("mean")  # sample batches drawn (--dynamic-sampling)
    skipped_updates: int = over_ranks("sum", 0)  # non-finite loss or gradient
    updates: int = over_ranks("first", 0)  # optimizer steps taken
    completion_tokens: int = over_ranks("sum", 0)
    sequence_tokens: int = over_ranks("sum", 0)
    groups_drawn: int = over_ranks("sum", 0)
    groups_all_equal: int = over_ranks("sum", 0)  # advantage 0 (Eq. (8))
    groups_recall_constant: int = over_ranks("sum", 0)

    def without_samples(self) -> StepStats:
        """The statistics alone, what the ranks gather (the texts stay on their rank)."""
        return replace(self, texts=[], records=[])


def step_metrics(step, results: list[StepStats], step_s, **extra) -> dict:
    """One metrics.jsonl line from every rank's StepStats: the reward components over all
    completions, each field merged as it says, throughput, and the share of groups whose rewards
    were all equal (no gradient) or whose recall part was constant."""
    line = {"step": step, **reward_metrics([s for r in results for s in r.scores])}
    for stat in fields(StepStats):
        values = [getattr(r, stat.name) for r in results]
        how = stat.metadata.get("over_ranks")
        if how == "mean":
            line[stat.name] = float(np.nanmean(values)) if not all(map(math.isnan, values)) else float("nan")
        elif how == "sum":
            line[stat.name] = sum(values)
        elif how == "first":
            line[stat.name] = values[0]
    generate_s = max(line["generate_s"], 1e-9)
    return {
        **line,
        "tokens_per_s": line["sequence_tokens"] / step_s,
        "generated_tokens_per_s": line["completion_tokens"] / generate_s,
        "groups_all_equal_share": line["groups_all_equal"] / line["groups_drawn"],
        "groups_recall_constant_share": line["groups_recall_constant"] / line["groups_drawn"],
        "step_s": step_s,
        **extra,
    }


def sample_lines(step, result, K) -> list[dict]:
    """The best and the worst completion of the first group: what the policy writes, and what the
    reward prefers."""

    def total(i):  # NaN (a broken reward) sorts lowest
        value = float(result.scores[i]["total"])
        return value if math.isfinite(value) else -math.inf

    group = sorted(range(min(K, len(result.texts))), key=total)
    picks = dict.fromkeys([group[-1], group[0]]) if group else {}
    lines = []
    for i in picks:
        record, score = result.records[i], result.scores[i]
        lines.append(
            {
                "step": step,
                "id": record["id"],
                "query": record["query"],
                "gold_recall": record["recall"],
                "gold_answer": record["answer"],
                "completion": result.texts[i],
                **{k: finite_or_none(v) for k, v in score.items() if isinstance(v, (int, float, str, list))},
            }
        )
    return lines


def plot_learning_curve(metrics, probes, path) -> None:
    """learning_curve.png beside metrics.jsonl: the reward components of the sampled groups (mean and
    spread), the probe's recall Jaccard and F1, the KL to pi_ref and the share of informative groups,
    each against the GRPO step."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 4, figsize=(18, 3.8))
    steps = [m["step"] for m in metrics]
    for key in REWARD_COMPONENTS:
        mean = np.array([m.get(f"reward_{key}_mean") or np.nan for m in metrics], dtype=float)
        std = np.array([m.get(f"reward_{key}_std") or np.nan for m in metrics], dtype=float)
        axes[0].plot(steps, mean, label=key)
        axes[0].fill_between(steps, mean - std, mean + std, alpha=0.15)
    axes[0].set_title("reward of the sampled groups (mean, +-1 std)")
    for key, label in (("jaccard_needed", "recall Jaccard (H* non-empty)"), ("f1", "answer F1")):
        axes[1].plot([p["step"] for p in probes], [p.get(key) for p in probes], marker="o", label=label)
    axes[1].set_title("greedy probe on held-out queries")
    axes[2].plot(steps, [m.get("kl") for m in metrics])
    axes[2].set_title("KL(pi_theta || pi_ref), k3")
    axes[3].plot(steps, [1 - (m.get("groups_all_equal_share") or 0) for m in metrics], label="total reward")
    axes[3].plot(
        steps, [1 - (m.get("groups_recall_constant_share") or 0) for m in metrics], label="recall part"
    )
    axes[3].set_title("share of groups whose rewards differ")
    for ax in axes:
        ax.set_xlabel("GRPO step")
        if ax.get_legend_handles_labels()[0]:
            ax.legend(fontsize=8)
    fig.tight_layout()
    tmp = Path(path).with_suffix(".tmp.png")
    fig.savefig(tmp, dpi=110)
    plt.close(fig)
    tmp.replace(path)


def evaluate_policy(
    model,
    tokenizer,
    records,
    reward_fn,
    max_new_tokens=160,
    batch_size=8,
    max_prompt_length=None,
    autocast_dtype=None,
    progress=True,
    recall="free",
) -> dict:
    """Stage 2's before / after check (evaluate.py does the full §4): mean reward components and
    recall Jaccard of greedy completions, on prompts fitted the way GRPO fits them (oldest turns
    first; a gold turn cut is counted), decoded in `recall` mode. `reward_fn`: stage 2 passes
    reward.compute_rewards."""
    fitted = [fit_prompt(tokenizer, r, max_prompt_length) for r in records]
    result = greedy_probe(
        model,
        tokenizer,
        records,
        [p for p, _ in fitted],
        reward_fn,
        max_new_tokens,
        batch_size,
        autocast_dtype,
        progress,
        recall,
    )
    return dict(result, gold_turns_cut=sum(cut for _, cut in fitted))


def merge_probes(results: list[dict]) -> dict:
    """Greedy probes (probe.greedy_probe) of the ranks' slices of the held-out records -> one, as if
    a single process had run them all: counts summed, means weighted by the records scored, the
    slowest rank's seconds, the first examples."""
    n = sum(r["n"] for r in results)
    merged = {}
    for key, value in results[0].items():
        values = [r[key] for r in results]
        if key == "seconds":
            merged[key] = max(values)
        elif isinstance(value, list):
            merged[key] = [x for v in values for x in v][:3]
        elif isinstance(value, int):
            merged[key] = sum(values)
        else:
            weight = "n_needed" if key == "jaccard_needed" else "n"  # its mean is over queries with H* only
            scored = [(v, r[weight]) for v, r in zip(values, results) if r[weight] and not math.isnan(v)]
            merged[key] = (
                sum(v * k for v, k in scored) / sum(k for _, k in scored) if scored else float("nan")
            )
    merged["n"] = n
    return merged


def probe_and_log(run, policy, tokenizer, records, cfg, reward_fn, step, metrics, probes, name=None) -> dict:
    """One greedy probe during a GRPO run (srt/run.py's `run`): each rank its slice of `records`,
    the weights gathered once (FSDP); rank 0 appends the means to probe.jsonl, redraws
    learning_curve.png beside the `metrics` log and, with `name`, writes eval_before.json or
    eval_after.json. -> the merged result."""
    with full_weights(policy):
        mine = evaluate_policy(
            policy,
            tokenizer,
            records[run.rank :: run.world_size],
            reward_fn,
            cfg.eval_max_new_tokens,
            cfg.eval_batch_size,
            max_prompt_length=cfg.max_prompt_length,
            autocast_dtype=run.autocast_dtype,
            progress=run.main_process,
            recall=cfg.recall,
        )
    merged = merge_probes(gather_objects(mine, run.world_size))
    result = {k: finite_or_none(v) for k, v in merged.items()}
    if run.main_process:
        probes.append({"step": step, **{k: v for k, v in result.items() if k != "examples"}})
        plot_learning_curve(metrics.rows, probes.rows, run.out / "learning_curve.png")
        if name:
            write_json(run.out / name, result)
        tqdm.write(f"probe at step {step}: " + ", ".join(f"{k} {result[k]}" for k in PROBE_KEYS))
    return result


def add_eval_flags(group, *, data, data_help, limit, limit_help, max_new_tokens) -> None:
    """--eval-data, --eval-limit and --eval-max-new-tokens: the held-out records a training run
    answers greedily (stage 1 once at the end, stage 2 in its probes), with each stage's defaults."""
    add = group.add_argument
    add("--eval-data", default=data, help=data_help)
    add("--eval-limit", type=at_least(0), default=limit, help=limit_help)
    add(
        "--eval-max-new-tokens",
        type=up_to(MAX_NEW_TOKENS),
        default=max_new_tokens,
        help="tokens per held-out completion"
        + (" (default: --max-new-tokens)" if max_new_tokens is None else ""),
    )


def add_probe_flags(group) -> None:
    """Stage 2's probe flags, in its logging group: what probe_and_log reads."""
    add_eval_flags(
        group,
        data=None,
        data_help="held-out records for the greedy probe; a bare file name (the CPU presets: dev.jsonl) is "
        "looked up beside --data's first file, and the probe skipped where there is none",
        limit=40,
        limit_help="probe this many records, stratified by bucket; 0 = none",
        max_new_tokens=None,
    )
    add = group.add_argument
    add(
        "--probe-every",
        type=at_least(0),
        default=0,
        help="probe also every N steps (0: before and after only)",
    )
    add("--eval-batch-size", type=at_least(1), default=8, help="greedy evaluation batch")


def resolve_probe_flags(cfg) -> None:
    """--eval-data given as a bare file name (the CPU presets' dev.jsonl) names the file beside --data's
    first file, else one in the current folder; where neither exists the run has no probe, and says so.
    --eval-max-new-tokens defaults to --max-new-tokens."""
    if cfg.eval_data and "/" not in cfg.eval_data:
        beside = Path(data_paths(cfg.data)[0]).parent / cfg.eval_data
        if beside.exists():
            cfg.eval_data = str(beside)
        elif not Path(cfg.eval_data).exists():
            print(f"note: no {cfg.eval_data} beside {data_paths(cfg.data)[0]}: no probe", file=sys.stderr)
            cfg.eval_data = None
    cfg.eval_max_new_tokens = cfg.eval_max_new_tokens or cfg.max_new_tokens
