"""Evaluation of SRT and its baselines (paper §4).

    records -> stratified selection -> one answer per record and method -> metrics
            -> <out>/<name>.jsonl, summary.json, report.md (Tables 1-3), PNG plots (Figs. 3-4)

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
import string
import time
from collections import Counter
from pathlib import Path

import matplotlib
import numpy as np
import torch

matplotlib.use("Agg")  # plots are files; no display needed

import cuemem
import reward
from stage0_build import (BUCKETS, SRT_SYSTEM_PROMPT, ChatClient, DataError,
                          atomic_write_text, bucket_of, build_messages, format_target,
                          read_jsonl, render_prompt, write_json)
from modeling import CHATML_TEMPLATE, autocast, embed, load_embedder, load_model_and_tokenizer, resolve_dtype

METHODS = ("full", "recency", "rag", "srt-p", "srt", "cuemem")
SELF_RECALL_METHODS = ("srt", "srt-p")          # the model writes <HIS> tags itself
FIG4_BUCKETS = tuple(range(8, 33, 4))           # 8, 12, ..., 32 rounds (Fig. 4)
ERROR_TYPES = ("Missing Recall", "Over Recall", "Wrong Recall", "Failure Answer")  # Table 3 rows
TABLE2_ROWS = ("SRT", "w/o RL", "w/o CoT", "w/o SFT")
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
DEFAULTS = {"limit": None, "batch_size": 8, "max_new_tokens": 160, "max_new_tokens_direct": 48,
            "attention_examples": 2}


# --------------------------------------------------------------------------------------------
# Answer metrics (Table 1: F1; Table 2: accuracy)
# --------------------------------------------------------------------------------------------
def normalize_answer(text: str) -> str:
    """SQuAD normalization: lowercase, drop punctuation and the articles a/an/the, squeeze spaces."""
    text = text.lower()
    text = "".join(ch for ch in text if ch not in set(string.punctuation))
    text = re.sub(r"\b(a|an|the)\b", " ", text)
    return " ".join(text.split())


def f1_score(prediction: str, reference: str) -> float:
    """SQuAD token F1: harmonic mean of token precision and recall over the bag of normalized tokens.
    When either side normalizes to nothing, F1 is 1 if both do and 0 otherwise."""
    pred, ref = normalize_answer(prediction).split(), normalize_answer(reference).split()
    if not pred or not ref:
        return float(pred == ref)
    common = sum((Counter(pred) & Counter(ref)).values())
    if common == 0:
        return 0.0
    precision, recall = common / len(pred), common / len(ref)
    return 2 * precision * recall / (precision + recall)


def _contains(haystack: str, needle: str) -> bool:
    """Whole-token containment of normalized text: 'yes' is in 'yes it is', not in 'yesterday'."""
    return f" {needle} " in f" {haystack} "


def accuracy(prediction: str, record: dict) -> float:
    """1 if every answer key is present in the normalized prediction; a record without keys needs
    the normalized reference answer contained instead."""
    pred = normalize_answer(prediction)
    keys = [k for k in (normalize_answer(k) for k in record.get("answer_keys") or []) if k]
    if not keys:
        keys = [normalize_answer(record["answer"])]
    return float(all(_contains(pred, k) for k in keys))


def final_answer(method: str, completion: str) -> str:
    """The text after 'Final answer:' (reward.parse_completion). Direct methods that omit the
    prefix answer with their whole output; a self-recall chain without it has no answer."""
    answer = reward.parse_completion(completion).final_answer
    if answer is not None:
        return answer
    return "" if method in SELF_RECALL_METHODS else completion.strip()


# --------------------------------------------------------------------------------------------
# Recall metrics and the error taxonomy (Table 2, Table 3)
# --------------------------------------------------------------------------------------------
def recall_metrics(recalled, gold) -> dict:
    """Precision, recall and Jaccard of H^ against H*, with the conventions of cuemem.py and of
    the recall reward: an empty H^ is fully precise (it claims nothing false), an empty H* is fully
    recalled (nothing could be missed), and both empty is Jaccard 1."""
    recalled, gold = set(recalled), set(gold)
    hit = len(recalled & gold)
    return {"precision": hit / len(recalled) if recalled else 1.0,
            "recall": hit / len(gold) if gold else 1.0,
            "jaccard": reward.jaccard(recalled, gold)}


def error_type(recalled, gold) -> str:
    """Table 3 taxonomy of a wrong answer, tested in this order (DESIGN.md):
    H^ = H* -> Failure Answer; H* a proper subset of H^ -> Over Recall;
    H^ \\ H* non-empty -> Wrong Recall; otherwise (H^ a proper subset of H*) -> Missing Recall."""
    recalled, gold = set(recalled), set(gold)
    if recalled == gold:
        return "Failure Answer"
    if gold < recalled:
        return "Over Recall"
    if recalled - gold:
        return "Wrong Recall"
    return "Missing Recall"


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


def method_input(method: str, record: dict, options: dict) -> tuple[list[dict], dict, list | None]:
    """-> (chat messages, render arguments for stage0's render_prompt or None, recalled labels).
    The recalled set of rag, recency and cuemem is what they selected; srt and srt-p recall by
    writing <HIS> tags (parsed later); full recalls nothing (its recall metrics are null)."""
    if method == "full":
        render = {"system": DIRECT_SYSTEM_PROMPT}
        return build_messages(record, **render), render, None
    if method in ("recency", "rag"):
        keep = (recency_turns(record, options["recency_k"]) if method == "recency"
                else rag_turns(record, options["rag_k"]))
        render = {"system": DIRECT_SYSTEM_PROMPT, "keep": set(keep)}
        return build_messages(record, **render), render, keep
    if method == "srt-p":
        render = {"system": SRTP_SYSTEM_PROMPT}
        return build_messages(record, **render), render, None
    if method == "srt":
        return build_messages(record), {}, None  # exactly the prompt SFT and GRPO trained on
    if method == "cuemem":
        evidence = list(cuemem.cuemem_evidence(record, **options["cuemem_options"]))
        return cuemem.build_answer_messages(record, evidence), None, evidence
    raise ValueError(f"unknown method {method!r}; choose from {', '.join(METHODS)}")


def render_input(tokenizer, record, messages, render) -> str:
    """The prompt text through the model's own chat template (ChatML when it has none)."""
    if render is not None:
        return render_prompt(tokenizer, record, **render)
    template = None if getattr(tokenizer, "chat_template", None) else CHATML_TEMPLATE
    return tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True,
                                         chat_template=template)


# --------------------------------------------------------------------------------------------
# Generation: greedy, batched with left padding, stopping at <|im_end|> / eos
# --------------------------------------------------------------------------------------------
def stop_ids(model, tokenizer) -> list[int]:
    ids = model.generation_config.eos_token_id
    ids = [] if ids is None else ([ids] if isinstance(ids, int) else list(ids))
    return list(dict.fromkeys(ids + [tokenizer.eos_token_id]))


@torch.inference_mode()
def generate_batch(model, tokenizer, prompts, max_new_tokens, autocast_dtype=None) -> list[dict]:
    """Greedy completions of a batch of prompt texts -> [{text, input_tokens, generated_tokens}].
    The prompt text already holds the chat template's special tokens, so none are added."""
    from transformers import GenerationConfig
    tokenizer.padding_side = "left"  # every row must end where generation starts
    batch = tokenizer(prompts, return_tensors="pt", padding=True, add_special_tokens=False).to(model.device)
    stops = stop_ids(model, tokenizer)
    config = GenerationConfig(max_new_tokens=max_new_tokens, do_sample=False, eos_token_id=stops,
                              pad_token_id=tokenizer.pad_token_id)
    with autocast(model.device, autocast_dtype):
        output = model.generate(**batch, generation_config=config)
    new_tokens = output[:, batch["input_ids"].shape[1]:].tolist()
    results = []
    for ids, n_input in zip(new_tokens, batch["attention_mask"].sum(dim=1).tolist()):
        # Rows that stopped early are padded to the longest row; count up to the first stop token.
        length = next((i + 1 for i, t in enumerate(ids) if t in stops), len(ids))
        results.append({"text": tokenizer.decode(ids[:length], skip_special_tokens=True),
                        "input_tokens": int(n_input), "generated_tokens": length})
    return results


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
        raise SystemExit(f"error: {e} (rerun with --resume to continue)")


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
            messages, render, recalled = method_input(method, record, options)
            prompt = render_input(tokenizer, record, messages, render) if client is None else None
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
            metrics = score_prediction(method, record, output["text"], built[i][2],
                                       rewards[i] if rewards else None)
            rows.append({"id": record["id"], "name": name, "method": method, "model": variant["model"],
                         "num_turns": num_turns(record), "bucket": bucket_of(num_turns(record)),
                         "completion": output["text"], "reference": record["answer"],
                         "gold_recall": record["recall"], **metrics,
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
        messages, render, _ = method_input(method, record, options)
        prompt = render_input(tokenizer, record, messages, render)
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


# --------------------------------------------------------------------------------------------
# Aggregation: summary.json
# --------------------------------------------------------------------------------------------
METRICS = ("f1", "accuracy", "precision", "recall", "jaccard", "format_valid",
           "reward_format", "reward_recall", "reward_answer", "reward_total")


def describe(values) -> dict | None:
    values = [v for v in values if v is not None]
    if not values:
        return None
    return {"mean": float(np.mean(values)), "p50": float(np.percentile(values, 50)),
            "p90": float(np.percentile(values, 90)), "n": len(values)}


def mean_metrics(rows) -> dict:
    out = {"n": len(rows)}
    for metric in METRICS:
        values = [r[metric] for r in rows if r.get(metric) is not None]
        out[metric] = float(np.mean(values)) if values else None
    return out


def error_counts(rows) -> dict:
    counts = Counter(r["error_type"] for r in rows if r.get("error_type"))
    return {kind: counts.get(kind, 0) for kind in ERROR_TYPES}


def summarize_variant(variant, rows, fine_buckets) -> dict:
    summary = {"method": variant["method"], "model": variant["model"], **mean_metrics(rows),
               "latency_s": describe(r["latency_s"] for r in rows),
               "input_tokens": describe(r["input_tokens"] for r in rows),
               "generated_tokens": describe(r["generated_tokens"] for r in rows),
               "by_bucket": {}, "errors_by_bucket": {}}
    for b in fine_buckets:
        members = [r for r in rows if bucket_of(r["num_turns"], fine_buckets) == b]
        summary["by_bucket"][str(b)] = mean_metrics(members)
    # Fig. 4's "multi-turn buckets (k >= 24)", read off the same bucketing as the columns.
    long_rows = [r for r in rows if bucket_of(r["num_turns"], fine_buckets) >= 24]
    summary["by_bucket"][">=24"] = mean_metrics(long_rows)
    for b in BUCKETS:
        summary["errors_by_bucket"][str(b)] = error_counts([r for r in rows if r["bucket"] == b])
    return summary


def table2_mapping(spec, names) -> dict:
    """--table2 "SRT=grpo,w/o RL=sft,..." or, without it, the conventional names that are present."""
    if spec:
        mapping = {}
        for item in spec.split(","):
            row, _, name = item.partition("=")
            if name.strip() not in names:
                raise SystemExit(f"error: --table2 names {name.strip()!r}, which is not a --compare NAME")
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
# Report: Tables 1-3, per-bucket tables, plots
# --------------------------------------------------------------------------------------------
def _pct(x):
    return "-" if x is None else f"{100 * x:.1f}"


def _num(x, digits=2):
    return "-" if x is None else f"{x:.{digits}f}"


def _stat(d, key="mean", digits=2):
    return "-" if d is None else f"{d[key]:.{digits}f}"


def table1(summary) -> str:
    lines = ["| Method | Variant | F1 | Acc. (%) | Latency mean (s) | p50 | p90 | Input tokens | Generated tokens |",
             "|---|---|---|---|---|---|---|---|---|"]
    for name, s in summary["variants"].items():
        lines.append(f"| {s['method']} | {name} | {_pct(s['f1'])} | {_pct(s['accuracy'])} | "
                     f"{_stat(s['latency_s'])} | {_stat(s['latency_s'], 'p50')} | {_stat(s['latency_s'], 'p90')} | "
                     f"{_stat(s['input_tokens'], digits=0)} | {_stat(s['generated_tokens'], digits=0)} |")
    return "\n".join(lines)


def table2(summary) -> str:
    lines = ["| Variant | Name | Recall (%) | Acc. (%) | Jaccard (%) |", "|---|---|---|---|---|"]
    for row in TABLE2_ROWS:
        name = summary["table2"].get(row)
        if name in summary["variants"]:
            s = summary["variants"][name]
            lines.append(f"| {row} | {name} | {_pct(s['recall'])} | {_pct(s['accuracy'])} | {_pct(s['jaccard'])} |")
    return "\n".join(lines)


def table3(summary) -> str:
    name = summary["srt_variant"]
    header = "| Error type | " + " | ".join(str(b) for b in BUCKETS) + " |"
    lines = [header, "|---|" + "---|" * len(BUCKETS)]
    if name is None:
        return "(no srt or srt-p variant was evaluated)"
    errors = summary["variants"][name]["errors_by_bucket"]
    totals = {b: sum(errors[str(b)].values()) for b in BUCKETS}
    for kind in ERROR_TYPES:
        cells = [f"{100 * errors[str(b)][kind] / totals[b]:.1f}%" if totals[b] else "-" for b in BUCKETS]
        lines.append(f"| {kind} | " + " | ".join(cells) + " |")
    lines.append("| wrong answers (n) | " + " | ".join(str(totals[b]) for b in BUCKETS) + " |")
    return "\n".join(lines)


def bucket_table(summary, metric) -> str:
    keys = [str(b) for b in summary["fine_buckets"]] + [">=24"]
    lines = ["| Variant | " + " | ".join(keys) + " |", "|---|" + "---|" * len(keys)]
    for name, s in summary["variants"].items():
        cells = [_pct(s["by_bucket"][k][metric]) for k in keys]
        lines.append(f"| {name} | " + " | ".join(cells) + " |")
    counts = [str(next(iter(summary["variants"].values()))["by_bucket"][k]["n"]) for k in keys]
    lines.append("| examples (n) | " + " | ".join(counts) + " |")
    return "\n".join(lines)


def recall_table(summary) -> str:
    lines = ["| Variant | Precision (%) | Recall (%) | Jaccard (%) | Format valid (%) | R_format | R_recall | R_answer | R total |",
             "|---|---|---|---|---|---|---|---|---|"]
    for name, s in summary["variants"].items():
        lines.append(f"| {name} | {_pct(s['precision'])} | {_pct(s['recall'])} | {_pct(s['jaccard'])} | "
                     f"{_pct(s['format_valid'])} | {_num(s['reward_format'])} | {_num(s['reward_recall'])} | "
                     f"{_num(s['reward_answer'])} | {_num(s['reward_total'])} |")
    return "\n".join(lines)


def attention_table(summary) -> str:
    lines = ["| Example | Turns | Chain | Share on H* without recall (%) | Share on H* with self-recall (%) |",
             "|---|---|---|---|---|"]
    for e in summary["attention"]:
        lines.append(f"| {e['id']} | {e['num_turns']} | {e['chain']} | {_pct(e['no_recall_on_gold'])} | "
                     f"{_pct(e['self_recall_on_gold'])} |")
    return "\n".join(lines)


def write_report(summary, out_dir, plots) -> Path:
    batched = any(v["batch_size"] > 1 for v in summary["config"]["variants"] if v["model"] != "api")
    parts = [
        "# SRT evaluation report",
        f"Data: `{summary['config']['data']}`, {summary['num_examples']} examples "
        f"(stratified over the 8/16/24/32-round buckets when limited; seed {summary['config']['seed']}).",
        "## Table 1: F1 and end-to-end latency",
        table1(summary),
        "Latency is wall seconds per answer end to end: prompt build (retrieval included) + generation + parsing."
        + (" Generation is batched: each answer is charged the batch's wall time divided by the batch size."
           if batched else ""),
        "## Table 2: ablations (Recall = |H^ ∩ H*| / |H*|; Acc. = all answer keys present)",
        table2(summary) if summary["table2"] else "(no Table 2 variants; name them with --table2)",
        f"## Table 3: error types of wrong answers per dialogue length ({summary['srt_variant'] or 'n/a'})",
        table3(summary),
        "## F1 by dialogue length (rounds; Fig. 4 buckets)",
        bucket_table(summary, "f1"),
        "## Accuracy by dialogue length",
        bucket_table(summary, "accuracy"),
        "## Recall Jaccard by dialogue length",
        bucket_table(summary, "jaccard"),
        "## Recall, format validity and reward components (Eqs. (4)-(7))",
        recall_table(summary),
    ]
    if summary["attention"]:
        parts += [f"## Attention analysis (§4.6, {summary['srt_variant']})", attention_table(summary),
                  "Share of the answer tokens' attention (averaged over layers and heads) on the turns of H*, "
                  "normalized over all history turns."]
    parts += ["## Plots"] + [f"![{Path(p).stem}]({Path(p).name})" for p in plots]
    path = Path(out_dir) / "report.md"
    atomic_write_text(path, "\n\n".join(parts) + "\n")
    return path


def _save_figure(fig, path) -> Path:
    tmp = Path(path).with_name(f".{Path(path).name}.tmp.png")
    fig.savefig(tmp, dpi=110, bbox_inches="tight")
    os.replace(tmp, path)
    return Path(path)


def plot_f1_by_length(summary, path) -> Path:
    import matplotlib.pyplot as plt
    fig, ax = plt.subplots(figsize=(6.5, 4))
    for name, s in summary["variants"].items():
        xs = [b for b in summary["fine_buckets"] if s["by_bucket"][str(b)]["f1"] is not None]
        ax.plot(xs, [100 * s["by_bucket"][str(b)]["f1"] for b in xs], marker="o", label=name)
    ax.set(xlabel="dialogue length (rounds)", ylabel="F1", xticks=list(summary["fine_buckets"]), ylim=(0, 100),
           title="F1 against dialogue length")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    path = _save_figure(fig, path)
    plt.close(fig)
    return path


def plot_error_types(summary, path) -> Path:
    import matplotlib.pyplot as plt
    fig, ax = plt.subplots(figsize=(6, 4))
    name = summary["srt_variant"]
    errors = summary["variants"][name]["errors_by_bucket"] if name else {}
    bottom = np.zeros(len(BUCKETS))
    for kind in ERROR_TYPES:
        totals = [sum(errors.get(str(b), {}).values()) for b in BUCKETS]
        shares = np.array([100 * errors[str(b)][kind] / t if t else 0.0 for b, t in zip(BUCKETS, totals)])
        ax.bar([str(b) for b in BUCKETS], shares, bottom=bottom, label=kind)
        bottom += shares
    for x, b in enumerate(BUCKETS):
        ax.text(x, 101, f"n={sum(errors.get(str(b), {}).values())}", ha="center", va="bottom", fontsize=8)
    ax.set(xlabel="dialogue length (rounds)", ylabel="share of wrong answers (%)", ylim=(0, 100),
           title=f"Error types per length bucket ({name or 'n/a'})\n")
    ax.legend(fontsize=8, loc="upper right")
    path = _save_figure(fig, path)
    plt.close(fig)
    return path


def plot_attention(attention, path) -> Path:
    """Fig. 3 as heat maps: one panel per example, rows = without recall / with self-recall, columns =
    history turns, values = attention share normalized per row; the turns of H* are marked in red."""
    import matplotlib.pyplot as plt
    fig, axes = plt.subplots(len(attention), 1, figsize=(max(6, 0.22 * max(len(e["turns"]) for e in attention)),
                                                         1.6 * len(attention) + 0.6), squeeze=False)
    for ax, e in zip(axes[:, 0], attention):
        grid = np.array([e["no_recall"], e["self_recall"]], dtype=float)
        grid = grid / np.maximum(grid.sum(axis=1, keepdims=True), 1e-12)
        image = ax.imshow(grid, aspect="auto", cmap="viridis", vmin=0)
        ax.set_yticks([0, 1], ["no recall", "self-recall"])
        ax.set_xticks(range(len(e["turns"])), e["turns"], rotation=90, fontsize=6)
        for tick, label in zip(ax.get_xticklabels(), e["turns"]):
            if label in e["gold"]:
                tick.set_color("red")
        ax.set_title(f"{e['id']} ({e['num_turns']} rounds, {e['chain']} chain)", fontsize=8)
        fig.colorbar(image, ax=ax, fraction=0.02)
    path = _save_figure(fig, path)
    plt.close(fig)
    return path


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
            raise SystemExit(f"error: --compare {spec!r} is not NAME=METHOD:MODEL with METHOD one of "
                             f"{', '.join(METHODS)}")
        if name in {v["name"] for v in variants}:
            raise SystemExit(f"error: --compare names {name!r} twice")
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
    p.add_argument("--preset", choices=sorted(PRESETS))
    p.add_argument("--limit", type=int, default=None,
                   help="evaluate N examples, taken evenly across the 8/16/24/32 buckets (seeded)")
    p.add_argument("--buckets", default=",".join(map(str, FIG4_BUCKETS)),
                   help="length buckets (rounds) of the per-bucket tables and the F1 plot")
    p.add_argument("--batch-size", type=int, default=None)
    p.add_argument("--max-new-tokens", type=int, default=None, help="for srt / srt-p (default 160)")
    p.add_argument("--max-new-tokens-direct", type=int, default=None,
                   help="for full / recency / rag / cuemem (default 48)")
    p.add_argument("--recency-k", type=int, default=4, help="rounds kept by `recency`")
    p.add_argument("--rag-k", type=int, default=4, help="utterances retrieved by `rag`")
    p.add_argument("--cuemem-options", type=json.loads, default={},
                   help="JSON keyword arguments for cuemem.cuemem_evidence")
    p.add_argument("--attention-examples", type=int, default=None,
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


def resolve_config(args) -> argparse.Namespace:
    preset = PRESETS.get(args.preset, {})
    for key, default in DEFAULTS.items():
        if getattr(args, key) is None:
            setattr(args, key, preset.get(key, default))
    try:
        args.buckets = tuple(sorted({int(b) for b in args.buckets.split(",")}))
    except ValueError:
        raise SystemExit(f"error: --buckets {args.buckets!r} is not a comma-separated list of integers")
    if args.batch_size < 1:
        raise SystemExit("error: --batch-size must be at least 1")
    args.device = args.device or ("cuda" if torch.cuda.is_available() else "cpu")
    return args


def main(argv=None) -> dict:
    args = resolve_config(build_parser().parse_args(argv))
    variants = parse_variants(args)
    if any(v["model"].startswith("api:") for v in variants) and not args.api_base:
        raise SystemExit("error: a model 'api:NAME' needs --api-base")
    if args.api_base and not args.compare and not args.api_model:
        raise SystemExit("error: --api-base needs --api-model")
    try:
        records = read_jsonl(args.data)
    except (DataError, OSError) as e:
        raise SystemExit(f"error: {e}")
    random.seed(args.seed)
    torch.manual_seed(args.seed)
    records = select_examples(records, args.limit, args.seed)
    out_dir = Path(args.out)
    out_dir.mkdir(parents=True, exist_ok=True)
    for v in variants:
        v["batch_size"] = 1 if v["model"].startswith("api:") else args.batch_size
    config = {k: (list(v) if isinstance(v, tuple) else v) for k, v in vars(args).items()}
    config["variants"] = variants
    write_json(out_dir / "config.json", config)

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
               "variants": {v["name"]: summarize_variant(v, rows_by_name[v["name"]], args.buckets)
                            for v in variants}}
    plots = [plot_f1_by_length(summary, out_dir / "f1_by_length.png"),
             plot_error_types(summary, out_dir / "error_types.png")]
    if attention:
        plots.append(plot_attention(attention, out_dir / "attention.png"))
    summary["plots"] = [p.name for p in plots]
    write_json(out_dir / "summary.json", summary)
    report = write_report(summary, out_dir, plots)
    print(table1(summary))
    print(f"\nreport: {report}")
    return summary


if __name__ == "__main__":
    main()
