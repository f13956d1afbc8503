"""Evaluation of SRT and its baselines (paper §4).

    records -> stratified selection -> one answer per record and method -> metrics
            -> <out>/<name>.jsonl, summary.json, report.md (Tables 1-3), PNG plots (Figs. 3-4)

The metrics themselves live in metrics.py (shared with cuemem.py), the tables and plots in
report.py; this file chooses the examples, builds each method's input, generates, scores and
aggregates.

Methods (`--method`, or METHOD in `--compare NAME=METHOD:MODEL`):
    full     the whole history, a direct answer, no recall (the "full-history" setting)
    recency  the last k rounds only                                   (--recency-k)
    rag      the top-k history turns by embedding similarity, in chronological order (§2.1; --rag-k)
    srt-p    the pluggable self-recall prompt of §4.8: instruction + worked <HIS> example, no training;
             also on an OpenAI-compatible chat API (--api-base, as the paper applies it to closed models)
    srt      a trained checkpoint writing the SRT chain (stage1/stage2 output)
    cuemem   CueMem's reconstructed evidence (cuemem.py), answered from the evidence alone

Metrics: SQuAD-style token F1 and key accuracy of the final answer (Table 1, Table 2); precision,
recall and Jaccard of the recalled set H^ against H* (Table 2); the error taxonomy of every wrong
answer per length bucket (Table 3); every metric per bucket 8, 12, ..., 32 (Fig. 4); format
validity and the reward components of reward.py (Eqs. (4)-(7)); latency per answer (Table 1); and
the attention analysis of §4.6 (Fig. 3).

    python evaluate.py --method srt --model runs/demo/grpo/final --data runs/data/test.jsonl --out runs/demo/eval
    python evaluate.py --data runs/data/test.jsonl --out runs/demo/eval --compare \\
        base-srtp=srt-p:smollm2-135m full=full:smollm2-135m rag=rag:smollm2-135m \\
        sft=srt:runs/demo/sft/final grpo=srt:runs/demo/grpo/final

Run `python evaluate.py --help`.
"""
from __future__ import annotations

import argparse
import gc
import json
import os
import random
import re
import sys
import time
from pathlib import Path

import numpy as np
import torch

import cuemem
import modeling
import report
import reward
from cli import parse_config, write_config
from data_io import BUCKETS, DataError, atomic_write_text, bucket_of, read_jsonl
from metrics import SELF_RECALL_METHODS, accuracy, error_type, f1_score, final_answer, recall_metrics
from modeling import embed, load_embedder, load_model_and_tokenizer, render_chat, resolve_dtype
from stage0_build import SRT_SYSTEM_PROMPT, ChatClient, build_messages, format_target

METHODS = ("full", "recency", "rag", "srt-p", "srt", "cuemem")
FIG4_BUCKETS = tuple(range(8, 33, 4))           # 8, 12, ..., 32 rounds (Fig. 4)
# Conventional --compare names for Table 2, used when --table2 is not given.
TABLE2_GUESS = {"SRT": ("grpo", "srt"), "w/o RL": ("sft",), "w/o CoT": ("nocot", "sft-nocot"),
                "w/o SFT": ("base-srtp", "srt-p", "srtp")}

PRESETS = {
    # `make demo`: 32 test queries (8 per length bucket, stratified) for each of six variants on
    # 2 CPU cores with SmolLM2-135M; the 24- and 32-round cells hold 8 queries each.
    "cpu-demo": {"limit": 32, "batch_size": 8, "attention_examples": 2},
    # The paper's scale: the whole test split, longer chains, a GPU.
    "paper": {"limit": None, "batch_size": 16, "max_new_tokens": 512, "max_new_tokens_direct": 64,
              "attention_examples": 8},
}


# --------------------------------------------------------------------------------------------
# Which examples: buckets by dialogue length and the stratified --limit
# --------------------------------------------------------------------------------------------
def num_turns(record) -> int:
    return int(record.get("meta", {}).get("num_turns", record["query_turn"]))


def select_examples(records, limit=None, seed=0, buckets=BUCKETS) -> list[dict]:
    """The default selection rule: with a limit, take examples evenly across the Table 3 length
    buckets (round robin 8 -> 16 -> 24 -> 32 over a seeded shuffle of each bucket) so the long
    buckets are represented however the file is ordered; a bucket that runs dry passes its share
    on. The chosen records keep their order in the file."""
    if limit is None or limit >= len(records):
        return list(records)
    rng = random.Random(seed)
    groups = {b: [] for b in buckets}
    for index, record in enumerate(records):
        groups[bucket_of(num_turns(record), buckets)].append(index)
    for members in groups.values():
        rng.shuffle(members)
    chosen = []
    while len(chosen) < limit:
        for b in buckets:
            if groups[b] and len(chosen) < limit:
                chosen.append(groups[b].pop())
    return [records[i] for i in sorted(chosen)]


# --------------------------------------------------------------------------------------------
# The methods: what each one shows the model, and which turns it counts as recalled
# --------------------------------------------------------------------------------------------
DIRECT_SYSTEM_PROMPT = (
    "You are a customer-service assistant in a long conversation. Answer the current query from the "
    "dialogue history. Do not explain. Reply with one line: 'Final answer:' followed by a short answer."
)

# §4.8 SRT-P: the self-recall strategy as a prompt, an instruction plus one short worked example.
SRTP_SYSTEM_PROMPT = SRT_SYSTEM_PROMPT + (
    "\n\nA worked example (its dialogue is not the user's).\n"
    "--- Example dialogue ---\n"
    "Q1: I'm a Gold member and I'd like the 60-minute massage on Saturday.\n"
    "A1: Booked for Saturday at 3 pm. The 60-minute massage is $100.\n"
    "Q2: Do you sell gift cards?\n"
    "A2: Yes, gift cards start at $25.\n"
    "Q3: Is parking free?\n"
    "A3: Yes, for spa guests. Gold members also get 20% off every massage.\n"
    "Current query (Q4): What will I pay for Saturday's massage?\n"
    "--- Example reply ---\n"
    "<think>\n"
    "1. Analyze Query: the price of the booked massage after any discount.\n"
    "2. Recall History: <HIS>Q1: I'm a Gold member and I'd like the 60-minute massage on Saturday.</HIS>\n"
    "<HIS>A1: Booked for Saturday at 3 pm. The 60-minute massage is $100.</HIS>\n"
    "<HIS>A3: Yes, for spa guests. Gold members also get 20% off every massage.</HIS>\n"
    "3. Reasoning: the massage is $100 and a Gold member gets 20% off, so $100 - $20 = $80.\n"
    "</think>\n"
    "Final answer: $80\n"
    "--- End of example ---"
)


def round_of(label: str, position: int) -> int:
    """Round index i of a label Qi / Ai (the position in the history when the label is unusual)."""
    match = re.fullmatch(r"[QA](\d+)", label)
    return int(match.group(1)) if match else position // 2 + 1


def recency_turns(record, k: int) -> list[str]:
    """Labels of the last k rounds of the history."""
    rounds = [round_of(turn["label"], i) for i, turn in enumerate(record["history"])]
    last = sorted(set(rounds))[-k:] if k > 0 else []
    return [turn["label"] for turn, r in zip(record["history"], rounds) if r in last]


def rag_turns(record, k: int) -> list[str]:
    """Labels of the k history utterances most similar to the query (cosine of unit-norm sentence
    embeddings, the vector retrieval of §2.1), returned in chronological order."""
    history = record["history"]
    if not history or k <= 0:
        return []
    vectors = embed([record["query"]] + [turn["text"] for turn in history])
    scores = vectors[1:] @ vectors[0]
    top = sorted(np.argsort(-scores, kind="stable")[:k])
    return [history[i]["label"] for i in top]


def method_input(method: str, record: dict, options: dict) -> tuple[list[dict], list | None]:
    """-> (chat messages, recalled labels). The recalled set of rag, recency and cuemem is what
    they selected; srt and srt-p recall by writing <HIS> tags (parsed later); full recalls nothing
    (its recall metrics are null). The messages go through the model's own chat template
    (modeling.render_chat), as stage0's render_prompt does for training."""
    if method == "full":
        return build_messages(record, system=DIRECT_SYSTEM_PROMPT), None
    if method in ("recency", "rag"):
        keep = (recency_turns(record, options["recency_k"]) if method == "recency"
                else rag_turns(record, options["rag_k"]))
        return build_messages(record, keep=set(keep), system=DIRECT_SYSTEM_PROMPT), keep
    if method == "srt-p":
        return build_messages(record, system=SRTP_SYSTEM_PROMPT), None
    if method == "srt":
        return build_messages(record), None  # exactly the prompt SFT and GRPO trained on
    if method == "cuemem":
        evidence = list(cuemem.cuemem_evidence(record, **options["cuemem_options"]))
        return cuemem.build_answer_messages(record, evidence), evidence
    raise ValueError(f"unknown method {method!r}; choose from {', '.join(METHODS)}")


# --------------------------------------------------------------------------------------------
# Generation: greedy, batched (modeling.generate: left padding, stops at <|im_end|> / eos)
# --------------------------------------------------------------------------------------------
def generate_batch(model, tokenizer, prompts, max_new_tokens, autocast_dtype=None) -> list[dict]:
    """Greedy completions of a batch of chat-templated prompt texts ->
    [{text, input_tokens, generated_tokens}]; generated_tokens counts up to and including the
    first stop token."""
    out = modeling.generate(model, tokenizer, prompts, max_new_tokens=max_new_tokens, greedy=True,
                            autocast_dtype=autocast_dtype)
    return [{"text": text, "input_tokens": int(n_in), "generated_tokens": int(n_out)}
            for text, n_in, n_out in zip(out["texts"], out["input_tokens"], out["generated_tokens"])]
# --------------------------------------------------------------------------------------------
# Scoring one prediction
# --------------------------------------------------------------------------------------------
def score_prediction(method: str, record: dict, completion: str, recalled, reward_info=None) -> dict:
    """All per-example metrics. For srt / srt-p, H^ is the set of Eq. (6) (reward.py): the history
    labels their <HIS> tags matched plus one '?...' element per distinct tag that matched nothing,
    so a hallucinated recall costs precision and Jaccard exactly as it costs the recall reward."""
    answer = final_answer(method, completion)
    row = {"final_answer": answer, "f1": f1_score(answer, record["answer"]),
           "accuracy": accuracy(answer, record)}
    if reward_info is not None:
        unmatched = dict.fromkeys(reward.unmatched_key(t) for t in reward_info["unmatched"])
        recalled = list(reward_info["recalled"]) + list(unmatched)
        row.update({"format_valid": float(reward.is_valid_format(completion)),
                    "reward_format": reward_info["format"], "reward_recall": reward_info["recall"],
                    "reward_answer": reward_info["answer"], "reward_total": reward_info["total"]})
    row["recalled"] = recalled
    if recalled is None:  # full history: no recalled set, no taxonomy
        row.update({"precision": None, "recall": None, "jaccard": None, "error_type": None})
    else:
        row.update(recall_metrics(recalled, record["recall"]))
        row["error_type"] = None if row["accuracy"] else error_type(recalled, record["recall"])
    return row


# --------------------------------------------------------------------------------------------
# One variant (NAME=METHOD:MODEL) over the selected records, appended per batch, resumable
# --------------------------------------------------------------------------------------------
def read_rows(path) -> dict:
    """Rows already written, by id; a line cut short by a killed run is ignored (and redone)."""
    rows = {}
    if Path(path).exists():
        for line in Path(path).read_text(encoding="utf-8").splitlines():
            try:
                row = json.loads(line)
            except json.JSONDecodeError:
                continue
            if isinstance(row, dict) and "id" in row:
                rows[row["id"]] = row
    return rows


def append_rows(path, rows) -> None:
    with open(path, "a", encoding="utf-8") as f:
        f.write("".join(json.dumps(r, ensure_ascii=False) + "\n" for r in rows))
        f.flush()
        os.fsync(f.fileno())


def ask(client, messages) -> str:
    try:
        return client.chat(messages)
    except RuntimeError as e:  # ChatClient already retried; what was answered so far is on disk
        sys.exit(f"error: {e} (rerun with --resume to continue)")


def method_options(args) -> dict:
    return {"recency_k": args.recency_k, "rag_k": args.rag_k, "cuemem_options": args.cuemem_options}


def evaluate_variant(variant, records, out_dir, args, model=None, tokenizer=None, client=None) -> list[dict]:
    """Answer every record with one variant and write <out>/<name>.jsonl. Latency is end to end per
    answer: this example's prompt build (retrieval included) + its share of the batch's generation
    wall time (batch wall / batch size) + parsing."""
    name, method = variant["name"], variant["method"]
    path = Path(out_dir) / f"{name}.jsonl"
    done = read_rows(path) if args.resume else {}
    if not args.resume:
        atomic_write_text(path, "")
    elif done:  # rewrite without any cut-short line, so appends start on a fresh line
        atomic_write_text(path, "".join(json.dumps(r, ensure_ascii=False) + "\n" for r in done.values()))
    pending = [r for r in records if r["id"] not in done]
    # Similar lengths in one batch waste less padding.
    pending.sort(key=lambda r: sum(len(t["text"]) for t in r["history"]))
    options = method_options(args)
    max_new = args.max_new_tokens if method in SELF_RECALL_METHODS else args.max_new_tokens_direct
    batch_size = 1 if client is not None else args.batch_size
    autocast_dtype = resolve_dtype(args.dtype, model.device)[1] if model is not None else None
    if client is not None:
        client.max_tokens = max_new
    if method in ("rag", "cuemem"):
        load_embedder()  # a one-time load, not part of any answer's latency

    from tqdm import tqdm
    progress = tqdm(total=len(records), initial=len(records) - len(pending), desc=name, unit="ex",
                    disable=args.quiet)
    for start in range(0, len(pending), batch_size):
        batch = pending[start:start + batch_size]
        built, build_s = [], []
        for record in batch:
            t0 = time.perf_counter()
            messages, recalled = method_input(method, record, options)
            prompt = render_chat(tokenizer, messages) if client is None else None
            built.append((messages, prompt, recalled))
            build_s.append(time.perf_counter() - t0)
        t0 = time.perf_counter()
        if client is None:
            outputs = generate_batch(model, tokenizer, [p for _, p, _ in built], max_new, autocast_dtype)
        else:  # an API reports no token counts through ChatClient
            outputs = [{"text": ask(client, m), "input_tokens": None, "generated_tokens": None}
                       for m, _, _ in built]
        generate_share = (time.perf_counter() - t0) / len(batch)
        rewards = None
        if method in SELF_RECALL_METHODS:  # Eqs. (4)-(7), batched embedding; not part of latency
            rewards = reward.compute_rewards([o["text"] for o in outputs], batch)
        rows = []
        for i, (record, output) in enumerate(zip(batch, outputs)):
            t0 = time.perf_counter()
            final_answer(method, output["text"])  # the parse an application would run
            parse_s = time.perf_counter() - t0
            scores = score_prediction(method, record, output["text"], built[i][2],
                                       rewards[i] if rewards else None)
            rows.append({"id": record["id"], "name": name, "method": method, "model": variant["model"],
                         "num_turns": num_turns(record), "bucket": bucket_of(num_turns(record)),
                         "completion": output["text"], "reference": record["answer"],
                         "gold_recall": record["recall"], **scores,
                         "latency_s": build_s[i] + generate_share + parse_s,
                         "input_tokens": output["input_tokens"],
                         "generated_tokens": output["generated_tokens"], "batch_size": len(batch)})
        append_rows(path, rows)
        progress.update(len(batch))
    progress.close()
    rows = read_rows(path)
    return [rows[r["id"]] for r in records if r["id"] in rows]


# --------------------------------------------------------------------------------------------
# §4.6 attention analysis (Fig. 3): attention mass from answer tokens onto each history turn
# --------------------------------------------------------------------------------------------
@torch.inference_mode()
def attention_share(model, tokenizer, prompt_text: str, completion_text: str, spans) -> np.ndarray:
    """Share of attention mass flowing from the answer tokens (the completion after its last
    'Final answer:', or the whole completion without one) onto each span, averaged over answer
    tokens, heads and layers. spans[j] is a list of (start, end) character ranges in
    prompt_text + completion_text, e.g. a turn's line in the prompt and its <HIS> copy in the
    completion. Every value lies in [0, 1], and for disjoint spans they sum to at most 1.

    Attention weights exist only in the eager implementation, so the model is switched to
    attn_implementation="eager" for this forward pass (output_attentions=True) and switched back
    afterwards; no second copy of the weights is loaded. The text is tokenized piece by piece
    between span boundaries so that every token belongs to exactly one piece."""
    text = prompt_text + completion_text
    cut = completion_text.rfind("Final answer:")
    answer_start = len(prompt_text) + (cut + len("Final answer:") if cut >= 0 else 0)
    bounds = sorted({0, len(text), answer_start} | {b for ranges in spans for r in ranges for b in r})
    ids, starts = [], []
    for a, b in zip(bounds, bounds[1:]):
        piece = tokenizer(text[a:b], add_special_tokens=False)["input_ids"]
        ids += piece
        starts += [a] * len(piece)
    starts = np.array(starts)
    rows = torch.from_numpy(np.flatnonzero(starts >= answer_start))
    if len(rows) == 0:  # an empty answer: read the attention of the last token instead
        rows = torch.tensor([len(ids) - 1])

    def tokens_in(ranges):
        inside = np.zeros(len(ids), dtype=bool)
        for s, e in ranges:
            inside |= (starts >= s) & (starts < e)
        return torch.from_numpy(np.flatnonzero(inside))
    columns = [tokens_in(ranges) for ranges in spans]
    previous = model.config._attn_implementation
    model.set_attn_implementation("eager")
    try:
        output = model(input_ids=torch.tensor([ids], device=model.device), output_attentions=True)
    finally:
        model.set_attn_implementation(previous)
    share = np.zeros(len(spans))
    for layer in output.attentions:  # (1, heads, T, T); each row sums to 1 over keys
        from_answer = layer[0][:, rows.to(layer.device), :].float()
        for j, cols in enumerate(columns):
            if len(cols):
                share[j] += from_answer[:, :, cols.to(layer.device)].sum(-1).mean().item()
    return np.clip(share / len(output.attentions), 0.0, 1.0)


HIS_TAG = re.compile(r"<HIS>\s*([QA]\d+)\s*:(.*?)</HIS>", re.S)


def turn_spans(record, prompt_text: str, completion_text: str) -> list[list[tuple[int, int]]]:
    """For each history turn: where its line sits in the prompt, plus every <HIS> tag of the
    completion that names its label (offsets in prompt_text + completion_text)."""
    spans, cursor = [], 0
    for turn in record["history"]:
        line = f"{turn['label']}: {turn['text']}"
        at = prompt_text.find(line, cursor)
        ranges = [] if at < 0 else [(at, at + len(line))]
        cursor = cursor if at < 0 else at + len(line)
        spans.append(ranges)
    index = {turn["label"]: j for j, turn in enumerate(record["history"])}
    for match in HIS_TAG.finditer(completion_text):
        if match.group(1) in index:
            spans[index[match.group(1)]].append((len(prompt_text) + match.start(),
                                                 len(prompt_text) + match.end()))
    return spans


def attention_analysis(model, tokenizer, method, rows, records_by_id, n_examples, options) -> list[dict]:
    """Fig. 3: the per-turn attention share of the answer tokens when the model answers after
    recalling (its own chain; the reference chain Z_t where it recalled nothing) against the same
    answer written right after the same prompt, without recall. Examples: records with a non-empty
    H*, longest dialogues first, those whose completion recalls and answers first. Memory:
    output_attentions keeps layers x heads x T x T floats, ~2.5 GB for SmolLM2-135M at T = 1500."""
    def own_chain(row):
        return bool(HIS_TAG.search(row["completion"])) and bool(final_answer("srt", row["completion"]))
    candidates = sorted((r for r in rows if records_by_id[r["id"]]["recall"]),
                        key=lambda r: (not own_chain(r), -r["num_turns"], r["id"]))
    results = []
    for row in candidates[:n_examples]:
        record = records_by_id[row["id"]]
        messages, _ = method_input(method, record, options)
        prompt = render_chat(tokenizer, messages)
        from_model = own_chain(row)
        chain = row["completion"] if from_model else format_target(record)
        answer = final_answer("srt", chain)
        settings = {"no_recall": f"Final answer: {answer}", "self_recall": chain}
        entry = {"id": record["id"], "num_turns": row["num_turns"], "chain": "model" if from_model else "reference",
                 "turns": [t["label"] for t in record["history"]], "gold": record["recall"]}
        for setting, completion in settings.items():
            share = attention_share(model, tokenizer, prompt, completion, turn_spans(record, prompt, completion))
            entry[setting] = share.tolist()
            total = share.sum()
            entry[f"{setting}_on_gold"] = float(sum(s for t, s in zip(entry["turns"], share)
                                                    if t in record["recall"]) / total) if total > 0 else 0.0
        results.append(entry)
    return results


def table2_mapping(spec, names) -> dict:
    """--table2 "SRT=grpo,w/o RL=sft,..." or, without it, the conventional names that are present."""
    if spec:
        mapping = {}
        for item in spec.split(","):
            row, _, name = item.partition("=")
            if name.strip() not in names:
                sys.exit(f"error: --table2 names {name.strip()!r}, which is not a --compare NAME")
            mapping[row.strip()] = name.strip()
        return mapping
    return {row: next(n for n in guesses if n in names)
            for row, guesses in TABLE2_GUESS.items() if any(n in names for n in guesses)}


def srt_variant_name(variants, table2) -> str | None:
    """Whose errors fill Table 3 and whose attention fills Fig. 3: Table 2's SRT row, else the
    first srt variant, else the first srt-p variant."""
    if "SRT" in table2:
        return table2["SRT"]
    for method in SELF_RECALL_METHODS:
        for v in variants:
            if v["method"] == method:
                return v["name"]
    return None


# --------------------------------------------------------------------------------------------
# Command line
# --------------------------------------------------------------------------------------------
def parse_variants(args) -> list[dict]:
    """--compare NAME=METHOD:MODEL ... (MODEL 'api:NAME' asks the --api-base endpoint), or the
    single --method/--model pair named after the method."""
    if not args.compare:
        model = f"api:{args.api_model}" if args.api_base else args.model
        return [{"name": args.method, "method": args.method, "model": model}]
    variants = []
    for spec in args.compare:
        name, _, rest = spec.partition("=")
        method, _, model = rest.partition(":")
        if not name or not model or method not in METHODS:
            sys.exit(f"error: --compare {spec!r} is not NAME=METHOD:MODEL with METHOD one of "
                             f"{', '.join(METHODS)}")
        if name in {v["name"] for v in variants}:
            sys.exit(f"error: --compare names {name!r} twice")
        variants.append({"name": name, "method": method, "model": model})
    return variants


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter,
                                epilog="Presets: " + "; ".join(f"{k}: {v}" for k, v in PRESETS.items()))
    p.add_argument("--method", choices=METHODS, default="srt")
    p.add_argument("--model", default="smollm2-135m", help="HF id, local folder, smollm2-135m or tiny-random")
    p.add_argument("--data", default="runs/data/test.jsonl")
    p.add_argument("--out", default="runs/demo/eval")
    p.add_argument("--compare", nargs="+", metavar="NAME=METHOD:MODEL",
                   help="evaluate several variants in one report (MODEL 'api:NAME' uses --api-base)")
    p.add_argument("--table2", default=None,
                   help='rows of Table 2, e.g. "SRT=grpo,w/o RL=sft,w/o CoT=nocot,w/o SFT=base-srtp" '
                        "(default: these conventional names where present)")
    p.add_argument("--limit", type=int, default=None,
                   help="evaluate N examples, taken evenly across the 8/16/24/32 buckets (seeded)")
    p.add_argument("--buckets", default=",".join(map(str, FIG4_BUCKETS)),
                   help="length buckets (rounds) of the per-bucket tables and the F1 plot")
    p.add_argument("--batch-size", type=int, default=8, help="prompts per generate call (default: 8)")
    p.add_argument("--max-new-tokens", type=int, default=160, help="for srt / srt-p (default: 160)")
    p.add_argument("--max-new-tokens-direct", type=int, default=48, help="for full / recency / rag / cuemem (default: 48)")
    p.add_argument("--recency-k", type=int, default=4, help="rounds kept by `recency`")
    p.add_argument("--rag-k", type=int, default=4, help="utterances retrieved by `rag`")
    p.add_argument("--cuemem-options", type=json.loads, default={},
                   help="JSON keyword arguments for cuemem.cuemem_evidence")
    p.add_argument("--attention-examples", type=int, default=2,
                   help="examples in the §4.6 attention analysis (0 turns it off)")
    p.add_argument("--api-base", default=None, help="OpenAI-compatible endpoint, e.g. https://api.openai.com/v1")
    p.add_argument("--api-model", default=None)
    p.add_argument("--api-key-env", default="OPENAI_API_KEY", help="environment variable holding the key")
    p.add_argument("--dtype", default="auto", choices=["auto", "float32", "bfloat16"])
    p.add_argument("--device", default=None, help="default: cuda when available, else cpu")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--resume", action="store_true", help="skip examples already in <out>/<name>.jsonl")
    p.add_argument("--quiet", action="store_true", help="no progress bars")
    return p


def resolve_config(argv=None) -> argparse.Namespace:
    """Flags over the --preset over the defaults; every value checked before any work is done."""
    args = parse_config(build_parser(), PRESETS, argv)
    try:
        args.buckets = tuple(sorted({int(b) for b in args.buckets.split(",")}))
    except ValueError:
        sys.exit(f"error: --buckets {args.buckets!r} is not a comma-separated list of integers")
    if args.batch_size < 1:
        sys.exit("error: --batch-size must be at least 1")
    if args.api_base and not args.compare and not args.api_model:
        sys.exit("error: --api-base needs --api-model")
    args.device = args.device or ("cuda" if torch.cuda.is_available() else "cpu")
    args.variants = parse_variants(args)
    if any(v["model"].startswith("api:") for v in args.variants) and not args.api_base:
        sys.exit("error: a model 'api:NAME' needs --api-base")
    for v in args.variants:
        v["batch_size"] = 1 if v["model"].startswith("api:") else args.batch_size
    return args


def main(argv=None) -> None:
    args = resolve_config(argv)
    variants = args.variants
    try:
        records = read_jsonl(args.data)
    except (DataError, OSError) as e:
        sys.exit(f"error: {e}")
    random.seed(args.seed)
    torch.manual_seed(args.seed)
    records = select_examples(records, args.limit, args.seed)
    out_dir = Path(args.out)
    out_dir.mkdir(parents=True, exist_ok=True)
    config = {k: (list(v) if isinstance(v, tuple) else v) for k, v in vars(args).items()}
    write_config(out_dir, config)

    names = [v["name"] for v in variants]
    table2 = table2_mapping(args.table2, names)
    srt_name = srt_variant_name(variants, table2)
    records_by_id = {r["id"]: r for r in records}
    rows_by_name, attention = {}, []
    # Load each distinct model once, run every variant that uses it, free it before the next.
    for model_name in dict.fromkeys(v["model"] for v in variants):
        group = [v for v in variants if v["model"] == model_name]
        model = tokenizer = client = None
        if model_name.startswith("api:"):
            client = ChatClient(args.api_base, model_name[4:], key_env=args.api_key_env,
                                max_tokens=max(args.max_new_tokens, args.max_new_tokens_direct))
        else:
            model, tokenizer = load_model_and_tokenizer(model_name, dtype=args.dtype, device=args.device)
        for variant in group:
            rows_by_name[variant["name"]] = evaluate_variant(variant, records, out_dir, args,
                                                              model, tokenizer, client)
            if variant["name"] == srt_name and model is not None and args.attention_examples > 0:
                attention = attention_analysis(model, tokenizer, variant["method"], rows_by_name[srt_name],
                                               records_by_id, args.attention_examples, method_options(args))
        del model, tokenizer
        gc.collect()
        if torch.cuda.is_available():
            torch.cuda.empty_cache()

    summary = {"num_examples": len(records), "fine_buckets": list(args.buckets), "table2": table2,
               "srt_variant": srt_name, "config": config, "attention": attention,
               "variants": {v["name"]: report.summarize_variant(v, rows_by_name[v["name"]], args.buckets)
                            for v in variants}}
    path = report.write_outputs(summary, out_dir)
    print(report.table1(summary))
    print(f"\nreport: {path}")


if __name__ == "__main__":
    main()
