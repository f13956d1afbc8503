"""The LLM teachers of §3.2 and the string-matching verification behind them.

§3.2: "we use Claude 3.7 Sonnet as a teacher model ... prompted to produce the minimal recall set
H*_t as the smallest set of historical utterances required to answer Q_t, formatted as
Turn X: 'content' ... Then we get the step-by-step reasoning from recall to concise answer, which
is strictly grounded in the content of H*_t", followed by a verification filter that confirms "no
hallucination via string matching between A*_t and H*_t".

Two teachers share one interface, the one stage 0's OracleTeacher has:

    teacher.annotate(query, history, gold_or_None, answer_or_None) -> note | None
    note = {"recall_turns": ["Turn A5: 'The Chakra Balancing service is $180.'", ...],
            "analysis", "reasoning", "answer", "answer_keys", "query_type", "derived_yes_no"}

- HFTeacher("hf:MODEL"): any local folder or model id through loading.load_model_and_tokenizer,
  greedy decoding through generation.generate, the prompt through the model's chat template.
- APITeacher("api:MODEL", api_base=..., key_env=...): an OpenAI-compatible chat-completions
  endpoint (Claude, DeepSeek, Qwen or a local vLLM server alike), over urllib.

A reply the parser cannot read gives None; the reason is counted in `teacher.stats` and returned by
`annotate_with_reason`. `gold` with a "recall" list fixes H* (LoCoMo's evidence): the teacher then
writes only the analysis, the reasoning and the answer. `answer` is the corpus's reference reply:
the teacher's answer must agree with it. Every reply is cached on disk (ResponseCache).
"""

from __future__ import annotations

import hashlib
import json
import os
import random
import re
import socket
import threading
import time
import urllib.error
import urllib.request
from collections import Counter
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from srt.data_io import atomic_write_text

# --------------------------------------------------------------------------------------------
# The prompt (§3.2): H*_t as "Turn X: 'content'", reasoning grounded in it, a concise answer
# --------------------------------------------------------------------------------------------
TEACHER_SYSTEM = (
    "You annotate conversations to teach an assistant to recall earlier turns before it answers. "
    "Each earlier utterance is labelled Q<i> (user) or A<i> (assistant) for round i. Reply with "
    "exactly these four sections, in this order, and nothing else:\n"
    "RECALL: the minimal set of earlier utterances needed to answer the current query, one per "
    "line, copied verbatim as Turn <label>: '<text>' (write RECALL: none if no earlier turn is needed)\n"
    "ANALYSIS: one short phrase saying what the user asks\n"
    "REASONING: step-by-step reasoning from the recalled turns to the answer, using only what they "
    "say; newer information overrides older\n"
    "ANSWER: a concise answer"
)
FIXED_RECALL_NOTE = (
    "The minimal recall set is already known; copy it as your RECALL section and "
    "ground your reasoning in it:\n"
)
REFERENCE_NOTE = (
    "Reference answer from the original conversation (your ANSWER must agree with it; you may shorten it): "
)


def format_history(history) -> str:
    """Labelled history, one utterance per line, as stage 0 renders it: 'Q1: ...' / 'A1: ...'."""
    return "\n".join(f"{u['label']}: {u['text']}" for u in history)


def turn_ref(utterance) -> str:
    """One element of H*_t in the paper's form: Turn A5: 'The Chakra Balancing service is $180.'"""
    return f"Turn {utterance['label']}: '{utterance['text']}'"


def teacher_messages(query, history, gold=None, answer=None) -> list[dict]:
    """The chat messages sent to the teacher for (Q_t, C_t), the fixed H* and the reference answer."""
    t = 1 + max((int(u["label"][1:]) for u in history), default=0)
    user = f"Dialogue history:\n{format_history(history) or '(empty)'}\n\nCurrent query (Q{t}): {query}"
    fixed = fixed_recall(history, gold)
    if fixed is not None:
        user += "\n\n" + FIXED_RECALL_NOTE + ("\n".join(turn_ref(u) for u in fixed) or "none")
    if answer:
        user += "\n\n" + REFERENCE_NOTE + str(answer)
    return [{"role": "system", "content": TEACHER_SYSTEM}, {"role": "user", "content": user}]


def fixed_recall(history, gold):
    """The history utterances gold fixes as H* (in history order), or None when gold fixes nothing."""
    if not gold or not isinstance(gold.get("recall"), list):
        return None
    wanted = set(gold["recall"])
    return [u for u in history if u["label"] in wanted]


def gold_is_complete(gold) -> bool:
    """True when a round's gold already holds H*, Z and A* (the oracle can serve it); otherwise an
    LLM teacher must write what is missing (§3.2)."""
    return (
        bool(gold)
        and isinstance(gold.get("recall"), list)
        and bool(gold.get("reasoning"))
        and gold.get("reasoning_source") != "template"
    )


# --------------------------------------------------------------------------------------------
# Reading the teacher's reply: tolerant of markdown, extra prose and quotes; strict on content
# --------------------------------------------------------------------------------------------
# A section starts a line: "ANSWER:", "**Answer:**", "- Final answer:", or a heading alone on its
# line ("### Reasoning"); a colon is required otherwise, so a reasoning line "Recall that ..." stays
# reasoning.
SECTION = re.compile(
    r"^[ \t>*_`-]*(?:#+[ \t]*)?(recall|analysis|reasoning|final answer|answer)\b"
    r"[ \t*_`]*(?:[:：]|$)[ \t*_`]*",
    re.IGNORECASE | re.MULTILINE,
)
RECALL_LINE = re.compile(r"(?:turn\s*)?\[?\b([QA])\s*(\d+)\b\]?\s*[:\-–—]\s*(.*)", re.IGNORECASE)
NO_RECALL = re.compile(r"^\W*(none|no earlier turn|nothing|n/?a|empty)\b", re.IGNORECASE)
QUOTES = "'\"‘’“”`"
TOKEN = re.compile(r"[a-z0-9$%]+")


def clean(text: str) -> str:
    """Strip markdown emphasis, bullets and wrapping quotes."""
    text = re.sub(r"[*_`]{1,3}", "", text).strip()
    text = re.sub(r"^[-•>]\s+", "", text)
    if len(text) >= 2 and text[0] in QUOTES and text[-1] in QUOTES:
        text = text[1:-1].strip()
    return text


def overlap(quoted: str, original: str) -> float:
    """Share of the quoted tokens that occur in the original utterance."""
    q, o = TOKEN.findall(quoted.lower()), set(TOKEN.findall(original.lower()))
    return sum(t in o for t in q) / len(q) if q else 1.0


def parse_reply(text, history, fixed=None, min_overlap=0.6) -> tuple[dict | None, str | None]:
    """The teacher's reply -> ({recall labels, analysis, reasoning, answer}, None) or (None, reason).
    A reasoning model's <think> block is ignored. A recalled label must name an earlier utterance
    and the text quoted for it must be that utterance (token overlap >= min_overlap): H* then
    carries the history's verbatim text, never the teacher's copy."""
    text = re.sub(r"<think>.*?</think>", "", str(text or ""), flags=re.S)
    marks = list(SECTION.finditer(text))
    sections = {}
    for k, m in enumerate(marks):
        name = "answer" if m[1].lower() == "final answer" else m[1].lower()
        end = marks[k + 1].start() if k + 1 < len(marks) else len(text)
        sections.setdefault(name, text[m.end() : end].strip())
    if "answer" not in sections or not clean(sections["answer"].split("\n\n")[0]):
        return None, "no_answer"
    if not clean(sections.get("reasoning", "")):
        return None, "no_reasoning"
    by_label = {u["label"]: u["text"] for u in history}
    if fixed is not None:
        recall = [u["label"] for u in fixed]
    elif "recall" not in sections:
        return None, "no_recall"
    else:
        recall = []
        body = sections["recall"]
        for line in body.splitlines():
            line = clean(line)
            m = RECALL_LINE.match(line)
            if not m:
                continue
            label, quoted = f"{m[1].upper()}{int(m[2])}", clean(m[3])
            if label not in by_label:
                return None, "recall_outside_history"
            if quoted and overlap(quoted, by_label[label]) < min_overlap:
                return None, "recall_text_mismatch"
            if label not in recall:
                recall.append(label)
        if not recall and not NO_RECALL.match(clean(body)):
            return None, "unreadable_recall"
        order = {u["label"]: k for k, u in enumerate(history)}
        recall.sort(key=order.get)
    answer = " ".join(clean(line) for line in sections["answer"].split("\n\n")[0].splitlines() if clean(line))
    return {
        "recall": recall,
        "analysis": " ".join(clean(sections.get("analysis", "")).split()).rstrip("."),
        "reasoning": clean(sections["reasoning"]),
        "answer": answer,
    }, None


# --------------------------------------------------------------------------------------------
# Verification without answer keys (§3.2): A*'s numbers and content words found in H*
# --------------------------------------------------------------------------------------------
STOPWORDS = set(
    """a an the and or but if then so of to in on at by for with from into onto over under about as is are
was were be been being am do does did done have has had having it its it's this that these those
there here i you he she we they me him her us them my your his our their mine yours what which who
whom whose when where why how not no yes yeah ok okay please thanks thank can could would should
will shall may might must just also very really too only than up down out off again all any both
each few more most other some such own same s t""".split()
)
ANSWER_TOKEN = re.compile(r"\$?\d+(?:[.,:]\d+)*%?|[A-Za-z][A-Za-z'’-]*")


def _found(token: str, text: str) -> bool:
    """`token` in `text` on word boundaries: "$20" is not found in "$207", "20" not in "20.5"."""
    return re.search(rf"(?<![\w.]){re.escape(token)}(?![\w]|[.,:]\d)", text) is not None


def grounded(answer, recalled_texts, min_word_share=0.5) -> dict:
    """Whether A* is grounded in the recalled turns by string matching (§3.2), without answer
    keys. Every number of the answer must occur in the recalled turns; of its content words (not
    stopwords, not yes/no, which are reasoned rather than copied) at least `min_word_share` must.
    -> {"grounded", "numbers_missing", "words_missing", "word_share", "checked"}."""
    evidence = " ".join(recalled_texts).lower()
    tokens = [t.lower().strip("'’-") for t in ANSWER_TOKEN.findall(str(answer))]
    numbers = [t for t in tokens if any(c.isdigit() for c in t)]
    words = [t for t in tokens if t and not any(c.isdigit() for c in t) and t not in STOPWORDS and len(t) > 1]
    numbers_missing = [n for n in numbers if not _found(n, evidence)]
    words_missing = [w for w in words if not _found(w, evidence)]
    share = 1 - len(words_missing) / len(words) if words else 1.0
    return {
        "grounded": not numbers_missing and share >= min_word_share,
        "numbers_missing": numbers_missing,
        "words_missing": words_missing,
        "word_share": round(share, 3),
        "checked": len(numbers) + len(words),
    }


# --------------------------------------------------------------------------------------------
# The response cache: a killed run resumes without paying twice; a changed prompt misses
# --------------------------------------------------------------------------------------------
class ResponseCache:
    """One JSON file per reply under `folder`, named by sha256 of (model, messages, settings). The
    file holds the key's inputs' hash, the model and the reply text: never a credential."""

    def __init__(self, folder):
        self.folder = Path(folder) if folder else None

    @staticmethod
    def key(model, messages, settings) -> str:
        blob = json.dumps(
            {"model": model, "messages": messages, "settings": settings}, sort_keys=True, ensure_ascii=False
        )
        return hashlib.sha256(blob.encode()).hexdigest()

    def _path(self, key) -> Path:
        return self.folder / key[:2] / f"{key}.json"

    def get(self, key):
        if self.folder is None or not self._path(key).exists():
            return None
        try:
            return json.loads(self._path(key).read_text(encoding="utf-8"))["content"]
        except (OSError, ValueError, KeyError):
            return None  # a torn or foreign file is a miss, and is rewritten

    def put(self, key, model, content) -> None:
        if self.folder is not None:
            atomic_write_text(
                self._path(key),
                json.dumps({"key": key, "model": model, "content": content}, ensure_ascii=False),
            )


# --------------------------------------------------------------------------------------------
# The shared teacher: prompt -> cached completion -> parsed note
# --------------------------------------------------------------------------------------------
class LLMTeacher:
    """What both teachers share; subclasses implement `_complete_batch(list of messages)` returning
    one (text | None, failure reason | None) per prompt."""

    def __init__(self, model, cache_dir=None, settings=None, max_concurrency=1):
        self.model, self.settings = model, dict(settings or {})
        self.cache = ResponseCache(cache_dir)
        self.max_concurrency = max(1, int(max_concurrency))
        self.stats = Counter()
        self._lock = threading.Lock()

    @property
    def name(self) -> str:
        return self.model

    def count(self, key, n=1) -> None:
        with self._lock:
            self.stats[key] += n

    def _complete_cached(self, batch) -> list[tuple[str | None, str | None]]:
        keys = [ResponseCache.key(self.model, m, self.settings) for m in batch]
        results = [(self.cache.get(k), None) for k in keys]
        todo = [i for i, (text, _) in enumerate(results) if text is None]
        self.count("cache_hits", len(batch) - len(todo))
        if todo:
            for i, (text, reason) in zip(todo, self._complete_batch([batch[i] for i in todo])):
                if text is not None:
                    self.cache.put(keys[i], self.model, text)
                results[i] = (text, reason)
        return results

    def _note(self, text, reason, history, gold, answer):
        if text is None:
            self.count(f"rejected:{reason}")
            return None, reason
        fixed = fixed_recall(history, gold)
        parsed, reason = parse_reply(text, history, fixed)
        if parsed is None:
            self.count(f"rejected:{reason}")
            return None, reason
        by_label = {u["label"]: u for u in history}
        gold = gold or {}
        self.count("annotated")
        return {
            "recall_turns": [turn_ref(by_label[label]) for label in parsed["recall"]],
            "analysis": parsed["analysis"] or "what the user needs",
            "reasoning": parsed["reasoning"],
            "answer": parsed["answer"],
            "answer_keys": list(gold.get("answer_keys", [])),
            "query_type": gold.get("query_type", "teacher" if parsed["recall"] else "none"),
            "derived_yes_no": bool(gold.get("derived_yes_no")),
            "reference_answer": None if answer is None else str(answer),
        }, None

    def annotate_many(self, items, batch_size=8) -> list[tuple[dict | None, str | None]]:
        """items: (query, history, gold | None, answer | None) tuples -> (note | None, reason | None)
        each, in order. Prompts go out in batches (HF) or concurrently (API)."""
        items = list(items)
        out = []
        for start in range(0, len(items), batch_size):
            chunk = items[start : start + batch_size]
            replies = self._complete_cached([teacher_messages(*item) for item in chunk])
            out.extend(
                self._note(text, reason, item[1], item[2], item[3])
                for (text, reason), item in zip(replies, chunk)
            )
        return out

    def annotate_with_reason(self, query, history, gold=None, answer=None):
        return self.annotate_many([(query, history, gold, answer)])[0]

    def annotate(self, query, history, gold=None, answer=None) -> dict | None:
        """stage 0's teacher interface: the note, or None when the reply could not be read."""
        return self.annotate_with_reason(query, history, gold, answer)[0]


class HFTeacher(LLMTeacher):
    """A local model as the teacher: `hf:` + a folder, a Hugging Face id, 'smollm2-135m' or
    'tiny-random'. Greedy decoding, so a reply is a function of the prompt (and the cache exact)."""

    def __init__(
        self, spec, cache_dir=None, max_new_tokens=384, device=None, dtype="auto", trust_remote_code=False
    ):
        name = spec[3:] if spec.startswith("hf:") else spec
        super().__init__(f"hf:{name}", cache_dir, {"max_new_tokens": max_new_tokens, "greedy": True})
        self.model_name, self.max_new_tokens, self.device, self.dtype = name, max_new_tokens, device, dtype
        self.trust_remote_code = trust_remote_code
        self._loaded = None

    def __repr__(self):
        return f"HFTeacher({self.model!r})"

    def _complete_batch(self, batch):
        from srt.generation import generate
        from srt.loading import load_model_and_tokenizer
        from srt.precision import resolve_dtype
        from srt.prompt import render_chat

        if self._loaded is None:  # loaded on the first cache miss: a fully cached run never loads it
            import torch

            device = self.device or ("cuda" if torch.cuda.is_available() else None)
            self._loaded = load_model_and_tokenizer(
                self.model_name, dtype=self.dtype, device=device, trust_remote_code=self.trust_remote_code
            )
        model, tokenizer = self._loaded
        prompts = [render_chat(tokenizer, messages) for messages in batch]
        _, autocast_dtype = resolve_dtype(self.dtype, next(model.parameters()).device)
        self.count("requests", len(batch))
        out = generate(
            model,
            tokenizer,
            prompts,
            max_new_tokens=self.max_new_tokens,
            greedy=True,
            autocast_dtype=autocast_dtype,
        )
        return [(text, None) for text in out["texts"]]


class APIError(Exception):
    def __init__(self, reason, retryable, retry_after=None):
        super().__init__(reason)
        self.reason, self.retryable, self.retry_after = reason, retryable, retry_after


class APITeacher(LLMTeacher):
    """An OpenAI-compatible chat-completions endpoint: POST {api_base}/chat/completions.

    The key is read once from the environment variable `key_env` and only ever put in the
    Authorization header: not in reprs, messages, stats or the cache (error texts are scrubbed
    of it, in case a server echoes it). Each request times out after `timeout` s. A 429, a 5xx, a
    timeout or a dropped connection is retried up to `retries` more times, waiting
    backoff_base * 2^attempt plus up to as much again of random jitter (or the server's
    Retry-After, capped at max_backoff); no wait follows the last try. Other 4xx fail at once. A
    200 whose body is not a chat completion is not retried: counted as malformed_response."""

    def __init__(
        self,
        spec,
        api_base="https://api.openai.com/v1",
        key_env="OPENAI_API_KEY",
        cache_dir=None,
        max_concurrency=4,
        timeout=120.0,
        retries=4,
        backoff_base=1.0,
        max_backoff=60.0,
        temperature=0.0,
        max_tokens=1024,
        seed=0,
    ):
        name = spec[4:] if spec.startswith("api:") else spec
        # the endpoint is not part of the cache key: one model id behind another proxy or port
        # gives the same replies, and a run moved to a new host must not pay twice
        super().__init__(
            f"api:{name}", cache_dir, {"temperature": temperature, "max_tokens": max_tokens}, max_concurrency
        )
        self.model_name, self.url = name, api_base.rstrip("/") + "/chat/completions"
        self.key_env, self._key = key_env, os.environ.get(key_env, "")
        self.timeout, self.retries = float(timeout), int(retries)
        self.backoff_base, self.max_backoff = float(backoff_base), float(max_backoff)
        self.temperature, self.max_tokens = temperature, max_tokens
        self._rng = random.Random(seed)

    def __repr__(self):
        return f"APITeacher(model={self.model_name!r}, url={self.url!r}, key_env={self.key_env!r})"

    def _scrub(self, text) -> str:
        text = str(text)[:300]
        return text.replace(self._key, "***") if self._key else text

    def _request(self, messages) -> str:
        body = json.dumps(
            {
                "model": self.model_name,
                "messages": messages,
                "temperature": self.temperature,
                "max_tokens": self.max_tokens,
            }
        ).encode()
        headers = {"Content-Type": "application/json"}
        if self._key:
            headers["Authorization"] = f"Bearer {self._key}"
        request = urllib.request.Request(self.url, data=body, headers=headers, method="POST")
        self.count("requests")
        try:
            with urllib.request.urlopen(request, timeout=self.timeout) as response:
                raw = response.read()
        except urllib.error.HTTPError as e:
            retryable = e.code == 429 or e.code >= 500
            retry_after = e.headers.get("Retry-After") if e.headers else None
            raise APIError(
                f"http_{e.code}",
                retryable,
                float(retry_after) if retry_after and retry_after.isdigit() else None,
            ) from None
        except (socket.timeout, TimeoutError):
            raise APIError("timeout", True) from None
        except urllib.error.URLError as e:
            timed_out = isinstance(e.reason, (socket.timeout, TimeoutError))
            raise APIError("timeout" if timed_out else f"connection: {self._scrub(e.reason)}", True) from None
        except (ConnectionError, OSError) as e:
            raise APIError(f"connection: {type(e).__name__}", True) from None
        try:
            content = json.loads(raw)["choices"][0]["message"]["content"]
        except (ValueError, KeyError, IndexError, TypeError):
            raise APIError("malformed_response", False) from None
        if not isinstance(content, str):
            raise APIError("malformed_response", False)
        return content

    def complete(self, messages) -> tuple[str | None, str | None]:
        """One prompt -> (reply text, None) or (None, failure reason), with the retry policy above."""
        for attempt in range(self.retries + 1):
            try:
                return self._request(messages), None
            except APIError as e:
                if not e.retryable or attempt == self.retries:
                    return None, e.reason.split(":")[0]
                self.count("retries")
                delay = self.backoff_base * 2**attempt
                with self._lock:
                    delay += self._rng.uniform(0, delay)
                if e.retry_after is not None:
                    delay = max(delay, e.retry_after)
                time.sleep(min(delay, self.max_backoff))
        return None, "no_try"  # retries < 0

    def _complete_batch(self, batch):
        if self.max_concurrency == 1 or len(batch) == 1:
            return [self.complete(messages) for messages in batch]
        with ThreadPoolExecutor(max_workers=min(self.max_concurrency, len(batch))) as pool:
            return list(pool.map(self.complete, batch))

    def annotate_many(self, items, batch_size=None):
        # every prompt in flight at once, up to max_concurrency
        return super().annotate_many(items, batch_size or 4 * self.max_concurrency)


HF_OPTIONS = ("cache_dir", "max_new_tokens", "device", "dtype", "trust_remote_code")
API_OPTIONS = (
    "cache_dir",
    "api_base",
    "key_env",
    "max_concurrency",
    "timeout",
    "retries",
    "backoff_base",
    "max_backoff",
    "temperature",
    "max_tokens",
    "seed",
)


def make_teacher(spec, **options):
    """'hf:MODEL' -> HFTeacher, 'api:MODEL' -> APITeacher. Each takes the options it knows (cache_dir
    for both; api_base, key_env, max_concurrency, timeout, retries for the API; device, dtype,
    trust_remote_code for hf); max_new_tokens is the API's max_tokens. None means the default."""
    options = {k: v for k, v in options.items() if v is not None}
    if spec.startswith("hf:") and len(spec) > 3:
        return HFTeacher(spec, **{k: v for k, v in options.items() if k in HF_OPTIONS})
    if spec.startswith("api:") and len(spec) > 4:
        if "max_new_tokens" in options:
            options.setdefault("max_tokens", options["max_new_tokens"])
        return APITeacher(spec, **{k: v for k, v in options.items() if k in API_OPTIONS})
    raise ValueError(f"--teacher {spec!r}: use oracle, hf:MODEL or api:MODEL")


# --------------------------------------------------------------------------------------------
# The client for OpenAI-compatible chat APIs (the §3.2 teacher; SRT-P on closed models, §4.8)
# --------------------------------------------------------------------------------------------
class ChatClient:
    """POST {api_base}/chat/completions of an OpenAI-compatible chat API: evaluate.py's api: models
    (SRT-P on closed models) and CueMem's LLM extractor. The key is read from an environment
    variable and never printed; errors name the endpoint but not the key."""

    def __init__(
        self,
        api_base: str,
        model: str,
        key_env: str = "OPENAI_API_KEY",
        temperature: float = 0.0,
        max_tokens: int = 512,
        timeout: float = 120.0,
        retries: int = 3,
    ):
        self.url = api_base.rstrip("/") + "/chat/completions"
        self.model, self.temperature, self.max_tokens = model, temperature, max_tokens
        self.timeout, self.retries = timeout, retries
        self._key = os.environ.get(key_env, "")

    def __repr__(self):  # keeps the key out of logs
        return f"ChatClient(url={self.url!r}, model={self.model!r})"

    def chat(self, messages: list[dict]) -> str:
        body = json.dumps(
            {
                "model": self.model,
                "messages": messages,
                "temperature": self.temperature,
                "max_tokens": self.max_tokens,
            }
        ).encode()
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
                time.sleep(2**attempt)
        raise RuntimeError(f"chat API {self.url} failed after {self.retries} tries: {last_error}")
