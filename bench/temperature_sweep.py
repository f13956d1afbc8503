"""The sampling temperature of GRPO as a measured choice: for each T, K samples on the same dev
prompts from the SFT policy, scored with the verifiable reward (Eqs. (4)-(7)), reporting

- the mean per-token entropy of softmax(logits / T) along the sampled completions (how much the
  policy explores),
- the share of informative groups: groups whose K totals are not all equal (Eq. (8) gives the
  others advantage 0) and, the stricter measure stage 2's `--dynamic-sampling recall` uses, groups
  whose recall parts differ (a recall signal),
- the mean reward components and the format-valid share (what too hot a T breaks),
- mean completion length and the share that hit the token cap,
- exploration against K: over the prompts that need recall, the share of groups whose first k
  samples differ in recall (informative) and the share where one of them recalls H* exactly, for
  k = 1, 2, 4, ... K: what a larger K buys before any training.

Prompts: the stratified draw of stage 2's probe (probe.pick_eval_records, seed 0) from --data, rendered
as stage 2 renders them (srt.rollouts.PromptStream's fit); the same prompts and seed for every T.

    python bench/temperature_sweep.py --model runs/demo/sft/final --data runs/data/dev.jsonl
    python bench/temperature_sweep.py --model tiny-random --synthetic 20 --prompts 2 --temperatures 0.7,1.0 \\
        --max-new-tokens 8

Writes <out>/results.json and <out>/results.md (default runs/bench/temperature_sweep).
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

BENCH = Path(__file__).resolve().parent
ROOT = BENCH.parent
for _path in (str(ROOT), str(BENCH)):
    if _path not in sys.path:
        sys.path.insert(0, _path)

from measure import bench_records, machine, machine_line, write_results  # noqa: E402


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0], formatter_class=argparse.ArgumentDefaultsHelpFormatter
    )
    p.add_argument("--model", default="runs/demo/sft/final", help="the SFT policy GRPO starts from")
    p.add_argument("--data", default="runs/data/dev.jsonl", help="stage-0 JSONL (dev: never test)")
    p.add_argument(
        "--synthetic", type=int, default=0, help="build this many synthetic dialogues instead of --data"
    )
    p.add_argument("--temperatures", default="0.7,1.0,1.3", help="comma-separated T values")
    p.add_argument("--prompts", type=int, default=16, help="dev prompts (groups) per temperature")
    p.add_argument("-K", "--num-generations", type=int, default=4, help="samples per prompt (stage 2's K)")
    p.add_argument("--max-new-tokens", type=int, default=256, help="as stage 2's cpu-demo preset")
    p.add_argument("--max-prompt-length", type=int, default=1536, help="as stage 2's cpu-demo preset")
    p.add_argument("--batch-prompts", type=int, default=4, help="prompts per generate call")
    p.add_argument("--answer-reward", choices=["cosine", "keys", "both"], default="cosine")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", default="runs/bench/temperature_sweep")
    return p


def mean_component(scores: list[dict], key: str) -> float:
    """The mean of one reward component (or the Jaccard) over the scored samples."""
    return statistics.fmean(float(s[key]) for s in scores)


def exploration_at_k(scores, needs_recall, K) -> dict:
    """{k: (informative share, hit share)} over the groups whose query needs recall, for k = 1, 2, 4, ...
    K. Informative: the first k samples' recall parts are not all equal (--dynamic-sampling recall
    keeps the group); hit: one of them recalls exactly H* (Jaccard 1)."""
    ks = sorted({2**i for i in range(K.bit_length()) if 2**i <= K} | {K})
    groups = [scores[g : g + K] for g, needs in zip(range(0, len(scores), K), needs_recall) if needs]
    if not groups:
        return {}
    return {
        k: (
            statistics.fmean(len({float(s["recall"]) for s in group[:k]}) > 1 for group in groups),
            statistics.fmean(any(float(s["jaccard"]) == 1.0 for s in group[:k]) for group in groups),
        )
        for k in ks
    }


def main(argv=None) -> None:
    args = build_parser().parse_args(argv)
    import torch
    from tqdm import tqdm

    import reward
    from srt import modeling
    from srt.probe import pick_eval_records
    from srt.prompt import fit_prompt
    from srt.rollouts import constant_groups

    try:
        temperatures = [float(t) for t in args.temperatures.split(",") if t.strip()]
    except ValueError:
        sys.exit(f"error: --temperatures {args.temperatures!r}: use numbers separated by commas")
    model, tokenizer = modeling.load_model_and_tokenizer(args.model, dtype="float32")
    records = bench_records(args.data, args.synthetic, "dev")
    pairs = []
    for record in pick_eval_records(records, args.prompts * 2):
        prompt, _ = fit_prompt(tokenizer, record, args.max_prompt_length)
        if prompt is not None:
            pairs.append((record, prompt))
    pairs = pairs[: args.prompts]
    if not pairs:
        sys.exit(f"error: no prompt of {args.data} fits --max-prompt-length {args.max_prompt_length}")
    K = args.num_generations
    needs_recall = [bool(record["recall"]) for record, _ in pairs]  # H* read for scoring, never shown

    rows = []
    for T in temperatures:
        torch.manual_seed(args.seed)
        scores, entropies, lengths, capped, start = [], [], [], 0, time.perf_counter()
        for i in tqdm(range(0, len(pairs), args.batch_prompts), desc=f"T={T}", unit="batch", leave=False):
            chunk = pairs[i : i + args.batch_prompts]
            out = modeling.generate(
                model,
                tokenizer,
                [p for _, p in chunk],
                max_new_tokens=args.max_new_tokens,
                num_generations=K,
                temperature=T,
            )
            examples = [record for record, _ in chunk for _ in range(K)]
            scores += reward.compute_rewards(out["texts"], examples, args.answer_reward)
            ids = torch.cat([out["prompt_ids"], out["completion_ids"]], dim=1)
            mask = torch.cat([out["prompt_mask"], out["completion_mask"]], dim=1)
            C = out["completion_ids"].shape[1]
            with torch.no_grad():
                logits = model(
                    input_ids=ids,
                    attention_mask=mask,
                    position_ids=(mask.cumsum(-1) - 1).clamp(min=0),
                    use_cache=False,
                    logits_to_keep=C + 1,
                ).logits
                _, entropy = modeling.token_logprobs(
                    logits[:, :-1], out["completion_ids"], T, with_entropy=True
                )
            cmask = out["completion_mask"].float()
            entropies.append(float((entropy * cmask).sum()))
            lengths += cmask.sum(1).tolist()
            capped += sum(int(n) >= args.max_new_tokens for n in cmask.sum(1).tolist())
        tokens = sum(lengths)
        rows.append(
            {
                "temperature": T,
                "groups": len(pairs),
                "entropy_per_token": sum(entropies) / max(tokens, 1),
                "informative_total": 1 - statistics.fmean(constant_groups(scores, K)),
                "informative_recall": 1 - statistics.fmean(constant_groups(scores, K, "recall")),
                "format": mean_component(scores, "format"),
                "recall": mean_component(scores, "recall"),
                "answer": mean_component(scores, "answer"),
                "total": mean_component(scores, "total"),
                "jaccard": mean_component(scores, "jaccard"),
                "format_valid": statistics.fmean(float(s["format"]) > 0 for s in scores),
                "mean_length": statistics.fmean(lengths),
                "capped": capped / len(lengths),
                "seconds": time.perf_counter() - start,
                "exploration": {str(k): v for k, v in exploration_at_k(scores, needs_recall, K).items()},
                "groups_needing_recall": sum(needs_recall),
            }
        )
        r = rows[-1]
        print(
            f"T={T}: entropy {r['entropy_per_token']:.3f}, informative total {r['informative_total']:.0%}, "
            f"recall {r['informative_recall']:.0%}, reward {r['total']:.2f}, "
            f"format valid {r['format_valid']:.0%}",
            flush=True,
        )

    results = {"machine": machine(), "config": vars(args), "rows": rows}
    lines = [
        "# GRPO sampling temperature on dev prompts\n",
        machine_line(results["machine"]) + "\n",
        f"Policy `{args.model}`, {len(pairs)} stratified prompts of "
        f"`{'synthetic' if args.synthetic else args.data}` x K = {K}, up to "
        f"{args.max_new_tokens} new tokens, answer reward {args.answer_reward}, seed {args.seed}.\n",
        "| T | entropy / token (nats) | informative groups: total differs | recall differs | "
        "format valid | R_format | R_recall | R_answer | R total | Jaccard | mean length | hit cap |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        lines.append(
            f"| {r['temperature']:g} | {r['entropy_per_token']:.3f} | {r['informative_total']:.0%} | "
            f"{r['informative_recall']:.0%} | {r['format_valid']:.0%} | {r['format']:.2f} | "
            f"{r['recall']:.2f} | {r['answer']:.2f} | {r['total']:.2f} | {r['jaccard']:.2f} | "
            f"{r['mean_length']:.0f} | {r['capped']:.0%} |"
        )
    if rows[0]["exploration"]:
        lines += [
            "",
            f"Exploration on the groups that need recall ({rows[0]['groups_needing_recall']}): "
            "share informative (recall parts differ) / share where a sample recalls exactly H*, "
            "using the first k samples.\n",
            "| T | " + " | ".join(f"k = {k}" for k in rows[0]["exploration"]) + " |",
            "|---|" + "---|" * len(rows[0]["exploration"]),
        ]
        lines += [
            f"| {r['temperature']:g} | "
            + " | ".join(f"{inf:.0%} / {hit:.0%}" for inf, hit in r["exploration"].values())
            + " |"
            for r in rows
        ]
    write_results(Path(args.out), "results", results, "\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
