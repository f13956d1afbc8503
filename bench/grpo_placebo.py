"""Placebo control for GRPO: the same run as `stage2_grpo.py`, except that each group's K reward
records are shuffled among its K samples before Eq. (8) turns them into advantages.

The placebo keeps everything a real run has: the same prompts, the same sampling, the same reward
statistics per group (mean, spread, which groups dynamic sampling drops), the same number and size
of updates. Only the link between a completion and its reward is cut, so whatever a placebo run
changes on dev is what noisy updates of that size do by themselves, and a real run is credited only
with what it does beyond its placebo. The probe and the final evaluation score with the true reward.

    python bench/grpo_placebo.py --preset cpu-long --model runs/recall/sft-long/final \\
        --out runs/recall/placebo-s0 ...

Takes every flag of stage2_grpo.py; writes <out>/placebo.json beside its config. The permutations
come from their own generator (seed = --seed), which a --resume starts afresh.
"""

from __future__ import annotations

import random
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

import stage2_grpo  # noqa: E402
from srt.config import claim_out  # noqa: E402
from srt.data_io import write_json  # noqa: E402


def shuffled_within_groups(reward_fn, K: int, rng: random.Random):
    """reward_fn whose scores are permuted inside each aligned block of K rows (one group: rollouts.py
    lays a step's rows out prompt by prompt, K each)."""

    def placebo(completions, examples):
        scores = list(reward_fn(completions, examples))
        if len(scores) % K:
            raise ValueError(f"placebo: {len(scores)} rows are not whole groups of K = {K}")
        for g in range(0, len(scores), K):
            block = scores[g : g + K]
            rng.shuffle(block)
            scores[g : g + K] = block
        return scores

    return placebo


def placebo_parser():
    """stage2_grpo.py's parser with this script's name and description, for --help."""
    p = REAL_PARSER()
    p.prog, p.description = "grpo_placebo.py", __doc__.split("\n\n")[0]
    return p


REAL_PARSER = stage2_grpo.build_parser


def main(argv=None) -> None:
    stage2_grpo.build_parser = placebo_parser
    try:
        cfg = stage2_grpo.parse_args(argv)
    finally:
        stage2_grpo.build_parser = REAL_PARSER
    rng = random.Random(cfg.seed)
    real_step = stage2_grpo.grpo_step

    def placebo_step(*args, reward_fn=None, **kwargs):  # training steps only: the probe keeps the true reward
        return real_step(
            *args, reward_fn=shuffled_within_groups(reward_fn, cfg.num_generations, rng), **kwargs
        )

    stage2_grpo.grpo_step = placebo_step
    claim_out(
        cfg.out, "stage2_grpo.py", cfg.resume, cfg.overwrite
    )  # before placebo.json: an earlier run stays
    write_json(
        Path(cfg.out) / "placebo.json", {"placebo": "rewards shuffled within each group", "seed": cfg.seed}
    )
    try:
        stage2_grpo.train(cfg)
    except (stage2_grpo.DataError, FileNotFoundError) as e:
        sys.exit(f"error: {e}")
    finally:
        stage2_grpo.grpo_step = real_step


if __name__ == "__main__":
    main()
