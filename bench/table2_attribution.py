"""How much of a Table 2 gap does each measurement choice make? Read from one evaluate.py run.

A gap between SRT and its "w/o CoT" control can come from the models, or from how they are measured.
This script re-reads the saved answers of an evaluation (no model runs) and prints the control's
accuracy minus SRT's, paired on the same queries, under each choice taken apart:

- the matcher: today's (srt/metrics.py: every key stated, no other value of the same kind) against
  an older matcher given as a file (`--old-metrics`, a metrics.py whose `accuracy(answer, record)`
  counts an answer right when it states every key, whatever else it says);
- the queries: all of them, those that need recall (Table 2's headline), those that need none;
- optionally a second control (`--extra NAME=DIR`): the same method evaluated in another folder on
  the same queries, e.g. a "w/o CoT" model trained on batches formed the old way.

    git show 6dbe393:srt/metrics.py > /tmp/metrics_any_extra.py
    python bench/table2_attribution.py --eval runs/demo/eval --data runs/data/test.jsonl \\
        --base grpo --control nocot --old-metrics /tmp/metrics_any_extra.py

Each gap comes with a paired bootstrap 95% interval (srt.metrics.paired_bootstrap, 2000 resamples).
Writes <out>/attribution.json and prints a Markdown table.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from srt.data_io import DataError, read_jsonl, write_json  # noqa: E402
from srt.metrics import accuracy, paired_bootstrap  # noqa: E402


def load_module(path: str):
    spec = importlib.util.spec_from_file_location("metrics_under_test", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def answers(path: Path) -> dict:
    """id -> final answer of one variant's rows (the last row of an id wins, as in evaluate.py)."""
    if not path.exists():
        raise DataError(f"{path}: no such evaluation file")
    rows = [json.loads(line) for line in path.read_text(encoding="utf-8").splitlines() if line.strip()]
    return {row["id"]: row["final_answer"] or "" for row in rows}


def gap(control: list[float], base: list[float]) -> dict:
    """control - base in points, with its paired interval."""
    boot = paired_bootstrap(base, control)
    return {
        "n": len(base),
        "base_accuracy": 100 * sum(base) / len(base),
        "control_accuracy": 100 * sum(control) / len(control),
        "diff": 100 * boot["diff"],
        "low": 100 * boot["low"],
        "high": 100 * boot["high"],
    }


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--eval", required=True, help="evaluate.py output folder")
    p.add_argument("--data", required=True, help="the records it evaluated (test.jsonl)")
    p.add_argument("--base", default="grpo", help="variant name of SRT")
    p.add_argument("--control", default="nocot", help="variant name of the control")
    p.add_argument("--old-metrics", help="a metrics.py with an older accuracy(answer, record)")
    p.add_argument("--extra", nargs="*", default=[], help="NAME=DIR: the control's method in another folder")
    p.add_argument("--out", default="runs/bench/table2_attribution")
    args = p.parse_args(argv)

    records = {r["id"]: r for r in read_jsonl(args.data)}
    eval_dir = Path(args.eval)
    variants = {args.base: answers(eval_dir / f"{args.base}.jsonl")}
    variants[args.control] = answers(eval_dir / f"{args.control}.jsonl")
    for spec in args.extra:
        name, _, folder = spec.partition("=")
        variants[name] = answers(Path(folder) / f"{args.control}.jsonl")
    shared = set.intersection(*(set(v) for v in variants.values()))
    ids = sorted(i for i in shared if records[i].get("answer_keys"))
    if not ids:
        raise DataError(f"{args.eval}: no query with answer keys answered by every variant")

    matchers = {"today's matcher": accuracy}
    if args.old_metrics:
        matchers["old matcher (keys, anything else)"] = load_module(args.old_metrics).accuracy
    subsets = {
        "all": ids,
        "need recall": [i for i in ids if records[i]["recall"]],
        "need none": [i for i in ids if not records[i]["recall"]],
    }
    rows = []
    for matcher_name, score in matchers.items():
        for subset_name, subset in subsets.items():
            if not subset:
                continue
            base = [score(variants[args.base][i], records[i]) for i in subset]
            for name in list(variants)[1:]:
                control = [score(variants[name][i], records[i]) for i in subset]
                rows.append(
                    {"matcher": matcher_name, "queries": subset_name, "control": name} | gap(control, base)
                )

    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    write_json(out / "attribution.json", {"config": vars(args), "rows": rows})
    print(
        f"| matcher | queries | control | n | {args.base} acc. | control acc. "
        f"| control - {args.base} [95% CI] |"
    )
    print("|---|---|---|---|---|---|---|")
    for r in rows:
        print(
            f"| {r['matcher']} | {r['queries']} | {r['control']} | {r['n']} | {r['base_accuracy']:.1f} | "
            f"{r['control_accuracy']:.1f} | {r['diff']:+.1f} [{r['low']:+.1f}, {r['high']:+.1f}] |"
        )
    return 0


if __name__ == "__main__":
    try:
        sys.exit(main())
    except DataError as err:
        sys.exit(f"error: {err}")
