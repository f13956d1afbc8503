"""What the LoCoMo history window costs and keeps: for each --max-rounds, the SmolLM2 tokens of
the prompt SRT reads and of the SFT example (prompt + target), and the evidence lost on the way.

LoCoMo conversations run to hundreds of rounds; stage 0 (srt/corpora.py load_locomo) gives each
question a window of at most --max-rounds - 1 earlier rounds that holds every evidence round, the
rest of the window being the rounds around it. Evidence is lost in two places:

    window   a question whose evidence rounds outnumber the window is dropped by stage 0
    tokens   stage 1 fits each example to --max-length by dropping the oldest utterances; an
             example that would lose a turn of H* is replaced by the next record (build_example)

Tokenizer only: the records are built as stage 0's oracle builds them (no Eq. (2) embedding, which
changes neither the prompt nor the target), and no model runs.

    python bench/locomo_window.py --path ../shared/data/locomo7.json
    python bench/locomo_window.py --path locomo10.json --max-rounds 8 16 32 --max-length 1536 2048

Writes <out>/locomo_window.json and .md (default runs/bench).
"""

from __future__ import annotations

import argparse
import statistics
import sys
from pathlib import Path

BENCH = Path(__file__).resolve().parent
ROOT = BENCH.parent
for _path in (str(ROOT), str(BENCH)):
    if _path not in sys.path:
        sys.path.insert(0, _path)

from measure import markdown_table, write_results  # noqa: E402


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0], formatter_class=argparse.ArgumentDefaultsHelpFormatter
    )
    p.add_argument("--path", default="../shared/data/locomo7.json", help="a file in LoCoMo's schema")
    p.add_argument("--max-rounds", type=int, nargs="+", default=[8, 12, 16, 24, 32], help="windows to try")
    p.add_argument(
        "--max-length", type=int, nargs="+", default=[1536, 2048], help="stage 1 token budgets to try"
    )
    p.add_argument("--seed", type=int, default=0, help="stage 0's seed (where a window is placed)")
    p.add_argument("--out", default="runs/bench")
    return p


def smollm2_tokenizer():
    """SmolLM2-135M-Instruct's tokenizer (converted once by srt.modeling, as every stage does)."""
    from transformers import AutoTokenizer

    from srt import modeling

    folder = modeling.cache_dir() / "smollm2-135m"
    if not (folder / "tokenizer.json").exists():
        return modeling.load_model_and_tokenizer("smollm2-135m")[1]
    return AutoTokenizer.from_pretrained(folder)


def window_records(path, max_rounds, seed) -> tuple[list[dict], dict]:
    """stage 0's LoCoMo records for one window (the oracle's H*, Z and A*), and the loader's counts."""
    import stage0_build
    from srt.corpora import load_corpus

    dialogues, report = load_corpus("locomo", path, max_rounds=max_rounds, seed=seed, window="evidence")
    records = []
    for d in dialogues:
        t, query = len(d["rounds"]), d["rounds"][-1]
        history = [
            {k: u[k] for k in ("label", "speaker", "text")} for u in stage0_build.utterances(d)[: 2 * (t - 1)]
        ]
        gold, by_label = query["gold"], {u["label"]: u for u in history}
        recalled = [by_label[label] for label in gold["recall"]]
        records.append(
            {
                "id": d["id"],
                "history": history,
                "query": query["user"],
                "query_turn": t,
                "recall": gold["recall"],
                "pruned": gold["recall"],
                "reasoning": stage0_build.build_reasoning(gold["analysis"], recalled, gold["reasoning"]),
                "answer": gold["answer"],
                "answer_keys": [],
                "meta": {"category": gold["category"], "window": d["meta"]["window"]["how"]},
            }
        )
    return records, report


def measure_window(tokenizer, path, max_rounds, max_lengths, seed) -> dict:
    import stage1_sft
    from srt.prompt import format_target, render_prompt

    records, report = window_records(path, max_rounds, seed)
    read = report.get("qa_read", 0)
    prompt = [
        len(tokenizer(render_prompt(tokenizer, r), add_special_tokens=False)["input_ids"]) for r in records
    ]
    target = [len(stage1_sft.target_ids(tokenizer, format_target(r))[0]) for r in records]
    example = [p + t for p, t in zip(prompt, target)]
    row = {
        "max_rounds": max_rounds,
        "questions": read,
        "kept": len(records),
        "lost_to_window": report.get("qa_skipped_evidence_exceeds_window", 0),
        "unresolved_evidence": report.get("qa_skipped_unresolved_evidence", 0),
        "segmented_windows": sum(r["meta"]["window"] == "segments" for r in records),
        "prompt_tokens": {"median": statistics.median(prompt), "max": max(prompt)},
        "example_tokens": {"median": statistics.median(example), "max": max(example)},
        "max_length": {},
    }
    # Stage 1 drops the oldest utterances until prompt + target fit (prompt.fit_history), and the
    # prompt grows with every utterance kept: H* survives exactly when the prompt that starts at the
    # oldest turn of H* fits, so one more prompt a record says what build_example would decide.
    from_h_star = [
        len(
            tokenizer(render_prompt(tokenizer, r, history=h_star_onwards(r)), add_special_tokens=False)[
                "input_ids"
            ]
        )
        + t
        for r, t in zip(records, target)
    ]
    for length in max_lengths:
        row["max_length"][str(length)] = {
            "cut": sum(n > length for n in example),
            "h_star_cut": sum(n > length for n in from_h_star),
        }
    return row


def h_star_onwards(record) -> list[dict]:
    """The history from its oldest turn of H* on (none of it when H* is empty: nothing to lose)."""
    first = min((k for k, u in enumerate(record["history"]) if u["label"] in record["recall"]), default=None)
    return record["history"][first:] if first is not None else []


def main(argv=None) -> None:
    args = build_parser().parse_args(argv)
    if not Path(args.path).exists():
        sys.exit(f"error: {args.path} not found (a file in LoCoMo's schema, e.g. locomo10.json)")
    tokenizer = smollm2_tokenizer()
    rows = [measure_window(tokenizer, args.path, m, args.max_length, args.seed) for m in args.max_rounds]

    def share(n, of):
        return f"{n} ({100 * n / of:.1f}%)" if of else "0"

    header = [
        "--max-rounds",
        "questions kept",
        "evidence beyond the window",
        "prompt tokens median / max",
        "SFT example tokens median / max",
    ] + [f"over --max-length {n} / H* cut" for n in args.max_length]
    table = markdown_table(
        header,
        [
            [
                str(r["max_rounds"]),
                f"{r['kept']} / {r['questions']}",
                share(r["lost_to_window"], r["questions"]),
                f"{r['prompt_tokens']['median']:.0f} / {r['prompt_tokens']['max']}",
                f"{r['example_tokens']['median']:.0f} / {r['example_tokens']['max']}",
            ]
            + [
                f"{share(r['max_length'][str(n)]['cut'], r['kept'])} / "
                f"{share(r['max_length'][str(n)]['h_star_cut'], r['kept'])}"
                for n in args.max_length
            ]
            for r in rows
        ],
    )
    print(table)
    json_path, _ = write_results(Path(args.out), "locomo_window", {"path": args.path, "rows": rows}, table)
    print(f"\n{json_path}")


if __name__ == "__main__":
    main()
