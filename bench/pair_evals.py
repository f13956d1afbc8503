"""Pair two evaluate.py runs on the same LoCoMo questions: one variant's rows against another's, by id.

evaluate.py pairs the variants of one run. Two runs that answer the same questions from different
records (the same LoCoMo questions on a retrieved window and on the oracle evidence window, say)
are paired here instead, by the comparison evaluate.py makes within a run (srt/locomo_eval.py
`compare`): every metric gets each side's mean and B minus A with its 2000-resample paired
bootstrap 95% interval, over all matched questions, the answerable ones (categories 1-4) and per
category.

    python bench/pair_evals.py runs/locomo/eval/mix.jsonl runs/locomo/eval-oracle/mix.jsonl \\
        --names retrieved oracle --out runs/bench/pair_evals

Writes <out>/results.json and <out>/results.md; prints the table.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from pathlib import Path

BENCH = Path(__file__).resolve().parent
ROOT = BENCH.parent
for _path in (str(ROOT), str(BENCH)):
    if _path not in sys.path:
        sys.path.insert(0, _path)

from measure import check_out, machine, write_results  # noqa: E402

from srt import locomo_eval  # noqa: E402
from srt.data_io import DataError, read_jsonl  # noqa: E402

METRICS = [
    "locomo_score",
    "f1",
    "evidence_recall",
    "jaccard",
    "label_jaccard",
    "accuracy",
    "input_tokens",
    "decoded_tokens",
]


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0], formatter_class=argparse.ArgumentDefaultsHelpFormatter
    )
    p.add_argument("a", help="rows of variant A (an evaluate.py output file <out>/<variant>.jsonl)")
    p.add_argument("b", help="rows of variant B, the same questions")
    p.add_argument("--names", nargs=2, default=["A", "B"], metavar=("A", "B"), help="what to call them")
    p.add_argument("--metrics", nargs="+", default=METRICS, help="row fields to compare")
    p.add_argument("--out", default="runs/bench/pair_evals")
    return p


def read_rows(path, metrics=METRICS) -> list[dict]:
    """The rows of an evaluate.py output file, one per question: a row repeated whole (a file
    appended twice) is counted once, with a note; another row under an id already read is refused,
    as is a metric that is not a number. A metric that is NaN or infinite (no value) is left out
    of the pairs, with a note, as a missing one is: it would make every interval NaN."""
    rows, first, repeats, not_finite = [], {}, 0, 0
    for line, row in enumerate(read_jsonl(path, validate=False), 1):
        if "id" not in row:
            raise DataError(f"{path}:{line}: field 'id' is missing")
        text = json.dumps(row, sort_keys=True)  # NaN == NaN as text, not as floats
        if row["id"] in first:
            earlier_line, earlier = first[row["id"]]
            if text != earlier:
                raise DataError(
                    f"{path}:{line}: id {row['id']!r} again, with other values than on line {earlier_line}; "
                    "one row per question"
                )
            repeats += 1
            continue
        for metric in metrics:
            value = row.get(metric)
            if value is not None and (isinstance(value, str) or not isinstance(value, (int, float))):
                raise DataError(
                    f"{path}:{line}: field {metric!r} must be a number, got {type(value).__name__}"
                )
            if isinstance(value, float) and not math.isfinite(value):
                row = {**row, metric: None}
                not_finite += 1
        first[row["id"]] = (line, text)
        rows.append(row)
    if repeats:
        print(f"note: {path}: {repeats} repeated row(s) counted once", file=sys.stderr)
    if not_finite:
        print(f"note: {path}: {not_finite} NaN or infinite value(s) left out of the pairs", file=sys.stderr)
    return rows


def compare(rows_a: list, rows_b: list, metrics) -> dict:
    """-> {"shared": questions in both, "subsets": {subset: {metric: {"a", "b", **paired_bootstrap}}}}."""
    pairs = locomo_eval.compare({"A": rows_a, "B": rows_b}, "A", metrics=metrics).get("B", {})
    subsets = {key: {m: c for m, c in cell.items() if m in metrics and c["n"]} for key, cell in pairs.items()
               if key != "against" and cell["n"]}  # fmt: skip
    return {
        "n_a": len(rows_a),
        "n_b": len(rows_b),
        "shared": pairs.get("all", {}).get("n", 0),
        "subsets": subsets,
    }


def table(result: dict, names) -> str:
    percent = {"locomo_score", "f1", "evidence_recall", "jaccard", "label_jaccard", "accuracy"}
    lines = [
        f"| subset | metric | {names[0]} | {names[1]} | {names[1]} - {names[0]} [95% CI] | n |",
        "|---|---|---:|---:|---|---:|",
    ]
    for subset, metrics in result["subsets"].items():
        for metric, m in metrics.items():
            scale = 100 if metric in percent else 1
            lines.append(
                f"| {subset} | {metric} | {scale * m['a']:.1f} | {scale * m['b']:.1f} | "
                f"{scale * m['diff']:+.1f} [{scale * m['low']:+.1f}, {scale * m['high']:+.1f}] | {m['n']} |"
            )
    return "\n".join(lines)


def main(argv=None) -> dict:
    args = build_parser().parse_args(argv)
    check_out(args.out)
    try:
        rows_a, rows_b = read_rows(args.a, args.metrics), read_rows(args.b, args.metrics)
    except (DataError, FileNotFoundError) as e:
        sys.exit(f"error: {e}")
    result = compare(rows_a, rows_b, args.metrics)
    if result["shared"] == 0:
        sys.exit(f"error: {args.a} and {args.b} share no LoCoMo question id")
    markdown = (
        f"{args.names[1]} ({args.b}) against {args.names[0]} ({args.a}): {result['shared']} questions "
        f"in both ({result['n_a']} and {result['n_b']} rows)\n\n" + table(result, args.names)
    )
    print(markdown)
    payload = {"machine": machine(), "a": args.a, "b": args.b, "names": args.names, **result}
    write_results(Path(args.out), "results", payload, markdown)
    return result


if __name__ == "__main__":
    main()
