"""Benchmark: answer latency and throughput of every evaluation method, per dialogue length bucket:
the shape of the latency column of the paper's Table 1 and of CueMem's token ratio.

For full, recency, rag, srt-p, srt and cuemem, on the same test queries (a seeded draw of
--per-bucket queries from each length bucket 8 / 16 / 24 / 32), through evaluate.py's own pieces
(method_input builds each method's messages, prompt.render_chat its prompt, generate_batch
answers greedily, metrics.final_answer parses):

- per-request latency at batch size 1, after one untimed warm-up request per method: generation
  plus parsing, the time a user waits once the prompt exists. Building the prompt (retrieval: RAG's
  embedding of the history, CueMem's whole cue index and context reconstruction) is timed apart,
  as `prepare`, and reported beside the latency, never inside it: a deployed system maintains its
  index as the conversation goes, outside the query;
- input and generated tokens per request, and each method's input tokens as a share of full
  history's (CueMem's token ratio);
- throughput at batch size --batch-size (default 8): requests and generated tokens per second of
  one batched generate over --batch-size queries of the bucket.

Queries are answered method after method for each query (interleaved), so that a slow spell of a
shared machine falls on every method. srt runs on --srt-model (the trained checkpoint); the others
on --model (the base model). Generation settings are evaluate.py's defaults (greedy; its token caps;
direct methods stop at the end of their one answer line).

    python bench/eval_latency.py --model smollm2-135m --srt-model runs/demo/grpo/final \\
        --data runs/data/test.jsonl
    python bench/eval_latency.py --model tiny-random --synthetic 40 --per-bucket 1 --batch-size 2 \\
        --out runs/bench/tiny-eval

Writes <out>/results.json and <out>/results.md (default runs/bench/eval_latency).
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import time
from pathlib import Path

BENCH = Path(__file__).resolve().parent
ROOT = BENCH.parent
for _path in (str(ROOT), str(BENCH)):
    if _path not in sys.path:
        sys.path.insert(0, _path)

from measure import check_out, describe, fmt, fmt_stat, machine, machine_line, markdown_table, write_results  # noqa: E402

BUCKET_ALL = "all"


def build_parser() -> argparse.ArgumentParser:
    import evaluate

    D = vars(evaluate.build_parser().parse_args([]))  # evaluate.py's own defaults
    p = argparse.ArgumentParser(
        description="Per-request latency (batch 1) and throughput (batch 8) of every "
        "evaluation method, per length bucket.",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    add = p.add_argument
    add("--model", default=D["model"], help="the model of full, recency, rag, srt-p and cuemem")
    add("--srt-model", default=None, help="the trained SRT checkpoint for srt (default: --model, untrained)")
    add("--data", default=D["data"], help="stage-0 test records (JSONL)")
    add(
        "--synthetic",
        type=int,
        metavar="N",
        help="instead of --data, build N synthetic dialogues in a temporary folder",
    )
    add("--out", default="runs/bench/eval_latency", help="writes results.json and results.md here")
    add(
        "--methods",
        default=",".join(evaluate.METHODS),
        help="comma-separated, from " + ", ".join(evaluate.METHODS),
    )
    add("--per-bucket", type=int, default=4, help="queries per length bucket timed at batch size 1")
    add("--batch-size", type=int, default=8, help="the throughput batch (0: no throughput pass)")
    add("--max-new-tokens", type=int, default=D["max_new_tokens"], help="for srt / srt-p")
    add(
        "--max-new-tokens-direct",
        type=int,
        default=D["max_new_tokens_direct"],
        help="for full / recency / rag / cuemem",
    )
    add("--recency-k", type=int, default=D["recency_k"], help="rounds kept by recency")
    add("--rag-k", type=int, default=D["rag_k"], help="utterances retrieved by rag")
    add("--dtype", default=D["dtype"], choices=["auto", "float32", "bfloat16"], help="as evaluate.py")
    add("--seed", type=int, default=D["seed"], help="which queries")
    return p


def check_arguments(args) -> list[str]:
    import evaluate

    methods = [m.strip() for m in args.methods.split(",") if m.strip()]
    unknown = [m for m in methods if m not in evaluate.METHODS]
    if unknown or not methods:
        sys.exit(f"error: --methods {args.methods!r}: choose from {', '.join(evaluate.METHODS)}")
    if args.per_bucket < 1:
        sys.exit("error: --per-bucket must be at least 1")
    if args.batch_size < 0:
        sys.exit("error: --batch-size must be 0 (no throughput pass) or more")
    if not args.synthetic and not Path(args.data).exists():
        sys.exit(
            f"error: {args.data} not found; build it with `python stage0_build.py --source synthetic "
            f"--out {Path(args.data).parent}`, or pass --synthetic N"
        )
    return list(dict.fromkeys(methods))


def pick_queries(records, per_bucket: int, batch_size: int, seed: int) -> dict:
    """bucket -> records: a seeded draw of max(per_bucket, batch_size) queries from each length
    bucket (evaluate.select_examples within the bucket), in file order. The first per_bucket are
    timed one by one, the first batch_size make the throughput batch."""
    import evaluate
    from srt.data_io import BUCKETS, bucket_of

    chosen = {}
    for bucket in BUCKETS:
        members = [r for r in records if bucket_of(evaluate.num_turns(r)) == bucket]
        if members:
            chosen[bucket] = evaluate.select_examples(members, max(per_bucket, batch_size), seed)
    return chosen


def build_prompt(method, record, options, tokenizer):
    import evaluate
    from srt.prompt import render_chat

    start = time.perf_counter()
    messages, _ = evaluate.method_input(method, record, options)
    prompt = render_chat(tokenizer, messages)
    return prompt, time.perf_counter() - start


def answer(model, tokenizer, method, prompts, max_new, autocast_dtype) -> tuple[list[dict], float]:
    """Greedy answers of a batch and the wall seconds of generating and parsing them."""
    import evaluate
    from srt.metrics import SELF_RECALL_METHODS, final_answer

    sync = _sync(model)
    sync()
    start = time.perf_counter()
    outputs = evaluate.generate_batch(
        model, tokenizer, prompts, max_new, autocast_dtype, one_line=method not in SELF_RECALL_METHODS
    )
    for output in outputs:
        final_answer(method, output["text"])  # the parse an application would run
    sync()
    return outputs, time.perf_counter() - start


def _sync(model):
    import torch

    return torch.cuda.synchronize if next(model.parameters()).device.type == "cuda" else (lambda: None)


def measure(args, methods: list[str], queries: dict) -> dict:
    """-> {"requests": [...], "batches": [...], "models": {...}}: one row per timed request and per
    throughput batch."""
    import gc

    import torch

    from srt.embedder import load_embedder
    from srt.loading import load_model_and_tokenizer
    from srt.metrics import SELF_RECALL_METHODS
    from srt.precision import resolve_dtype

    options = {
        "recency_k": args.recency_k,
        "rag_k": args.rag_k,
        "cuemem": {},
    }  # evaluate.method_input's options
    model_of = {m: (args.srt_model or args.model) if m == "srt" else args.model for m in methods}
    device = "cuda" if torch.cuda.is_available() else "cpu"
    _, autocast_dtype = resolve_dtype(args.dtype, device)
    if any(m in ("rag", "cuemem") for m in methods):
        load_embedder()  # a one-time load, outside every timing
    requests, batches = [], []
    for model_name in dict.fromkeys(model_of.values()):
        group = [m for m in methods if model_of[m] == model_name]
        model, tokenizer = load_model_and_tokenizer(model_name, dtype=args.dtype, device=device)
        first = next(iter(queries.values()))[0]
        for method in group:  # warm-up: lazy initialisation, first-call allocations
            max_new = args.max_new_tokens if method in SELF_RECALL_METHODS else args.max_new_tokens_direct
            prompt, _ = build_prompt(method, first, options, tokenizer)
            answer(model, tokenizer, method, [prompt], max_new, autocast_dtype)
        for bucket, records in queries.items():
            for record in records[: args.per_bucket]:
                for method in group:  # interleaved: every method meets the same machine state
                    max_new = (
                        args.max_new_tokens if method in SELF_RECALL_METHODS else args.max_new_tokens_direct
                    )
                    prompt, prepare_s = build_prompt(method, record, options, tokenizer)
                    (output,), seconds = answer(model, tokenizer, method, [prompt], max_new, autocast_dtype)
                    requests.append(
                        {
                            "method": method,
                            "model": model_name,
                            "bucket": bucket,
                            "id": record["id"],
                            "latency_s": seconds,
                            "prepare_s": prepare_s,
                            "input_tokens": output["input_tokens"],
                            "generated_tokens": output["generated_tokens"],
                        }
                    )
            if args.batch_size:
                batch = records[: args.batch_size]
                for method in group:
                    max_new = (
                        args.max_new_tokens if method in SELF_RECALL_METHODS else args.max_new_tokens_direct
                    )
                    built = [build_prompt(method, r, options, tokenizer) for r in batch]
                    outputs, seconds = answer(
                        model, tokenizer, method, [p for p, _ in built], max_new, autocast_dtype
                    )
                    batches.append(
                        {
                            "method": method,
                            "model": model_name,
                            "bucket": bucket,
                            "rows": len(batch),
                            "seconds": seconds,
                            "prepare_s": sum(s for _, s in built),
                            "input_tokens": sum(o["input_tokens"] for o in outputs),
                            "generated_tokens": sum(o["generated_tokens"] for o in outputs),
                        }
                    )
        del model, tokenizer
        gc.collect()
    return {
        "requests": requests,
        "batches": batches,
        "models": model_of,
        "autocast": str(autocast_dtype).replace("torch.", "") if autocast_dtype else None,
    }


def _mean(values):
    values = [v for v in values if v is not None]
    return sum(values) / len(values) if values else None


def summarize(measured: dict, methods: list[str]) -> list[dict]:
    """One row per method and bucket (and per method over all buckets): latency and prepare
    median (min-max), mean input and generated tokens, input tokens / full's, batch throughput."""
    requests, batches = measured["requests"], measured["batches"]
    buckets = sorted({r["bucket"] for r in requests})
    rows = []
    for method in methods:
        for bucket in buckets + [BUCKET_ALL]:
            mine = [r for r in requests if r["method"] == method and bucket in (BUCKET_ALL, r["bucket"])]
            full = [r for r in requests if r["method"] == "full" and bucket in (BUCKET_ALL, r["bucket"])]
            runs = [b for b in batches if b["method"] == method and bucket in (BUCKET_ALL, b["bucket"])]
            if not mine:
                continue
            input_tokens = _mean([r["input_tokens"] for r in mine])
            full_input = _mean([r["input_tokens"] for r in full])
            seconds = sum(b["seconds"] for b in runs)
            rows.append(
                {
                    "method": method,
                    "bucket": bucket,
                    "n": len(mine),
                    "latency_s": describe([r["latency_s"] for r in mine]),
                    "prepare_s": describe([r["prepare_s"] for r in mine]),
                    "input_tokens": input_tokens,
                    "generated_tokens": _mean([r["generated_tokens"] for r in mine]),
                    "input_vs_full": input_tokens / full_input
                    if input_tokens is not None and full_input
                    else None,
                    "batch_rows": sum(b["rows"] for b in runs) if runs else None,
                    "requests_per_s": sum(b["rows"] for b in runs) / seconds if runs and seconds else None,
                    "generated_tokens_per_s": sum(b["generated_tokens"] for b in runs) / seconds
                    if runs and seconds
                    else None,
                }
            )
    return rows


HEADER = [
    "method",
    "bucket",
    "n",
    "latency s, batch 1",
    "prepare s (beside)",
    "input tokens",
    "x full's input",
    "generated tokens",
    "batch req / s",
    "batch generated tok / s",
]


def table(rows: list[dict]) -> str:
    cells = [
        [
            r["method"],
            str(r["bucket"]),
            r["n"],
            fmt_stat(r["latency_s"]),
            fmt_stat(r["prepare_s"]),
            fmt(r["input_tokens"], 4),
            "n/a" if r["input_vs_full"] is None else f"{r['input_vs_full']:.2f}",
            fmt(r["generated_tokens"]),
            fmt(r["requests_per_s"]),
            fmt(r["generated_tokens_per_s"]),
        ]
        for r in rows
    ]
    return markdown_table(HEADER, cells, "llrrrrrrrr")


def main(argv=None) -> None:
    args = build_parser().parse_args(argv)
    methods = check_arguments(args)
    check_out(args.out)
    from srt.data_io import DataError, read_jsonl

    with tempfile.TemporaryDirectory(prefix="eval_latency-") as tmp:
        data = args.data
        if args.synthetic:
            import stage0_build

            stage0_build.main(
                [
                    "--source",
                    "synthetic",
                    "--num-dialogues",
                    str(args.synthetic),
                    "--out",
                    tmp,
                    "--seed",
                    str(args.seed),
                    "--quiet",
                    "--dev-fraction",
                    "0",
                    "--test-fraction",
                    "0",
                ]
            )
            data = str(Path(tmp) / "train.jsonl")
        try:
            records = read_jsonl(data)
        except DataError as e:
            sys.exit(f"error: {e}")
        queries = pick_queries(records, args.per_bucket, args.batch_size, args.seed)
        if not queries:
            sys.exit(f"error: {data} holds no records")
        measured = measure(args, methods, queries)
    rows = summarize(measured, methods)
    host = machine()
    command = "python bench/eval_latency.py " + " ".join(argv if argv is not None else sys.argv[1:])
    text = "\n".join(
        [
            "# Evaluation latency and throughput per method and length bucket",
            "",
            f"`{command}`",
            "",
            f"Machine: {machine_line(host)}; autocast {measured['autocast'] or 'none'}.",
            "",
            f"srt on `{args.srt_model or args.model}`, the other methods on `{args.model}`; greedy, up to "
            f"{args.max_new_tokens} new tokens for srt / srt-p and {args.max_new_tokens_direct} for the "
            f"direct methods. Latency: generation and parsing of one request at batch size 1 after a "
            f"warm-up, median (min-max) over the bucket's queries; prepare (building the prompt, retrieval "
            f"and CueMem's index included) is timed apart and shown beside it. Throughput: one batched "
            f"generate of up to {args.batch_size} queries of the bucket.",
            "",
            table(rows),
            "",
        ]
    )
    payload = {"command": command, "config": vars(args), "machine": host, "rows": rows, **measured}
    json_path, md_path = write_results(Path(args.out), "results", payload, text)
    print(text + f"\nwritten: {md_path}, {json_path}", flush=True)


if __name__ == "__main__":
    main()
