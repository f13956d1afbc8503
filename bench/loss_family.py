"""GRPO's loss family side by side: --loss-type grpo | dapo | dr_grpo (each with its default
--scale-rewards: group, group, none) from the same SFT model, the same seed and prompt stream, the
lesson's stage-2 preset, and one figure of what differs per step: the mean completion length, the
reward components of the sampled groups, the KL to pi_ref and the probe's recall Jaccard.

    python bench/loss_family.py --model runs/demo/sft/final --data runs/demo/data/train.jsonl \\
        --out runs/loss-family

Each variant is a stage2_grpo.py run under <out>/<variant> (resumable: a second call redoes only
what is missing); <out>/loss_family.png and <out>/loss_family.json hold the comparison.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))
from measure import check_out  # noqa: E402

from srt.data_io import write_json  # noqa: E402

VARIANTS = ("grpo", "dapo", "dr_grpo")
PER_STEP = (
    ("completion_length", "mean completion length (tokens)"),
    ("reward_total_mean", "reward R of the sampled groups"),
    ("reward_recall_mean", "recall part of R"),
    ("kl", "KL(pi_theta || pi_ref), k3"),
)


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="runs/demo/sft/final", help="the SFT model every variant starts from")
    p.add_argument("--data", default="runs/demo/data/train.jsonl", help="stage 0's training records")
    p.add_argument("--out", default="runs/loss-family", help="a folder: one run per variant, and the figure")
    p.add_argument("--steps", type=int, default=8, help="GRPO steps per variant (the lesson runs 4)")
    p.add_argument("--probe-every", type=int, default=2, help="greedy dev probe every N steps")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--lr", type=float, default=None, help="GRPO learning rate (default: the preset's, 3e-6)")
    p.add_argument("--variants", nargs="+", choices=VARIANTS, default=list(VARIANTS))
    return p


def read_jsonl(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def main(argv=None) -> None:
    args = build_parser().parse_args(argv)
    out = check_out(args.out)  # bench/measure.py: a folder of the benchmarks' own
    repo = Path(__file__).resolve().parents[1]
    for variant in args.variants:
        command = [
            sys.executable, str(repo / "stage2_grpo.py"), "--preset", "cpu-lesson",
            "--model", args.model, "--data", args.data, "--out", str(out / variant), "--loss-type", variant,
            "--seed", str(args.seed), "--max-steps", str(args.steps),
            "--probe-every", str(args.probe_every), "--resume",
        ] + ([] if args.lr is None else ["--lr", str(args.lr)])  # fmt: skip
        print("$", " ".join(command[1:]), flush=True)
        if subprocess.run(command).returncode != 0:  # stage 2 said why in its own line, above
            sys.exit(f"error: stage2_grpo.py of variant {variant} failed; its error is above")

    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    runs = {
        v: (read_jsonl(out / v / "metrics.jsonl"), read_jsonl(out / v / "probe.jsonl")) for v in args.variants
    }
    fig, axes = plt.subplots(1, len(PER_STEP) + 1, figsize=(4.2 * (len(PER_STEP) + 1), 3.6))
    for variant, (metrics, probes) in runs.items():
        steps = [m["step"] for m in metrics]
        for ax, (key, title) in zip(axes, PER_STEP):
            ax.plot(steps, [m.get(key) for m in metrics], marker=".", label=variant)
            ax.set_title(title, fontsize=9)
            if key == "kl":  # k3 is exp(ref - logp) - ...: one token far below pi_ref spikes the mean
                ax.set_yscale("log")
        axes[-1].plot(
            [p["step"] for p in probes], [p.get("jaccard_needed") for p in probes], marker="o", label=variant
        )
        axes[-1].set_title("dev probe: recall Jaccard", fontsize=9)
    for ax in axes:
        ax.set_xlabel("GRPO step")
        ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(out / "loss_family.png", dpi=110)
    summary = {
        v: {
            "steps": len(metrics),
            **{key: [m.get(key) for m in metrics] for key, _ in PER_STEP},
            "probe_jaccard": {p["step"]: p.get("jaccard_needed") for p in probes},
            "probe_f1": {p["step"]: p.get("f1") for p in probes},
        }
        for v, (metrics, probes) in runs.items()
    }
    write_json(out / "loss_family.json", summary)
    for v, row in summary.items():
        lengths = [x for x in row["completion_length"] if x is not None]
        print(
            f"{v:8s} length {sum(lengths) / max(len(lengths), 1):6.1f}  KL last {row['kl'][-1]}  "
            f"probe Jaccard {row['probe_jaccard']}"
        )


if __name__ == "__main__":
    main()
