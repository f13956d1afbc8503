"""Evaluation of SRT and its baselines (paper §4).

    records -> stratified selection -> one answer per record and variant (batched: throughput)
            -> a batch-1 latency sample per length bucket after a warm-up (Table 1, Fig. 4)
            -> metrics -> paired intervals against SRT
            -> <out>/<name>.jsonl, <name>.latency.jsonl, summary.json, report.md, PNG plots

The metrics live in metrics.py (shared with cuemem.py and reward.py), the tables and plots in
report.py; this file chooses the examples, builds each method's input, generates, scores.

Methods (`--method`, or METHOD in `--compare NAME=METHOD:MODEL`):
    full     the whole history, a direct answer, no recall (the "full-history" setting)
    recency  the last k rounds only                                   (--recency-k)
    rag      the top-k history turns by embedding similarity, in chronological order (§2.1; --rag-k)
    srt-p    the pluggable self-recall prompt of §4.8: instruction + worked <HIS> example, no training;
             also on an OpenAI-compatible chat API (--api-base, as the paper applies it to closed models)
    srt      a trained checkpoint writing the SRT chain (stage1/stage2 output; also the
             `stage1_sft.py --no-cot` checkpoint, Table 2's "w/o CoT", which answers directly)
    cuemem   CueMem's reconstructed evidence (cuemem.py), answered from the evidence alone

Every method gets the same instruction: answer the current query from the history, newer
information overrides older, reply 'Final answer: ...'. Offline work (RAG's embedding of the
history, CueMem's index build) is timed apart from the query latency (`offline_s`).

The memory a method reads. Where stage 0 wrote the whole conversations beside the records (LoCoMo:
`conversations.jsonl`, `--conversations`), the memory systems (full, recency, rag, cuemem) read the
whole conversation before the question, as they are used: RAG and CueMem retrieve from every
utterance, and full reads the newest part that fits `--max-prompt-tokens`. SRT reads the record's
own window, the prompt it was trained on. A variant's "memory" option ("window" or
"conversation") overrides this; every variant answers the same questions, paired by id.

Saved rows carry the fingerprint of the checkpoint's files and of the evaluation settings, and
the hash of their record: --resume reuses a row only when all three match. A retrained checkpoint
is answered again; a --resume with another setting that changes a row, or with a smaller --limit
that would drop answered rows, is refused instead.

Paper vs this implementation, the one list (docs/pipeline.md links here):

  1. The baselines: the paper's six (RQ-RAG, QRMeM, LD-Agent, Coconut, OPRO, SoftCoT) are not
     reimplemented; the methods above take their place, each on the model --compare names for it.
  2. Accuracy, which the paper does not define, counts an answer right when it states every answer
     key, not denied, and no value the reference and the keys do not hold (srt.metrics
     answer_is_right); F1 is the token F1 of the answer against A*_t; recall is Eq. (6)'s overlap as
     precision, recall and Jaccard on the queries whose H* is not empty.
  3. Every comparison is paired (the same questions) with bootstrap intervals and McNemar's test
     against SRT; the paper reports point values.
  4. Latency is batch-1 end-to-end time on queries of each length bucket after a warm-up, with a
     method's offline work timed apart (offline_s); the paper does not give its set-up.
  5. Table 3's error taxonomy adds "Truncated": a chain cut off by the token limit (srt/metrics.py).

    python evaluate.py --method srt --model runs/demo/grpo/final --data runs/data/test.jsonl \\
        --out runs/demo/eval
    python evaluate.py --preset cpu-table2 --data runs/data/test.jsonl --out runs/demo/eval --resume \\
        --compare full=full:smollm2-135m base-srtp=srt-p:smollm2-135m nocot=srt:runs/demo/sft-nocot/final \\
        sft=srt:runs/demo/sft/final grpo=srt:runs/demo/grpo/final cuemem-cap16=cuemem:smollm2-135m \\
        --variant-options 'cuemem-cap16={"limit": 48, "cuemem": {"capacity": 16}}'

Run `python evaluate.py --help`.
"""

from __future__ import annotations

import srt.startup  # noqa: F401  # isort: skip  (first: Ctrl-C while torch loads is one line)

import argparse
import functools
import gc
import hashlib
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
import reward
from srt import generation, locomo_eval, report
from srt.attention_analysis import attention_analysis
from srt.completion import is_valid_format
from srt.config import (
    MAX_NEW_TOKENS,
    add_api_flags,
    add_batch_size,
    add_data,
    add_limit,
    add_max_new_tokens,
    add_model,
    add_out,
    add_overwrite,
    add_quiet,
    add_resume,
    add_seed,
    at_least,
    changed_settings,
    claim_out,
    interruptible,
    parse_config,
    same_bytes_hint,
    up_to,
    write_config,
)
from srt.data.teacher import ChatClient
from srt.data_io import (
    BUCKETS,
    DataError,
    atomic_write_text,
    bucket_of,
    files_sha256,
    read_lines,
    read_unique_records,
)
from srt.embedder import embed, load_embedder
from srt.loading import (
    check_model_name,
    load_model_and_tokenizer,
    model_fingerprint,  # the sha256 naming a variant's weights (a checkpoint's files' bytes)
)
from srt.metrics import (
    SELF_RECALL_METHODS,
    accuracy,
    answer_keys,
    answer_line,
    distance_bin,
    error_type,
    f1_score,
    final_answer,
    jaccard,
    key_f1,
    keys_affirmed,
    normalize_answer,
    recall_metrics,
    states_several_candidates,
    tag_labels,
)
from srt.precision import add_device, add_dtype, resolve_dtype
from srt.prompt import SRT_SYSTEM_PROMPT, build_messages, format_history, format_target, render_chat
from srt.recall import RECALL_MODES, add_recall_flag

METHODS = ("full", "recency", "rag", "srt-p", "srt", "cuemem")
RETRIEVERS = ("recency", "rag", "cuemem")  # they choose what the model sees
FIG4_BUCKETS = tuple(range(8, 33, 4))  # 8, 12, ..., 32 rounds (Fig. 4)
# Conventional --compare names for Table 2, used when --table2 is not given.
TABLE2_GUESS = {
    "SRT": ("grpo", "srt"),
    "Recall by pointer": ("grpo-copy", "copy"),  # SRT with --recall copy (srt/recall.py)
    "w/o RL": ("sft",),
    "w/o CoT": ("nocot", "sft-nocot"),
    "Recall only": ("recall-only", "sft-recall-only"),
    "No history": ("nohist", "no-history"),
    "w/o SFT": ("base-srtp", "srt-p", "srtp"),
    "Full history": ("full",),
    "RAG": ("rag",),
    "CueMem": ("cuemem",),
}
# Bumped whenever a stored row's scores would change: old rows are then not reused by --resume.
# 4: accuracy and the keys reward fail an answer that states values the reference does not.
# 5: no accuracy or key-F1 without answer keys; LoCoMo's per-category score and evidence recall.
# 6: accuracy and the keys reward fail an answer that states a key only to deny it ("was not $106").
SCORE_VERSION = 6
# Per-variant settings (--variant-options NAME=JSON) and what they override.
VARIANT_KEYS = ("limit", "recency_k", "rag_k", "cuemem", "max_new_tokens", "history", "recall", "memory")
MEMORIES = ("window", "conversation")
MEMORY_METHODS = ("full", "recency", "rag", "cuemem")  # read the whole conversation where there is one
CUEMEM_MEMORY_KEYS = ("extractor", "window", "links_per_cue", "link_threshold", "capacity", "max_age")
CUEMEM_QUERY_KEYS = ("top_k", "use_graph", "max_evidence", "temporal_decay", "min_relative_score")


def _integer(low: int, or_none: bool = False):
    """A cuemem option's check: an integer >= low (or null, where null means no limit)."""
    return (
        lambda v: (v is None and or_none) or (type(v) is int and v >= low),
        f"an integer >= {low}" + (" or null" if or_none else ""),
    )


def _number(low: float, high: float):
    return (
        lambda v: type(v) in (int, float) and low <= v <= high,
        f"a number in [{low}, {high}]",
    )


_BOOLEAN = (lambda v: type(v) is bool, "true or false")
# What each key of a "cuemem" object (--cuemem-options, or "cuemem" in --variant-options) takes, as
# cuemem.py's own flags do: an unknown key (a misspelt "capcity") would be dropped without a word,
# and a capacity of 0 or -1 (or a max_age of 0) leaves a memory that forgets every turn.
CUEMEM_OPTIONS = {
    "extractor": (lambda v: v in ("rule", "llm"), "'rule' or 'llm'"),
    "window": _integer(0),
    "links_per_cue": _integer(0),
    "link_threshold": _number(-1.0, 1.0),
    "capacity": _integer(1, or_none=True),
    "max_age": _integer(1, or_none=True),
    "top_k": _integer(1),
    "use_graph": _BOOLEAN,
    "max_evidence": _integer(0, or_none=True),  # 0 or null: no cap
    "temporal_decay": _number(0.0, 1.0),
    "min_relative_score": _number(0.0, 1.0),
    "prioritize_recent": _BOOLEAN,
}


def cuemem_option_problem(options) -> str | None:
    """What is wrong with a "cuemem" option object, in words, or None."""
    if not isinstance(options, dict):
        return "cuemem options must be a JSON object"
    for key, value in options.items():
        if key not in CUEMEM_OPTIONS:
            return f"unknown cuemem option {key!r}; the known ones: {', '.join(CUEMEM_OPTIONS)}"
        valid, takes = CUEMEM_OPTIONS[key]
        if not valid(value):
            return f"cuemem option {key} must be {takes}, got {json.dumps(value)}"
    return None


PRESETS = {
    # `make table2`: 96 test queries (24 per 8/16/24/32-round bucket, stratified) per variant on 2 CPU
    # cores with SmolLM2-135M, throughput at batch 8, one batch-1 latency request per Fig. 4 bucket.
    "cpu-table2": {"limit": 96, "batch_size": 8, "latency_per_bucket": 1, "attention_examples": 2},
    # The paper's scale: the whole test split, longer chains, a GPU.
    "paper": {
        "limit": None,
        "batch_size": 16,
        "max_new_tokens": 512,
        "max_new_tokens_direct": 128,
        "latency_per_bucket": 8,
        "attention_examples": 8,
    },
}
# `make demo`, the lesson: the same on the short dialogues of stage 0's cpu-lesson (8-11 rounds, so one
# Table 3 bucket and two Fig. 4 buckets, 8 and 12 rounds), with four latency requests in each: eight
# per variant, enough for the report's spread of ms per generated token to tell a busy machine (a wide
# spread) from a slow path (a high, steady figure); one request per bucket cannot.
PRESETS["cpu-lesson"] = dict(PRESETS["cpu-table2"], latency_per_bucket=4)


# --------------------------------------------------------------------------------------------
# Which examples: buckets by dialogue length and the stratified --limit
# --------------------------------------------------------------------------------------------
def num_turns(record) -> int:
    return int(record.get("meta", {}).get("num_turns", record["query_turn"]))


def select_examples(records, limit=None, seed=0, buckets=BUCKETS) -> list[dict]:
    """The default selection rule: with a limit, take examples evenly across the Table 3 length
    buckets (round robin 8 -> 16 -> 24 -> 32 over a seeded shuffle of each bucket) so the long
    buckets are represented however the file is ordered; a bucket that runs dry passes its share
    on. The chosen records keep their order in the file. Under one seed a smaller limit picks a
    subset of a larger one, so variants run on fewer queries still pair with the others."""
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


def recall_distance(record) -> int | None:
    """Rounds between the query and the oldest turn of H* (None when H* is empty)."""
    rounds = [round_of(label, 0) for label in record["recall"]]
    return record["query_turn"] - min(rounds) if rounds else None


# --------------------------------------------------------------------------------------------
# The methods: what each one shows the model, and which turns it counts as recalled
# --------------------------------------------------------------------------------------------
# The instruction every direct method gets: SRT's task and its recency rule, without the chain.
DIRECT_SYSTEM_PROMPT = (
    "You are a customer-service assistant in a long conversation. Answer the current query from the "
    "dialogue history; newer information overrides older. Do not explain. Reply with one line: "
    "'Final answer:' followed by a short answer."
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


def rag_turns(record, k: int, history_vectors=None) -> list[str]:
    """Labels of the k history utterances most similar to the query (cosine of unit-norm sentence
    embeddings, the vector retrieval of §2.1), returned in chronological order. history_vectors
    is the offline index (embed of the history texts); only the query is embedded here."""
    history = record["history"]
    if not history or k <= 0:
        return []
    if history_vectors is None:
        history_vectors = embed([turn["text"] for turn in history])
    scores = history_vectors @ embed([record["query"]])[0]
    top = sorted(np.argsort(-scores, kind="stable")[:k])
    return [history[i]["label"] for i in top]


def read_conversations(path) -> dict:
    """stage 0's conversations.jsonl -> {conversation_id: {"rounds": [{"user", "assistant"}],
    "dia_labels": {dia_id: label}}}; a bad line is named by file, line and field."""

    def parse(obj, path, line):
        if not isinstance(obj, dict) or not isinstance(obj.get("conversation_id"), str):
            raise DataError(f"{path}:{line}: field 'conversation_id' must be a string")
        rounds = obj.get("rounds")
        if not isinstance(rounds, list) or not all(
            isinstance(r, dict) and isinstance(r.get("user"), str) and isinstance(r.get("assistant"), str)
            for r in rounds
        ):
            raise DataError(f"{path}:{line}: field 'rounds' must be a list of {{user, assistant}} strings")
        if not isinstance(obj.get("dia_labels"), dict):
            raise DataError(f"{path}:{line}: field 'dia_labels' must be an object")
        return obj

    return {c["conversation_id"]: c for c in read_lines(path, parse)}


def conversation_record(record, conversation, keep_rounds: int | None = None) -> dict:
    """The record as a memory system meets it: the history is every round of the conversation
    before the question (its last `keep_rounds` where given), labelled Q1..An over the whole
    conversation; H* and the evidence labels move to those labels (all of the evidence: the whole
    conversation holds it). The query, the answer and the id stay: the rows pair with SRT's."""
    rounds = conversation["rounds"]
    first = 0 if keep_rounds is None else max(len(rounds) - keep_rounds, 0)
    history = []
    for number, turn in enumerate(rounds[first:], first + 1):
        for side, speaker in (("Q", "user"), ("A", "assistant")):
            text = turn["user" if side == "Q" else "assistant"]
            if text:  # a conversation that ends on the user's side has an empty last reply
                history.append({"label": f"{side}{number}", "speaker": speaker, "text": text})
    shown = {t["label"] for t in history}
    meta = dict(record.get("meta") or {})
    labels = conversation["dia_labels"]
    meta["evidence_labels"] = {i: labels[i] for i in meta.get("evidence") or [] if labels.get(i) in shown}
    meta["memory"] = "conversation" if first == 0 else f"conversation, last {len(rounds) - first} rounds"
    recall = sorted(set(meta["evidence_labels"].values()), key=lambda x: (int(x[1:]), x[0] == "A"))
    view = {**record, "history": history, "query_turn": len(rounds) + 1, "recall": recall, "pruned": []}
    return {**view, "meta": meta}


def newest_that_fits(record, conversation, fits) -> dict:
    """The conversation view with as many of the newest rounds as `fits(view)` allows (a binary
    search: fewer rounds, a shorter prompt); the whole conversation where it fits, none kept
    where not even the newest round does."""
    whole = conversation_record(record, conversation)
    if fits(whole):
        return whole
    low, high = 0, len(conversation["rounds"])  # fits(low rounds); not fits(high rounds)
    while high - low > 1:
        middle = (low + high) // 2
        if fits(conversation_record(record, conversation, middle)):
            low = middle
        else:
            high = middle
    return conversation_record(record, conversation, low)


def offline_state(method: str, record: dict, options: dict):
    """The work a deployed system does before the query arrives, timed apart from query latency:
    RAG's embedding of the history, CueMem's memory (cue extraction, embedding, turn graph and
    the forgetting policy as of the query round, §4.4 of CueMem)."""
    if method == "rag":
        return embed([turn["text"] for turn in record["history"]]) if record["history"] else None
    if method == "cuemem":
        memory = {k: v for k, v in options["cuemem"].items() if k in CUEMEM_MEMORY_KEYS}
        return cuemem.build_memory(record, **memory)
    return None


def method_input(method: str, record: dict, options: dict, state=None) -> tuple[list[dict], list | None]:
    """-> (chat messages, recalled labels). The recalled set of rag, recency and cuemem is what
    they selected; srt and srt-p recall by writing <HIS> tags (parsed later); full recalls nothing
    (its recall metrics are null). `state` is offline_state's result (built here when None). The
    messages go through the model's own chat template (prompt.render_chat). The "history": "none"
    option (Table 2's "No history" floor) empties the history every method sees."""
    if options.get("history") == "none":
        record = {**record, "history": []}
    if method == "full":
        return build_messages(record, system=DIRECT_SYSTEM_PROMPT), None
    if method in ("recency", "rag"):
        keep = (
            recency_turns(record, options["recency_k"])
            if method == "recency"
            else rag_turns(record, options["rag_k"], state)
        )
        return build_messages(record, keep=set(keep), system=DIRECT_SYSTEM_PROMPT), keep
    if method == "srt-p":
        return build_messages(record, system=SRTP_SYSTEM_PROMPT), None
    if method == "srt":
        return build_messages(record), None  # exactly the prompt SFT and GRPO trained on
    if method == "cuemem":
        memory = offline_state(method, record, options) if state is None else state
        query = {k: v for k, v in options["cuemem"].items() if k in CUEMEM_QUERY_KEYS}
        evidence = [label for label, _ in memory.query(record["query"], **query)]
        return (
            cuemem.build_answer_messages(record, evidence, options["cuemem"].get("prioritize_recent", True)),
            evidence,
        )
    raise ValueError(f"unknown method {method!r}; choose from {', '.join(METHODS)}")


def srt_prompt_text(tokenizer, method: str, options: dict, record: dict) -> str:
    """The rendered prompt `method` shows for `record` (the §4.6 attention analysis re-reads it)."""
    return render_chat(tokenizer, method_input(method, record, options)[0])


def system_prompt_of(method: str, options: dict) -> str:
    """The instruction text a method is run with (part of the resume key)."""
    if method == "cuemem":
        return cuemem.ANSWER_SYSTEM_PROMPT + (
            cuemem.PRIORITY_INSTRUCTION if options["cuemem"].get("prioritize_recent", True) else ""
        )
    return {"srt": SRT_SYSTEM_PROMPT, "srt-p": SRTP_SYSTEM_PROMPT}.get(method, DIRECT_SYSTEM_PROMPT)


# --------------------------------------------------------------------------------------------
# Generation: greedy, batched (generation.generate: left padding, stops at <|im_end|> / eos)
# --------------------------------------------------------------------------------------------
def direct_answer_done(text: str) -> bool:
    """A direct method is asked for one line: its generation ends once that line is complete, as
    a deployed system would end it at a stop sequence (a base model otherwise goes on writing the
    transcript's next turns, "Q8: ...", until the token cap)."""
    return answer_line(text)[1]


def generate_batch(
    model, tokenizer, prompts, max_new_tokens, autocast_dtype=None, one_line=False, recall="free"
) -> list[dict]:
    """Greedy completions of a batch of chat-templated prompt texts ->
    [{text, input_tokens, generated_tokens, decoded_tokens, copied_tokens, expanded, truncated}];
    generated_tokens counts up to and including the first stop token (or the end of the answer line
    when one_line), decoded_tokens those the model wrote, copied_tokens those recall "copy" wrote
    (srt/recall.py; expanded: the labels it expanded); truncated: the completion reached
    max_new_tokens without either."""
    stop_when = direct_answer_done if one_line else None
    out = generation.generate(
        model,
        tokenizer,
        prompts,
        max_new_tokens=max_new_tokens,
        greedy=True,
        autocast_dtype=autocast_dtype,
        stop_when=stop_when,
        recall=recall,
    )
    stops = torch.tensor(generation.stop_token_ids(model, tokenizer), device=out["completion_ids"].device)
    rows = []
    for i, (text, n_in, n_out) in enumerate(zip(out["texts"], out["input_tokens"], out["generated_tokens"])):
        stopped = bool(torch.isin(out["completion_ids"][i, :n_out], stops).any()) or (
            one_line and stop_when(text)
        )
        rows.append(
            {
                "text": text,
                "input_tokens": int(n_in),
                "generated_tokens": int(n_out),
                "decoded_tokens": int(out["decoded_tokens"][i]),
                "copied_tokens": int(out["copied_tokens"][i]) if "copied_tokens" in out else 0,
                "expanded": out["expanded"][i] if "expanded" in out else [],
                "truncated": not stopped and n_out >= max_new_tokens,
            }
        )
    return rows


# --------------------------------------------------------------------------------------------
# Scoring one prediction
# --------------------------------------------------------------------------------------------
def score_prediction(
    method: str, record: dict, completion: str, recalled, reward_info=None, truncated: bool = False
) -> dict:
    """All per-example metrics. For srt / srt-p, H^ is the set of Eq. (6) (reward.py): the history
    labels their <HIS> tags matched plus one '?...' element per distinct tag that matched nothing,
    so a hallucinated recall costs precision and Jaccard exactly as it costs the recall reward.

    Precision, recall and Jaccard exist only where H* is non-empty: with an empty H* they would be
    1.0 for any silent answer and 0 for a fixed-k retriever by construction. Those queries get
    `silent` instead (self-recall methods: 1 if the answer recalled nothing).

    Accuracy, key-F1 and the error type exist only where the record has answer keys (a LoCoMo
    answer is a free phrase: F1 and LoCoMo's own score read it). A record with a LoCoMo category
    also gets locomo_score and evidence_recall (srt/locomo_eval.py)."""
    answer = final_answer(method, completion)
    keys = answer_keys(record)
    has_keys = bool(reward.answer_keys(record))
    row = {
        "final_answer": answer,
        "answer_tokens": len(normalize_answer(answer).split()),  # SQuAD's tokens, those F1 counts
        "several_candidates": float(states_several_candidates(answer, record)),
        "needs_recall": bool(record["recall"]),
        "f1": f1_score(answer, record["answer"]),
        "key_f1": key_f1(answer, record) if has_keys else None,
        "accuracy": accuracy(answer, record) if has_keys else None,
        "keys_present": keys_affirmed(answer, keys, record["answer"]) if has_keys else None,
        "truncated": truncated,
    }
    if reward_info is not None:
        unmatched = dict.fromkeys(reward.unmatched_key(t) for t in reward_info["unmatched"])
        recalled = list(reward_info["recalled"]) + list(unmatched)
        row.update(
            {
                "format_valid": float(is_valid_format(completion)),
                "reward_format": reward_info["format"],
                "reward_recall": reward_info["recall"],
                "reward_answer": reward_info["answer"],
                "reward_total": reward_info["total"],
            }
        )
    row["recalled"] = recalled
    gold = record["recall"]
    row.update({"precision": None, "recall": None, "jaccard": None, "silent": None, "error_type": None})
    if recalled is not None and gold:
        row.update(recall_metrics(recalled, gold))
    # the turns the tags name, however they were copied: the choice of turn alone
    row["label_jaccard"] = (
        jaccard(tag_labels(completion), gold) if gold and method in SELF_RECALL_METHODS else None
    )
    if not gold and method in SELF_RECALL_METHODS:
        row["silent"] = float(not recalled)
    if recalled is not None and row["accuracy"] == 0.0:
        labels = tag_labels(completion) if method in SELF_RECALL_METHODS else None
        row["error_type"] = error_type(recalled, gold, truncated, labels)
    row.update(locomo_eval.score_row(answer, record, recalled))
    return row


def record_facts(record) -> dict:
    """What the breakdowns group by: length bucket, query type, |H*|, recall distance."""
    return {
        "id": record["id"],
        "num_turns": num_turns(record),
        "bucket": bucket_of(num_turns(record)),
        "query_type": record.get("meta", {}).get("query_type", "unknown"),
        "h_size": len(record["recall"]),
        "distance": recall_distance(record),
        "distance_bin": distance_bin(recall_distance(record)),
    }


# --------------------------------------------------------------------------------------------
# What a saved row belongs to: the checkpoint's files, the evaluation settings, the record
# --------------------------------------------------------------------------------------------
def record_hash(record) -> str:
    return hashlib.sha256(json.dumps(record, sort_keys=True, ensure_ascii=False).encode()).hexdigest()[:16]


def variant_key(variant, options, args, fingerprint) -> str:
    """Everything that changes a variant's answers or scores: checkpoint, method, instruction,
    retrieval options, token budget, precision, scoring version (not --limit: a row's answer does
    not depend on how many others were asked)."""
    # free recall and the window are what every variant did before the options existed: its rows
    # keep their key
    defaults = (("recall", "free"), ("memory", "window"))
    options = {k: v for k, v in options.items() if k != "limit" and (k, v) not in defaults}
    if options.get("memory") == "conversation" and variant["method"] == "full":
        options["max_prompt_tokens"] = args.max_prompt_tokens
    settings = {
        "fingerprint": fingerprint,
        "method": variant["method"],
        "answer_reward": args.answer_reward,
        "system": system_prompt_of(variant["method"], options),
        "options": options,
        "max_new_tokens": options["max_new_tokens"],
        "dtype": args.dtype,
        "score": SCORE_VERSION,
    }
    return hashlib.sha256(json.dumps(settings, sort_keys=True, default=repr).encode()).hexdigest()[:16]


def read_rows(path, key=None) -> dict:
    """Rows already written, by id; a line cut short by a killed run is ignored (and redone), and
    so is a row written under another key (another checkpoint or other settings)."""
    rows = {}
    if Path(path).exists():
        for line in Path(path).read_text(encoding="utf-8").splitlines():
            try:
                row = json.loads(line)
            except json.JSONDecodeError:
                continue
            if isinstance(row, dict) and "id" in row and (key is None or row.get("key") == key):
                rows[row["id"]] = row
    return rows


def append_rows(path, rows) -> None:
    with open(path, "a", encoding="utf-8") as f:
        f.write("".join(json.dumps(r, ensure_ascii=False) + "\n" for r in rows))
        f.flush()
        os.fsync(f.fileno())


def open_rows(path, records, key, resume) -> dict:
    """The reusable rows of `path` (same key, same record content), with the file rewritten to
    hold exactly those, so appends start on a fresh line and no stale row survives."""
    hashes = {r["id"]: record_hash(r) for r in records}
    done = (
        {i: r for i, r in read_rows(path, key).items() if r.get("record") == hashes.get(i)} if resume else {}
    )
    atomic_write_text(path, "".join(json.dumps(r, ensure_ascii=False) + "\n" for r in done.values()))
    return done


def ask(client, messages) -> str:
    try:
        return client.chat(messages)
    except RuntimeError as e:  # ChatClient already retried; what was answered so far is on disk
        sys.exit(f"error: {e} (rerun with --resume to continue)")


# --------------------------------------------------------------------------------------------
# One variant (NAME=METHOD:MODEL): the batched pass, then the batch-1 latency sample
# --------------------------------------------------------------------------------------------
class Runner:
    """A variant's model (or API client) and settings: builds inputs, generates, times."""

    def __init__(self, variant, args, options, model=None, tokenizer=None, client=None, conversations=None):
        self.variant, self.method, self.args, self.options = variant, variant["method"], args, options
        self.model, self.tokenizer, self.client = model, tokenizer, client
        self.max_new = options["max_new_tokens"]
        self.autocast = resolve_dtype(args.dtype, model.device)[1] if model is not None else None
        self.conversations = conversations or {}
        self.states = {}  # conversation id -> (offline state, its seconds): one memory a conversation

    def view(self, record) -> dict:
        """The record this variant reads: its own window, or the whole conversation before the
        question (the "memory" option); full keeps the newest rounds that fit --max-prompt-tokens."""
        conversation = self.conversations.get((record.get("meta") or {}).get("conversation_id"))
        if self.options.get("memory") != "conversation" or conversation is None:
            return record
        if self.method != "full" or self.tokenizer is None:
            return conversation_record(record, conversation)

        def fits(view):
            prompt = render_chat(self.tokenizer, method_input("full", view, self.options)[0])
            tokens = len(self.tokenizer(prompt, add_special_tokens=False)["input_ids"])
            return tokens <= self.args.max_prompt_tokens

        return newest_that_fits(record, conversation, fits)

    def build(self, record) -> dict:
        """Offline state, then the online prompt build (retrieval query included), each timed. Over
        a whole conversation the offline state is built once and shared by its questions (as a
        deployed memory is); each row then reports that one build's seconds."""
        t0 = time.perf_counter()
        shared = (record.get("meta") or {}).get("memory", "").startswith("conversation")
        conversation_id = (record.get("meta") or {}).get("conversation_id")
        if shared and conversation_id in self.states:
            state, offline_s = self.states[conversation_id]
        else:
            state = offline_state(self.method, record, self.options)
            offline_s = time.perf_counter() - t0
            if shared:
                self.states[conversation_id] = (state, offline_s)
        t1 = time.perf_counter()
        messages, recalled = method_input(self.method, record, self.options, state)
        prompt = render_chat(self.tokenizer, messages) if self.client is None else None
        t2 = time.perf_counter()
        shown = (
            None
            if self.tokenizer is None
            else len(
                self.tokenizer(
                    format_history(record["history"], None if recalled is None else set(recalled)),
                    add_special_tokens=False,
                )["input_ids"]
            )
        )
        return {
            "messages": messages,
            "prompt": prompt,
            "recalled": recalled,
            "offline_s": offline_s,
            "build_s": t2 - t1,
            "history_tokens": shown,
        }

    def answer(self, built) -> list[dict]:
        if self.client is None:
            return generate_batch(
                self.model,
                self.tokenizer,
                [b["prompt"] for b in built],
                self.max_new,
                self.autocast,
                one_line=self.method not in SELF_RECALL_METHODS,
                recall=self.options["recall"] if self.method in SELF_RECALL_METHODS else "free",
            )
        # ChatClient reports neither token counts nor whether the reply hit max_tokens.
        return [
            {
                "text": ask(self.client, b["messages"]),
                "input_tokens": None,
                "generated_tokens": None,
                "decoded_tokens": None,
                "copied_tokens": None,
                "expanded": None,
                "truncated": None,
            }
            for b in built
        ]

    def warm_up(self, record) -> None:
        """One untimed request first, so that no variant's numbers absorb one-time costs (lazy
        kernels, allocator growth, the embedder's first call)."""
        if self.method in ("rag", "cuemem"):
            load_embedder()
        if self.client is None:
            self.answer([self.build(record)])


def evaluate_variant(runner, records, out_dir, key, quiet=False) -> list[dict]:
    """Answer every record in batches of --batch-size and write <out>/<name>.jsonl. Each row holds
    its share of its batch's generation wall time (generate_share_s), from which the report
    computes throughput; per-request latency comes from latency_sample."""
    name, method = runner.variant["name"], runner.method
    path = Path(out_dir) / f"{name}.jsonl"
    done = open_rows(path, records, key, runner.args.resume)
    pending = [r for r in records if r["id"] not in done]
    # Similar lengths in one batch waste less padding.
    pending.sort(key=lambda r: sum(len(t["text"]) for t in r["history"]))
    batch_size = 1 if runner.client is not None else runner.args.batch_size
    if pending:
        runner.warm_up(pending[0])

    from tqdm import tqdm

    progress = tqdm(
        total=len(records), initial=len(records) - len(pending), desc=name, unit="ex", disable=quiet
    )
    for start in range(0, len(pending), batch_size):
        batch = pending[start : start + batch_size]
        built = [runner.build(record) for record in batch]
        t0 = time.perf_counter()
        outputs = runner.answer(built)
        share = (time.perf_counter() - t0) / len(batch)
        rewards = None
        if method in SELF_RECALL_METHODS:  # Eqs. (4)-(7), batched embedding; not part of any timing
            rewards = reward.compute_rewards([o["text"] for o in outputs], batch, runner.args.answer_reward)
        rows = []
        for i, (record, output) in enumerate(zip(batch, outputs)):
            scores = score_prediction(
                method,
                record,
                output["text"],
                built[i]["recalled"],
                rewards[i] if rewards else None,
                bool(output["truncated"]),
            )
            if output["truncated"] is None:
                scores["truncated"] = None
            rows.append(
                {
                    **record_facts(record),
                    "key": key,
                    "record": record_hash(record),
                    "name": name,
                    "method": method,
                    "model": runner.variant["model"],
                    "completion": output["text"],
                    "reference": record["answer"],
                    "gold_recall": record["recall"],
                    **scores,
                    "input_tokens": output["input_tokens"],
                    "generated_tokens": output["generated_tokens"],
                    "decoded_tokens": output["decoded_tokens"],
                    "copied_tokens": output["copied_tokens"],
                    "expanded": output["expanded"],
                    "history_tokens": built[i]["history_tokens"],
                    "offline_s": built[i]["offline_s"],
                    "build_s": built[i]["build_s"],
                    "generate_share_s": share,
                    "batch_size": len(batch),
                }
            )
        append_rows(path, rows)
        progress.update(len(batch))
    progress.close()
    rows = read_rows(path, key)
    return [rows[r["id"]] for r in records if r["id"] in rows]


def latency_picks(records, per_bucket: int, buckets) -> list[dict]:
    """The first `per_bucket` selected records of each Fig. 4 length bucket."""
    picks = []
    for b in buckets:
        picks += [r for r in records if bucket_of(num_turns(r), buckets) == b][:per_bucket]
    return picks


def latency_sample(runner, records, out_dir, key, buckets) -> list[dict]:
    """Table 1 / Fig. 4 latency: per request at batch size 1, after a warm-up request, end to end
    from the query to the parsed answer (online prompt build with any retrieval query,
    generation, parsing); offline work is timed beside it (offline_s), never inside it."""
    picks = latency_picks(records, runner.args.latency_per_bucket, buckets)
    path = Path(out_dir) / f"{runner.variant['name']}.latency.jsonl"
    done = open_rows(path, records, key, runner.args.resume)
    pending = [r for r in picks if r["id"] not in done]
    if pending:
        runner.warm_up(pending[0])
    for record in pending:
        if runner.method == "cuemem":
            cuemem._VECTORS.clear()  # the batched pass cached this query's embedding: time it afresh
        built = runner.build(record)
        t0 = time.perf_counter()
        output = runner.answer([built])[0]
        answer = final_answer(runner.method, output["text"])
        latency = built["build_s"] + time.perf_counter() - t0
        append_rows(
            path,
            [
                {
                    "id": record["id"],
                    "key": key,
                    "record": record_hash(record),
                    "num_turns": num_turns(record),
                    "fine_bucket": bucket_of(num_turns(record), buckets),
                    "latency_s": latency,
                    "offline_s": built["offline_s"],
                    "final_answer": answer,
                    "input_tokens": output["input_tokens"],
                    "generated_tokens": output["generated_tokens"],
                    "decoded_tokens": output["decoded_tokens"],
                    "copied_tokens": output["copied_tokens"],
                    "truncated": output["truncated"],
                    "batch_size": 1,
                }
            ],
        )
    rows = read_rows(path, key)
    return [rows[r["id"]] for r in picks if r["id"] in rows]


def table2_mapping(spec, names) -> dict:
    """--table2 "SRT=grpo,w/o RL=sft,..." or, without it, the conventional names that are present."""
    if spec:
        mapping = {}
        for item in spec.split(","):
            row, _, name = item.partition("=")
            if name.strip() not in names:
                sys.exit(f"error: --table2 names {name.strip()!r}, which is not a --compare NAME")
            if not row.strip():
                sys.exit(f"error: --table2 {item.strip()!r} has no row name; give ROW=NAME")
            if row.strip() in mapping:  # the second would replace the first without a word
                sys.exit(f"error: --table2 names the row {row.strip()!r} twice")
            mapping[row.strip()] = name.strip()
        return mapping
    return {
        row: next(n for n in guesses if n in names)
        for row, guesses in TABLE2_GUESS.items()
        if any(n in names for n in guesses)
    }


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
            sys.exit(
                f"error: --compare {spec!r} is not NAME=METHOD:MODEL with METHOD one of {', '.join(METHODS)}"
            )
        if name in {v["name"] for v in variants}:
            sys.exit(f"error: --compare names {name!r} twice")
        validate_variant_name(name)
        variants.append({"name": name, "method": method, "model": model})
    return variants


# A variant's name is the stem of its files in --out (<name>.jsonl, <name>.latency.jsonl): plain,
# so that it names a file inside --out, and without a dot, so that no two variants' files collide.
VARIANT_NAME = re.compile(r"[A-Za-z0-9_-]+")


def validate_variant_name(name: str) -> None:
    if not VARIANT_NAME.fullmatch(name):
        sys.exit(
            f"error: --compare name {name!r}: a name is letters, digits, '-' and '_' (it names the "
            "variant's files in --out)"
        )


def parse_variant_options(specs, names) -> dict:
    """--variant-options NAME=JSON ...: per-variant overrides of VARIANT_KEYS, e.g.
    'cuemem-cap={"cuemem": {"capacity": 16}}' or 'rag={"limit": 48}'."""
    out = {}
    for spec in specs or []:
        name, _, text = spec.partition("=")
        try:
            value = json.loads(text)
        except json.JSONDecodeError as e:
            sys.exit(f"error: --variant-options {spec!r}: {e}")
        if name not in names or not isinstance(value, dict) or set(value) - set(VARIANT_KEYS):
            sys.exit(
                f"error: --variant-options {spec!r} is not NAME=JSON with NAME a variant and keys "
                f"among {', '.join(VARIANT_KEYS)}"
            )
        if value.get("history", "full") not in ("full", "none"):
            sys.exit(f"error: --variant-options {spec!r}: history is 'full' or 'none'")
        if value.get("recall", "free") not in RECALL_MODES:
            sys.exit(f"error: --variant-options {spec!r}: recall is one of {', '.join(RECALL_MODES)}")
        if value.get("memory", "window") not in MEMORIES:
            sys.exit(f"error: --variant-options {spec!r}: memory is one of {', '.join(MEMORIES)}")
        for key in ("limit", "recency_k", "rag_k", "max_new_tokens"):  # as their flags: at least 1
            number = value.get(key, 1)
            if not (number is None and key == "limit") and (type(number) is not int or number < 1):
                sys.exit(f"error: --variant-options {spec!r}: {key} must be an integer >= 1, got {number!r}")
        if value.get("max_new_tokens", 1) > MAX_NEW_TOKENS:
            sys.exit(f"error: --variant-options {spec!r}: max_new_tokens must be <= {MAX_NEW_TOKENS}")
        if problem := cuemem_option_problem(value.get("cuemem", {})):
            sys.exit(f"error: --variant-options {spec!r}: {problem}")
        if name in out:  # the second would replace the first without a word
            sys.exit(f"error: --variant-options names {name!r} twice; give its options in one JSON")
        out[name] = value
    return out


def variant_options(variant, args) -> dict:
    """The settings one variant runs with: the flags, then its --variant-options."""
    own = args.variant_options.get(variant["name"], {})
    options = {
        "recency_k": args.recency_k,
        "rag_k": args.rag_k,
        "limit": args.limit,
        "max_new_tokens": args.max_new_tokens
        if variant["method"] in SELF_RECALL_METHODS
        else args.max_new_tokens_direct,
        "cuemem": {"extractor": args.cuemem_extractor, **args.cuemem_options},
        "history": "full",
        "recall": args.recall,
        # the whole conversation for the memory systems where stage 0 wrote it; SRT its window
        "memory": "conversation" if args.conversations and variant["method"] in MEMORY_METHODS else "window",
    }
    options.update({k: v for k, v in own.items() if k != "cuemem"})
    options["cuemem"].update(own.get("cuemem", {}))
    return options


def cuemem_extractor(args, spec, model=None, tokenizer=None):
    """The cue extractor a CueMem variant names: 'rule', or 'llm' through an OpenAI-compatible
    API (--cuemem-api-base) or a local model (--cuemem-extractor-model, else the answer model)."""
    if spec == "rule" or spec is None:
        return cuemem.rule_extract
    if spec != "llm":
        sys.exit(f"error: cuemem extractor {spec!r} is neither 'rule' nor 'llm'")
    if args.cuemem_api_base:
        return cuemem.LLMExtractor(
            ChatClient(
                args.cuemem_api_base, args.cuemem_api_model, key_env=args.api_key_env, max_tokens=128
            ).chat
        )
    if args.cuemem_extractor_model or model is None:
        model, tokenizer = load_model_and_tokenizer(
            args.cuemem_extractor_model or "smollm2-135m", dtype=args.dtype, device=args.device
        )
    autocast_dtype = resolve_dtype(args.dtype, model.device)[1]
    return cuemem.LLMExtractor(cuemem.hf_generate_fn(model, tokenizer, 128, autocast_dtype))


def variant_pair(text: str) -> tuple[str, str]:
    a, sep, b = text.partition(":")
    if not sep or not a or not b:
        raise argparse.ArgumentTypeError(f"{text!r} is not A:B (two --compare NAMEs)")
    return a, b


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0],
        formatter_class=argparse.RawDescriptionHelpFormatter,
        epilog="Presets: " + "; ".join(f"{k}: {v}" for k, v in PRESETS.items()),
    )
    p.add_argument("--method", choices=METHODS, default="srt", help="the method of a single run")
    add_model(p, "smollm2-135m", "HF id, local folder, smollm2-135m or tiny-random")
    add_data(p, "runs/data/test.jsonl", "stage-0 records (JSONL) to answer")
    add_out(p, "runs/demo/eval")
    p.add_argument(
        "--compare",
        nargs="+",
        metavar="NAME=METHOD:MODEL",
        help="evaluate several variants in one report (MODEL 'api:NAME' uses --api-base)",
    )
    p.add_argument(
        "--variant-options",
        nargs="+",
        metavar="NAME=JSON",
        default=[],
        help=f"per-variant overrides, keys {', '.join(VARIANT_KEYS)}; e.g. a CueMem row under a "
        'capacity limit: \'cuemem-cap16={"cuemem": {"capacity": 16}}\'',
    )
    p.add_argument(
        "--pairs",
        nargs="+",
        type=variant_pair,
        default=[],
        metavar="A:B",
        help="more paired comparisons, B against A (--compare NAMEs), e.g. sft:sft-copydec",
    )
    p.add_argument(
        "--table2",
        default=None,
        help='rows of Table 2, e.g. "SRT=grpo,w/o RL=sft,w/o CoT=nocot,w/o SFT=base-srtp,'
        'Full history=full" (default: these conventional names where present)',
    )
    add_limit(p, "evaluate N examples, taken evenly across the 8/16/24/32 buckets (seeded)")
    p.add_argument(
        "--buckets",
        default=",".join(map(str, FIG4_BUCKETS)),
        help="length buckets (rounds) of the per-bucket tables, the plots and the latency sample",
    )
    add_batch_size(p, 8, "prompts per generate call; the throughput column")
    p.add_argument(
        "--latency-per-bucket",
        type=at_least(0),
        default=1,
        help="requests per length bucket timed alone at batch size 1 after a warm-up (0: none)",
    )
    # Reference chains (format_target) of the synthetic data run to ~210 SmolLM2 tokens and the
    # reference answers to ~40; the caps leave room so that < 5% of answers are cut off (the
    # report prints each variant's cut-off rate and flags any at 5% or more).
    add_max_new_tokens(p, 256, "for srt / srt-p (default: 256)")
    p.add_argument(
        "--max-new-tokens-direct",
        type=up_to(MAX_NEW_TOKENS),
        default=128,
        help="for full / recency / rag / cuemem (default: 128)",
    )
    add_recall_flag(
        p,
        "srt / srt-p: copy: the model names a turn (<HIS>A3:) and the decoder writes it out "
        "(srt/recall.py); free: the model copies every token (the paper); per variant: --variant-options",
    )
    p.add_argument("--recency-k", type=at_least(1), default=4, help="rounds kept by `recency`")
    p.add_argument("--rag-k", type=at_least(1), default=4, help="utterances retrieved by `rag`")
    p.add_argument(
        "--conversations",
        default="auto",
        help="stage 0's conversations.jsonl (LoCoMo): full, recency, rag and cuemem read the whole "
        "conversation before each question, SRT its record's window; auto: the file beside --data "
        "where there is one; none: every method reads the record's window",
    )
    p.add_argument(
        "--max-prompt-tokens",
        type=at_least(1),
        default=2048,
        help="full over a whole conversation reads its newest rounds that fit this many prompt tokens",
    )
    p.add_argument(
        "--cuemem-options",
        type=json.loads,
        default={},
        help="JSON keyword arguments of cuemem.build_memory and CueMemory.query, plus "
        "prioritize_recent (e.g. '{\"capacity\": 16}')",
    )
    p.add_argument(
        "--cuemem-extractor",
        choices=["rule", "llm"],
        default="rule",
        help="CueMem's cue extractor (§4.1): rules, or a model prompted for triples",
    )
    p.add_argument(
        "--cuemem-extractor-model",
        default=None,
        help="local model of the llm extractor (default: the variant's answer model)",
    )
    p.add_argument("--cuemem-api-base", default=None, help="OpenAI-compatible endpoint of the llm extractor")
    p.add_argument("--cuemem-api-model", default=None, help="model name at --cuemem-api-base")
    reward.add_answer_reward(p, "the answer component of the reward columns (reward.py; Eq. (7) is cosine)")
    p.add_argument(
        "--bootstrap",
        type=at_least(1000),  # fewer leave the 2.5% and 97.5% quantiles of a 95% interval on too few
        default=2000,
        help="paired bootstrap resamples (>= 1000)",
    )
    p.add_argument(
        "--runs-spread",
        default=None,
        metavar="SPREAD_JSON",
        help="spread.json of a runs report (python -m srt.runs_report) on the same test file: report.md "
        "prints the spread of Δ over those training runs beside this one run's",
    )
    p.add_argument(
        "--attention-examples",
        type=at_least(0),
        default=2,
        help="examples in the §4.6 attention analysis (0 turns it off)",
    )
    add_api_flags(p, base_help="OpenAI-compatible endpoint, e.g. https://api.openai.com/v1")
    add_dtype(
        p,
        "weight precision; auto: fp32 weights with bf16 autocast on a GPU or a CPU with AMX or "
        "AVX512-BF16, plain fp32 elsewhere",
    )
    add_device(p)
    add_seed(p, "seed of the --limit selection and sampling")
    add_resume(
        p,
        "reuse rows of <out>/<name>.jsonl written by the same checkpoint (another setting that changes "
        "a row: refused)",
    )
    add_overwrite(p, "replace the evaluation --out holds (without it or --resume: refused)")
    add_quiet(p)
    return p


def resolve_config(argv=None) -> argparse.Namespace:
    """Flags over the --preset over the defaults; every value checked before any work is done."""
    args = parse_config(build_parser(), PRESETS, argv)
    try:
        args.buckets = tuple(sorted({int(b) for b in args.buckets.split(",")}))
    except ValueError:
        sys.exit(f"error: --buckets {args.buckets!r} is not a comma-separated list of integers")
    if args.conversations == "auto":
        beside = Path(args.data).parent / "conversations.jsonl"
        args.conversations = str(beside) if beside.is_file() else None
    elif args.conversations == "none":
        args.conversations = None
    elif not Path(args.conversations).is_file():
        sys.exit(f"error: --conversations {args.conversations}: no such file")
    if args.api_base and not args.compare and not args.api_model:
        sys.exit("error: --api-base needs --api-model")
    if args.cuemem_api_base and not args.cuemem_api_model:
        sys.exit("error: --cuemem-api-base needs --cuemem-api-model")
    if problem := cuemem_option_problem(args.cuemem_options):
        sys.exit(f"error: --cuemem-options: {problem}")
    args.device = args.device or ("cuda" if torch.cuda.is_available() else "cpu")
    args.variants = parse_variants(args)
    if any(v["model"].startswith("api:") for v in args.variants) and not args.api_base:
        sys.exit("error: a model 'api:NAME' needs --api-base")
    args.variant_options = parse_variant_options(args.variant_options, {v["name"] for v in args.variants})
    unknown = sorted({n for pair in args.pairs for n in pair} - {v["name"] for v in args.variants})
    if unknown:
        sys.exit(f"error: --pairs names {', '.join(unknown)}, which is not a --compare NAME")
    validate_pairs(args.pairs)
    for v in args.variants:
        v["batch_size"] = 1 if v["model"].startswith("api:") else args.batch_size
        v["options"] = variant_options(v, args)
    return args


def validate_pairs(pairs) -> None:
    """--pairs A:B compares two variants, each once: a variant against itself has no difference to
    report, and one pair twice would be one entry in the report."""
    for k, (a, b) in enumerate(pairs):
        if a == b:
            sys.exit(f"error: --pairs {a}:{b} compares a variant with itself; name two --compare NAMEs")
        if (a, b) in pairs[:k]:
            sys.exit(f"error: --pairs names {a}:{b} twice")


def same_data_as_before(out_dir: Path, args) -> None:
    """--resume continues an evaluation of the same --data: rows of another file would be dropped
    and its records answered in their place without a word, so it is refused, naming both. The
    same file with other bytes (a record corrected in place) goes on, as it always has: the rows
    of the records that changed are answered again (each row carries its record's hash); a note
    says so."""
    path = out_dir / "config.json"
    saved = json.loads(path.read_text(encoding="utf-8")) if path.is_file() else {}
    if "data" in saved and saved["data"] != args.data:
        changes = changed_settings(saved, {"data": args.data}, ["data"])
        sys.exit(
            f"error: --resume with other --data than the evaluation in {out_dir}: {', '.join(changes)}"
            f"{same_bytes_hint(saved, {'data': args.data, 'data_sha256': args.data_sha256})}; "
            "--overwrite replaces its rows, or give another --out"
        )
    if saved.get("data_sha256") not in (None, args.data_sha256):
        changed = f"{args.data} changed since the evaluation in {out_dir}"
        print(f"note: {changed}: the records that changed are answered again")


# What a --resume may change: where the rows go, the device, the key's variable, the progress bars,
# and what only the report reads (it is rebuilt from the rows). The variants are compared one by one
# (changed_variants: adding one is no change to the others), --data by same_data_as_before and
# --limit by the rows it would drop (refuse_to_drop_rows); every other flag changes a row.
RESUME_MAY_CHANGE = (
    *("out", "resume", "overwrite", "preset", "device", "api_key_env", "quiet"),
    *("pairs", "table2", "bootstrap", "runs_spread", "attention_examples", "latency_per_bucket"),
    *("compare", "method", "model", "variant_options", "variants", "limit", "data", "data_sha256"),
)


def row_settings(variant: dict) -> dict:
    return {
        "method": variant.get("method"),
        "model": variant.get("model"),
        **variant["options"],
        "limit": None,
    }


def changed_variants(saved: list, variants: list) -> list[str]:
    """'variant NAME: setting (there, now)' for each variant of both runs whose method, model or
    options (--limit aside) differ."""
    before = {v.get("name"): v for v in saved if isinstance(v, dict) and "options" in v}
    return [
        f"variant {v['name']}: {change}"
        for v in variants
        if v["name"] in before
        for change in changed_settings(row_settings(before[v["name"]]), row_settings(v))
    ]


def same_settings_as_before(out_dir: Path, args, config: dict) -> None:
    """--resume keeps the rows written under the settings config.json recorded: another setting
    would answer the rest of the records otherwise, or (the rows carry their settings' key) answer
    them all again and replace the earlier answers without a word. Refused, naming what differs. A
    key an older config.json lacks is not checked."""
    path = out_dir / "config.json"
    saved = json.loads(path.read_text(encoding="utf-8")) if path.is_file() else {}
    now = {k: v for k, v in config.items() if k not in RESUME_MAY_CHANGE}
    changes = [*changed_settings(saved, now, [k for k in now if k in saved])]
    changes += changed_variants(saved.get("variants") or [], args.variants)
    if changes:
        sys.exit(
            f"error: --resume with different settings than the evaluation in {out_dir}: "
            f"{', '.join(changes)}; --overwrite replaces its rows, or give another --out"
        )


def refuse_to_drop_rows(out_dir: Path, args, all_records) -> None:
    """A --resume rewrites <name>.jsonl to hold the rows of the records it selects: the answered
    rows of the records a smaller --limit leaves out would be gone without a word."""
    ids = {r["id"] for r in all_records}
    for v in args.variants:
        path = out_dir / f"{v['name']}.jsonl"
        key = variant_key(v, v["options"], args, model_fingerprint(v["model"], args.api_base))
        kept = {r["id"] for r in select_examples(all_records, v["options"]["limit"], args.seed)}
        answered = [i for i in read_rows(path, key) if i in ids]
        dropped = [i for i in answered if i not in kept]
        if dropped:
            sys.exit(
                f"error: --resume --limit {v['options']['limit']}: {path} holds {len(answered)} answered "
                f"rows, {len(dropped)} of them of records this --limit leaves out, which would be dropped; "
                "resume with the --limit it ran with or a larger one (none: every record), or give "
                "another --out"
            )


def read_runs_spread(path, data, data_sha256) -> dict | None:
    """--runs-spread: the spread between training runs that a runs report measured on this test file.
    A spread measured on other queries says nothing about these: left out of the report, with a note
    (`make demo` passes the lesson's measured spread, and another machine's stage 0 may draw other
    test queries)."""
    if path is None:
        return None
    try:
        spread = json.loads(Path(path).read_text(encoding="utf-8"))
    except (OSError, json.JSONDecodeError) as e:
        sys.exit(f"error: --runs-spread {path}: {e}")
    if not isinstance(spread, dict) or not isinstance(spread.get("delta_accuracy"), dict):
        sys.exit(
            f"error: --runs-spread {path}: no field 'delta_accuracy'; is it a spread.json of srt.runs_report?"
        )
    if spread.get("data_sha256") != data_sha256:
        print(
            f"note: --runs-spread {path}: its runs answered another test file than {data} (data_sha256 "
            "differs); report.md leaves their spread out"
        )
        return None
    return {**spread, "path": str(path)}


def main(argv=None) -> None:
    args = resolve_config(argv)
    with interruptible(
        lambda: (
            f"the answers so far are in {args.out}/<variant>.jsonl (written after every batch); "
            "the same command with --resume goes on from them"
        ),
        args.out,
    ):
        evaluate_all(args)


def evaluate_all(args) -> None:
    """Every variant on the selected records, then the report (summary.json, report.md, plots)."""
    variants = args.variants
    try:
        all_records = read_unique_records(args.data)
    except (DataError, OSError) as e:
        sys.exit(f"error: {e}")
    try:
        conversations = read_conversations(args.conversations) if args.conversations else {}
    except (DataError, OSError) as e:
        sys.exit(f"error: {e}")
    if not all_records:  # a report on n = 0 would read like a result
        sys.exit(f"error: {args.data} holds no records; nothing to evaluate")
    names = [v["name"] for v in variants]
    table2 = table2_mapping(args.table2, names)
    srt_name = srt_variant_name(variants, table2)
    out_dir = claim_out(args.out, "evaluate.py", args.resume, args.overwrite)
    args.data_sha256 = files_sha256([args.data])
    config = {k: (list(v) if isinstance(v, tuple) else v) for k, v in vars(args).items()}
    if args.resume:
        same_data_as_before(out_dir, args)
        same_settings_as_before(out_dir, args, config)
    runs_spread = read_runs_spread(args.runs_spread, args.data, args.data_sha256)
    # a missing model fails now, before config.json is written, not after the variants before it
    models = [v["model"] for v in variants if not v["model"].startswith("api:")]
    for model_name in dict.fromkeys(models + [args.cuemem_extractor_model or "smollm2-135m"]):
        check_model_name(model_name)
    random.seed(args.seed)
    torch.manual_seed(args.seed)
    records = select_examples(all_records, args.limit, args.seed)
    if args.resume:
        refuse_to_drop_rows(out_dir, args, all_records)
    write_config(out_dir, config, "evaluate.py")

    records_by_id = {r["id"]: r for r in all_records}
    rows_by_name, latency_by_name, attention = {}, {}, []
    # Load each distinct model once, run every variant that uses it, free it before the next.
    for model_name in dict.fromkeys(v["model"] for v in variants):
        group = [v for v in variants if v["model"] == model_name]
        model = tokenizer = client = None
        if model_name.startswith("api:"):
            client = ChatClient(args.api_base, model_name[4:], key_env=args.api_key_env)
        else:
            model, tokenizer = load_model_and_tokenizer(model_name, dtype=args.dtype, device=args.device)
        fingerprint = model_fingerprint(model_name, args.api_base)
        for variant in group:
            options = dict(variant["options"])
            if variant["method"] == "cuemem":  # a callable, resolved here: JSON can only name it
                spec = options["cuemem"].get("extractor")
                options["cuemem"] = {
                    **options["cuemem"],
                    "extractor": cuemem_extractor(args, spec, model, tokenizer),
                }
            key = variant_key(variant, {**options, "cuemem": variant["options"]["cuemem"]}, args, fingerprint)
            if client is not None:
                client.max_tokens = options["max_new_tokens"]
            runner = Runner(variant, args, options, model, tokenizer, client, conversations)
            chosen = [runner.view(r) for r in select_examples(all_records, options["limit"], args.seed)]
            rows_by_name[variant["name"]] = evaluate_variant(runner, chosen, out_dir, key, args.quiet)
            latency_by_name[variant["name"]] = (
                latency_sample(runner, chosen, out_dir, key, args.buckets)
                if args.latency_per_bucket > 0
                else []
            )
            if variant["name"] == srt_name and model is not None and args.attention_examples > 0:
                attention = attention_analysis(
                    model,
                    tokenizer,
                    rows_by_name[srt_name],
                    records_by_id,
                    args.attention_examples,
                    functools.partial(srt_prompt_text, tokenizer, variant["method"], options),
                    format_target,
                )
        model = tokenizer = None  # free the weights before the next model loads
        gc.collect()
        if torch.cuda.is_available():
            torch.cuda.empty_cache()

    summary = {
        "num_examples": len(records),
        "fine_buckets": list(args.buckets),
        "table2": table2,
        "srt_variant": srt_name,
        "config": config,
        "attention": attention,
        "variants": {
            v["name"]: report.summarize_variant(
                v, rows_by_name[v["name"]], latency_by_name[v["name"]], args.buckets
            )
            for v in variants
        },
        "comparisons": report.compare_variants(rows_by_name, srt_name, args.bootstrap, args.seed),
        "pairs": report.compare_pairs(rows_by_name, args.pairs, args.bootstrap, args.seed),
        "locomo_comparisons": locomo_eval.compare(rows_by_name, srt_name, args.bootstrap, args.seed),
        "runs_spread": runs_spread,
    }
    path = report.write_outputs(summary, out_dir)
    print(report.table1(summary))
    print(f"\nreport: {path}")


if __name__ == "__main__":
    main()
