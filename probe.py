"""Greedy probes of a policy on held-out records, and the reward statistics GRPO logs.

A library module: the caller passes the prompts (fitted by stage0's fit_prompt) and the reward
function (reward.compute_rewards, or a toy one in tests), so nothing here imports a stage.
"""
from __future__ import annotations

import math
import random
import time

import numpy as np
from tqdm.auto import tqdm

from data_io import finite_or_none
from modeling import generate

REWARD_COMPONENTS = ("format", "recall", "answer", "total")


def greedy_probe(model, tokenizer, records, prompts, reward_fn, max_new_tokens=160, batch_size=8,
                 autocast_dtype=None, progress=True) -> dict:
    """Greedy completions of `prompts` (one per record; None = skipped, too long) -> the mean of
    every reward component and of the recall Jaccard, the number scored and skipped, 3 examples."""
    start = time.perf_counter()
    kept = sorted(((r, p) for r, p in zip(records, prompts) if p is not None), key=lambda rp: len(rp[1]))
    completions, examples = [], []  # sorted by length: similar lengths batch with less padding
    for i in tqdm(range(0, len(kept), batch_size), desc="eval", disable=not progress, leave=False):
        batch = kept[i:i + batch_size]
        out = generate(model, tokenizer, [p for _, p in batch], max_new_tokens=max_new_tokens, greedy=True,
                       autocast_dtype=autocast_dtype)
        completions += out["texts"]
        examples += [r for r, _ in batch]
    scores = reward_fn(completions, examples) if completions else []
    result = {"n": len(scores), "skipped": len(records) - len(kept)}
    for key in REWARD_COMPONENTS + ("jaccard",):
        values = [float(s[key]) for s in scores if key in s]
        result[key] = float(np.mean(values)) if values else float("nan")
    result["seconds"] = time.perf_counter() - start
    result["examples"] = [{"id": r["id"], "completion": c, **{k: s.get(k) for k in REWARD_COMPONENTS}}
                          for r, c, s in list(zip(examples, completions, scores))[:3]]
    return result


def pick_eval_records(records, limit):
    """A fixed sample (seed 0, whatever --seed): runs with different seeds compare on the same set."""
    if limit >= len(records):
        return records
    return [records[i] for i in sorted(random.Random(0).sample(range(len(records)), limit))]


def reward_metrics(scores) -> dict:
    """Mean and std of every reward component over all completions of the step, and mean Jaccard."""
    metrics = {}
    for key in REWARD_COMPONENTS:
        values = np.array([float(s[key]) for s in scores if key in s], dtype=np.float64)
        if len(values):
            metrics[f"reward_{key}_mean"], metrics[f"reward_{key}_std"] = float(values.mean()), float(values.std())
    jaccard = [float(s["jaccard"]) for s in scores if "jaccard" in s]
    if jaccard:
        metrics["recall_jaccard_mean"] = float(np.mean(jaccard))
    return metrics


def sample_lines(step, result, K) -> list[dict]:
    """The best and the worst completion of the first group: what the policy writes, and what the
    reward prefers."""
    def total(i):  # NaN (a broken reward) sorts lowest
        value = float(result["scores"][i]["total"])
        return value if math.isfinite(value) else -math.inf
    group = sorted(range(min(K, len(result["texts"]))), key=total)
    picks = dict.fromkeys([group[-1], group[0]]) if group else {}
    lines = []
    for i in picks:
        record, score = result["records"][i], result["scores"][i]
        lines.append({"step": step, "id": record["id"], "query": record["query"], "gold_recall": record["recall"],
                      "gold_answer": record["answer"], "completion": result["texts"][i],
                      **{k: finite_or_none(v) for k, v in score.items() if isinstance(v, (int, float, str, list))}})
    return lines
