"""What an SFT run of stage 1 feeds the model, counted without training it: tokens per record in each
phase, and the share of padding in its micro-batches, which is all that sequence packing could save;
and what sharing a dialogue's history prefix across its records would save.

Stage 1's step time on a CPU is about proportional to the tokens of the step (forward and backward
through prompt and target alike), so these counts price the levers of docs/experiments/presets.md:
shorter dialogues, phase 1's share, packing, and prefix sharing (one forward over the prefix tree of
a dialogue's records with a tree attention mask; stage 1 had it once, and presets.md says why it
does not any more).

    python bench/sft_tokens.py --preset cpu-lesson --data runs/demo/data/train.jsonl
    python bench/sft_tokens.py --preset cpu-table2 --data runs/data/train.jsonl
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import stage1_sft  # noqa: E402
from srt.data_io import read_mixture  # noqa: E402
from srt.loading import load_model_and_tokenizer  # noqa: E402


def count(cfg, records, tokenizer) -> dict:
    """Per phase of the preset's plan: steps, mean tokens per record, and the padded tokens of the
    micro-batches (right-padded to their longest row, as stage1_sft.collate does)."""
    global_batch = cfg.batch_size * cfg.grad_accum
    out = {}
    for phase, steps in stage1_sft.phase_plan(cfg, {1: len(records), 2: len(records)}):
        data = stage1_sft.PhaseData(
            tokenizer, records, phase, cfg.max_length, cfg.target, cfg.seed, global_batch, recall=cfg.recall
        )
        real = padded = 0
        lengths = []
        for step in range(steps):
            rows = [len(data.example(i)["input_ids"]) for i in data.batch_indices(step)]
            lengths += rows
            for k in range(0, len(rows), cfg.batch_size):
                micro = rows[k : k + cfg.batch_size]
                real += sum(micro)
                padded += max(micro) * len(micro)
        out[f"phase {phase}"] = {
            "steps": steps,
            "records": len(lengths),
            "tokens per record (mean)": round(statistics.mean(lengths), 1),
            "tokens per record (max)": max(lengths),
            "tokens per step (mean)": round(real / steps, 1),
            "padding share": round(1 - real / padded, 4),
        }
    return out


def prefix_tree_tokens(sequences) -> int:
    """Tokens of the prefix tree (trie) of `sequences`: each distinct prefix counted once. A forward
    over the tree with a tree attention mask computes every sequence's tokens from these alone."""
    root, nodes = {}, 0
    for ids in sequences:
        node = root
        for token in ids:
            if token not in node:
                node[token] = {}
                nodes += 1
            node = node[token]
    return nodes


def shared_prefix(cfg, records, tokenizer, phase: int = 2) -> dict:
    """Every record of the corpus in `phase`, as stage 1 tokenizes it, against the prefix trees of
    the records of each dialogue (meta.dialogue_id): the tokens prefix sharing would leave."""
    by_dialogue = {}
    for record in records:
        # built one by one: PhaseData.example would stand the next record in for one that does not fit
        example = stage1_sft.build_example(tokenizer, record, phase, cfg.max_length, cfg.target, cfg.recall)
        if example is None:  # longer than --max-length: stage 1 never trains on it
            continue
        dialogue = (record.get("meta") or {}).get("dialogue_id", record["id"])
        by_dialogue.setdefault(dialogue, []).append(example["input_ids"])
    flat = sum(len(ids) for group in by_dialogue.values() for ids in group)
    tree = sum(prefix_tree_tokens(group) for group in by_dialogue.values())
    return {
        "dialogues": len(by_dialogue),
        "records per dialogue (mean)": round(sum(map(len, by_dialogue.values())) / len(by_dialogue), 2),
        "tokens, one record at a time": flat,
        "tokens, one prefix tree per dialogue": tree,
        "saved share": round(1 - tree / flat, 4),
    }


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--preset", default="cpu-lesson", choices=sorted(stage1_sft.PRESETS))
    p.add_argument("--data", required=True, help="stage 0's train.jsonl")
    p.add_argument("--model", default="smollm2-135m", help="whose tokenizer counts")
    p.add_argument("--target", default="full", choices=["full", "answer", "recall-only"])
    args, rest = p.parse_known_args(argv)
    cfg = stage1_sft.parse_args(
        ["--preset", args.preset, "--data", args.data, "--target", args.target, "--model", args.model, *rest]
    )
    cfg.world_size = 1
    _, tokenizer = load_model_and_tokenizer(args.model, dtype="float32")
    records = read_mixture(cfg.data, cfg.seed)
    result = count(cfg, records, tokenizer)
    result["phase 2, prefix shared within a dialogue"] = shared_prefix(cfg, records, tokenizer)
    print(json.dumps({"preset": args.preset, "data": args.data, "target": args.target, **result}, indent=1))


if __name__ == "__main__":
    main()
