"""Benchmark: how far the rollout sampler is from GRPO's pi_old, and what stage 2 logs of it.

Where the hardware has bf16 units (a GPU, a CPU with AMX or AVX512-BF16), stage 2 samples its
rollouts on a bf16 copy of the policy (srt/decode.py `sampling_model`) while pi_old and pi_theta are
the fp32 master weights under bf16 autocast. This script runs stage 2's own calls on the same
prompts, GRPO-Zero's way (rollout -> advantages -> update), once per sampler:

    fp32   the sampler is the policy itself, no autocast (a CPU without bf16 units): the gap is rounding;
    bf16   the bf16 sampling copy against the autocast trainer, forced here whatever the hardware
           (on a CPU with neither AMX nor AVX512-BF16 the bf16 products are emulated: slow, but the
           same numbers).

Per sampler it measures, over the sampled tokens, log pi_old (the update's own path,
stage2_grpo.token_logprobs) against the record's sampler_logprobs: the mean and max of
|log pi_old - log pi_sampler|, the share of tokens whose ratio lies outside [0.8, 1.2] and [0.9, 1.1],
and beside them what stage2_grpo.update logs to metrics.jsonl (sampler_log_ratio, sampler_kl,
is_capped_fraction), which must agree. The model: --model, or with --random-layers a random Llama of
that depth and --random-hidden width on the model's tokenizer, its logits scaled by --logit-scale
(a random model's logits are nearly flat; a scale sets the entropy, which sets the gap).

    python bench/sampler_mismatch.py --model tiny-random --synthetic 20 --random-layers 8 --random-hidden 256
    python bench/sampler_mismatch.py --model smollm2-135m --data runs/data/train.jsonl --steps 2

Writes <out>/results.json and <out>/results.md (default runs/bench/sampler_mismatch).
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

BENCH = Path(__file__).resolve().parent
ROOT = BENCH.parent
for _path in (str(ROOT), str(BENCH)):
    if _path not in sys.path:
        sys.path.insert(0, _path)

from measure import bench_records, check_out, machine, machine_line, markdown_table, write_results  # noqa: E402

from srt.config import at_least, positive  # noqa: E402


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="smollm2-135m", help="the policy (its tokenizer with --random-layers)")
    p.add_argument(
        "--data", default="runs/data/train.jsonl", help="stage-0 records whose prompts are sampled"
    )
    p.add_argument(
        "--synthetic", type=at_least(0), default=0, help="a fresh stage-0 corpus of N dialogues instead"
    )
    p.add_argument(
        "--random-layers", type=at_least(0), default=0, help="a random Llama of this depth (0: --model)"
    )
    p.add_argument("--random-hidden", type=at_least(8), default=256, help="its width")
    p.add_argument("--logit-scale", type=positive(float), default=1.0, help="multiply the lm_head by this")
    p.add_argument("--steps", type=at_least(1), default=3, help="rollouts (GRPO steps) per sampler")
    p.add_argument("-K", "--num-generations", type=at_least(2), default=4)
    p.add_argument("--prompts-per-step", type=at_least(1), default=1)
    p.add_argument("--max-new-tokens", type=at_least(1), default=128)
    p.add_argument("--max-prompt-length", type=at_least(0), default=1536)
    p.add_argument("--lr", type=at_least(0.0, float), default=1e-5, help="the updates between rollouts")
    p.add_argument("--seed", type=at_least(0), default=0)
    p.add_argument("--out", default="runs/bench/sampler_mismatch")
    return p


def random_llama(tokenizer, layers: int, hidden: int):
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(
        vocab_size=len(tokenizer), hidden_size=hidden, num_hidden_layers=layers,
        num_attention_heads=max(1, hidden // 64), num_key_value_heads=max(1, hidden // 128),
        intermediate_size=hidden * 4, max_position_embeddings=8192, tie_word_embeddings=False,
        bos_token_id=None, eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id,
    )  # fmt: skip
    torch.manual_seed(0)
    return LlamaForCausalLM(config)


def measure(sampler: str, args, records) -> dict:
    """`--steps` rollouts and updates with one sampler; -> the token statistics and the logged ones."""
    import torch

    import stage2_grpo as g
    from reward import compute_rewards
    from srt.loading import _fix_tokenizer, load_model_and_tokenizer
    from srt.rollouts import PromptStream

    policy, tokenizer = load_model_and_tokenizer(args.model, dtype="float32")
    if args.random_layers:
        policy = random_llama(tokenizer, args.random_layers, args.random_hidden)
        _fix_tokenizer(tokenizer, policy)
    with torch.no_grad():
        policy.lm_head.weight.mul_(args.logit_scale)
    autocast_dtype = torch.bfloat16 if sampler == "bf16" else None
    cfg = g.parse_args(
        ["--model", args.model, "--dtype", "float32", "-K", str(args.num_generations),
         "--max-new-tokens", str(args.max_new_tokens), "--max-prompt-length", str(args.max_prompt_length),
         "--sample-ratio", "2", "--beta", "0", "--lr", str(args.lr), "--seed", str(args.seed)]
    )  # fmt: skip
    models = g.Models(policy, tokenizer, torch.optim.AdamW(policy.parameters(), lr=args.lr))
    settings = g.StepSettings.of(cfg, autocast_dtype)
    stream = PromptStream(records, tokenizer, args.max_prompt_length, args.seed)
    torch.manual_seed(args.seed)
    gaps, entropies, logged, seconds = [], [], [], 0.0
    for _ in range(args.steps):
        pairs = stream.next_batch(args.prompts_per_step)
        start = time.perf_counter()
        rollout = g.sample_batch(
            models, [r for r, _ in pairs], [p for _, p in pairs], settings, compute_rewards
        )
        width = rollout.completion_ids.shape[1]
        policy.train()
        with torch.no_grad():
            old, entropy = g.token_logprobs(
                models, policy, *rollout.sequences("cpu"), width, settings, with_entropy=True
            )
        sampled = rollout.policy_mask.bool()
        gaps.append((old - rollout.sampler_logprobs)[sampled])
        entropies.append(entropy[sampled])
        experience = g.make_experience(models, rollout, settings)
        stats = g.step_stats(rollout, experience, g.update(models, experience, settings), settings)
        logged.append(
            {k: getattr(stats, k) for k in ("sampler_log_ratio", "sampler_kl", "is_capped_fraction")}
        )
        seconds += time.perf_counter() - start
    gap = torch.cat(gaps).double()
    ratio = gap.exp()
    return {
        "sampler": sampler,
        "tokens": len(gap),
        "entropy_nats": torch.cat(entropies).mean().item(),
        "mean_abs_gap": gap.abs().mean().item(),
        "max_abs_gap": gap.abs().max().item(),
        "outside_0.8_1.2": ((ratio < 0.8) | (ratio > 1.2)).double().mean().item(),
        "outside_0.9_1.1": ((ratio < 0.9) | (ratio > 1.1)).double().mean().item(),
        "mean_log_ratio": gap.mean().item(),
        "k3_kl": (gap.exp() - gap - 1).mean().item(),
        "capped_at_2": (gap > torch.tensor(2.0).log()).double().mean().item(),
        "logged_per_step": logged,
        "seconds": seconds,
    }


def main(argv=None) -> None:
    args = build_parser().parse_args(argv)
    check_out(args.out)
    import torch

    torch.manual_seed(args.seed)
    records = bench_records(args.data, args.synthetic)
    info = machine()
    results = [measure(sampler, args, records) for sampler in ("fp32", "bf16")]
    model = (
        args.model if not args.random_layers else f"random Llama {args.random_layers}x{args.random_hidden}"
    )
    rows = [
        [r["sampler"], r["tokens"], r["entropy_nats"], r["mean_abs_gap"], r["max_abs_gap"],
         f"{r['outside_0.8_1.2']:.2%}", f"{r['outside_0.9_1.1']:.2%}", r["mean_log_ratio"], r["k3_kl"],
         f"{r['capped_at_2']:.2%}"]
        for r in results
    ]  # fmt: skip
    logged = [
        [r["sampler"], step + 1, s["sampler_log_ratio"], s["sampler_kl"], f"{s['is_capped_fraction']:.2%}"]
        for r in results
        for step, s in enumerate(r["logged_per_step"])
    ]
    markdown = "\n\n".join(
        [
            f"# Sampler against pi_old: {model} (logit scale {args.logit_scale}), "
            f"K = {args.num_generations}, "
            f"{args.max_new_tokens} new tokens, {args.steps} rollouts per sampler\n\n{machine_line(info)}",
            markdown_table(
                [
                    "sampler",
                    "tokens",
                    "entropy, nats",
                    "mean abs gap",
                    "max abs gap",
                    "ratio outside [0.8, 1.2]",
                    "outside [0.9, 1.1]",
                    "mean log(pi_old/pi_sampler)",
                    "k3 KL",
                    "weight capped at 2",
                ],
                rows,
            ),  # fmt: skip
            "What stage2_grpo.update logged (metrics.jsonl's fields), per rollout:",
            markdown_table(
                ["sampler", "rollout", "sampler_log_ratio", "sampler_kl", "is_capped_fraction"], logged
            ),
        ]
    )
    json_path, md_path = write_results(Path(args.out), "results", {"args": vars(args), "machine": info,
                                                                   "results": results}, markdown)  # fmt: skip
    print(markdown)
    print(f"\nwrote {json_path} and {md_path}")


if __name__ == "__main__":
    main()
