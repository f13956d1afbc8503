"""teacher.py: the API teacher against a local chat-completions server on 127.0.0.1 (answers,
429/500 retried, 400 not, malformed bodies and timeouts counted, the cache serving a second run,
the key kept out of the cache), the reply parser, the hf teacher on tiny-random, and the
string-matching grounding check of §3.2."""

import json
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest

from srt.data import teacher as T

KEY = "sk-test-0123456789-secret"
HISTORY = [
    {"label": "Q1", "speaker": "user", "text": "I'm under Apex Tier."},
    {"label": "A1", "speaker": "assistant", "text": "Apex Tier gives you 15% off any service over $150."},
    {"label": "Q2", "speaker": "user", "text": "How much is the Chakra Balancing?"},
    {"label": "A2", "speaker": "assistant", "text": "The Chakra Balancing service is $180."},
]
GOOD_REPLY = (
    "RECALL:\nTurn A1: 'Apex Tier gives you 15% off any service over $150.'\n"
    "Turn A2: 'The Chakra Balancing service is $180.'\n"
    "ANALYSIS: the price after the member discount\n"
    "REASONING: A2 puts the service at $180, over $150, so A1's 15% applies: 180 - 27 = 153.\n"
    "ANSWER: $153"
)


class ChatServer:
    """A chat-completions endpoint on 127.0.0.1 that plays a script: each request takes the next
    action ('ok', 429, 500, 400, 'malformed', ('sleep', s)); when the script runs out it answers
    `default` (a string, or a function of the request body that returns one). It records every
    request's headers and body and the most requests in flight."""

    def __init__(self, script=(), default=GOOD_REPLY):
        self.script, self.default = list(script), default
        self.requests, self.in_flight, self.max_in_flight = [], 0, 0
        self.lock = threading.Lock()
        server = self

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *args):
                pass

            def do_POST(self):
                body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
                with server.lock:
                    server.requests.append({"path": self.path, "headers": dict(self.headers), "body": body})
                    action = server.script.pop(0) if server.script else "ok"
                    server.in_flight += 1
                    server.max_in_flight = max(server.max_in_flight, server.in_flight)
                try:
                    if isinstance(action, tuple):
                        time.sleep(action[1])
                        action = "ok"
                    if isinstance(action, int):
                        self.send_response(action)
                        self.send_header("Content-Type", "application/json")
                        self.end_headers()
                        self.wfile.write(b'{"error": {"message": "nope"}}')
                        return
                    content = server.default(body) if callable(server.default) else server.default
                    payload = (
                        b"<html>502 from a proxy</html>"
                        if action == "malformed"
                        else json.dumps(
                            {"choices": [{"message": {"role": "assistant", "content": content}}]}
                        ).encode()
                    )
                    self.send_response(200)
                    self.send_header("Content-Type", "application/json")
                    self.send_header("Content-Length", str(len(payload)))
                    self.end_headers()
                    self.wfile.write(payload)
                except (BrokenPipeError, ConnectionResetError):
                    pass  # the client timed out and hung up
                finally:
                    with server.lock:
                        server.in_flight -= 1

        self.httpd = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.httpd.daemon_threads = True
        self.base = f"http://127.0.0.1:{self.httpd.server_address[1]}/v1"
        self.thread = threading.Thread(target=self.httpd.serve_forever, daemon=True)

    def __enter__(self):
        self.thread.start()
        return self

    def __exit__(self, *exc):
        self.httpd.shutdown()
        self.httpd.server_close()


def api_teacher(server, tmp_path, monkeypatch, **options):
    monkeypatch.setenv("SRT_TEST_KEY", KEY)
    settings = dict(
        api_base=server.base,
        key_env="SRT_TEST_KEY",
        cache_dir=tmp_path / "cache",
        timeout=2.0,
        retries=3,
        backoff_base=0.001,
        max_concurrency=1,
    )
    settings.update(options)
    return T.APITeacher("api:test-model", **settings)


def ask(t, query="What would I pay for the Chakra Balancing?"):
    return t.annotate_with_reason(query, HISTORY, None, None)


# ---- the API teacher ---------------------------------------------------------------------------
def test_api_normal_answer(tmp_path, monkeypatch):
    with ChatServer() as server:
        note, reason = ask(api_teacher(server, tmp_path, monkeypatch))
    assert reason is None and len(server.requests) == 1
    assert note["recall_turns"] == [
        "Turn A1: 'Apex Tier gives you 15% off any service over $150.'",
        "Turn A2: 'The Chakra Balancing service is $180.'",
    ]
    assert note["answer"] == "$153" and note["analysis"] == "the price after the member discount"
    assert set(note) >= {
        "recall_turns",
        "analysis",
        "reasoning",
        "answer",
        "answer_keys",
        "query_type",
        "derived_yes_no",
    }
    request = server.requests[0]
    assert request["path"] == "/v1/chat/completions" and request["body"]["model"] == "test-model"
    assert request["headers"]["Authorization"] == f"Bearer {KEY}"
    assert request["body"]["messages"][0]["content"] == T.TEACHER_SYSTEM
    assert "Current query (Q3): What would I pay" in request["body"]["messages"][1]["content"]


@pytest.mark.parametrize("status", [429, 500, 503])
def test_api_retries_429_and_5xx_then_succeeds(tmp_path, monkeypatch, status):
    with ChatServer([status]) as server:
        t = api_teacher(server, tmp_path, monkeypatch)
        note, reason = ask(t)
    assert reason is None and note["answer"] == "$153"
    assert len(server.requests) == 2 and t.stats["retries"] == 1


def test_api_400_is_not_retried(tmp_path, monkeypatch):
    with ChatServer([400]) as server:
        t = api_teacher(server, tmp_path, monkeypatch)
        note, reason = ask(t)
    assert note is None and reason == "http_400" and len(server.requests) == 1
    assert t.stats["rejected:http_400"] == 1 and t.stats["retries"] == 0


def test_api_malformed_body_is_counted_not_raised(tmp_path, monkeypatch):
    with ChatServer(["malformed"]) as server:
        t = api_teacher(server, tmp_path, monkeypatch)
        note, reason = ask(t)
    assert note is None and reason == "malformed_response" and len(server.requests) == 1
    assert t.stats["rejected:malformed_response"] == 1
    assert not list((tmp_path / "cache").rglob("*.json"))  # nothing paid for, nothing cached


def test_api_timeout_retried_then_given_up(tmp_path, monkeypatch):
    with ChatServer([("sleep", 1.0), ("sleep", 1.0)]) as server:
        t = api_teacher(server, tmp_path, monkeypatch, timeout=0.2, retries=1)
        start = time.time()
        note, reason = ask(t)
        took = time.time() - start
    assert note is None and reason == "timeout" and len(server.requests) == 2 and took < 1.5


def test_api_no_sleep_after_the_last_try(tmp_path, monkeypatch):
    sleeps = []
    monkeypatch.setattr(T.time, "sleep", sleeps.append)
    with ChatServer([500, 500, 500]) as server:
        t = api_teacher(server, tmp_path, monkeypatch, retries=2, backoff_base=0.5, max_backoff=60)
        note, reason = ask(t)
    assert note is None and reason == "http_500" and len(server.requests) == 3
    assert len(sleeps) == 2  # between the tries, none after the last
    assert 0.5 <= sleeps[0] <= 1.0 and 1.0 <= sleeps[1] <= 2.0  # base * 2^k plus up to as much jitter


def test_api_second_run_is_served_from_the_cache_and_keeps_no_key(tmp_path, monkeypatch):
    queries = [f"What would I pay for the Chakra Balancing, question {i}?" for i in range(6)]
    items = [(q, HISTORY, None, None) for q in queries]
    with ChatServer() as server:
        t = api_teacher(server, tmp_path, monkeypatch, max_concurrency=3)
        first = t.annotate_many(items)
        paid = len(server.requests)
    assert paid == 6 and all(reason is None for _, reason in first)
    with ChatServer([400] * 10) as server:  # a second run: any request would fail
        t2 = api_teacher(server, tmp_path, monkeypatch)
        second = t2.annotate_many(items)
        assert len(server.requests) == 0 and t2.stats["cache_hits"] == 6
        assert second == first
        note, reason = ask(t2, "A question never asked before?")  # a changed prompt misses the cache
        assert len(server.requests) == 1 and reason == "http_400"
    files = list((tmp_path / "cache").rglob("*.json"))
    assert len(files) == 6
    for f in files:
        text = f.read_text()
        assert KEY not in text and "Authorization" not in text and "Bearer" not in text
    assert KEY not in repr(t2) and KEY not in json.dumps(t2.stats)
    changed = T.ResponseCache.key("api:test-model", [{"role": "user", "content": "x"}], {"temperature": 0.0})
    assert changed != T.ResponseCache.key(
        "api:test-model", [{"role": "user", "content": "x"}], {"temperature": 0.7}
    )


def test_api_concurrency(tmp_path, monkeypatch):
    with ChatServer([("sleep", 0.3)] * 4) as server:
        t = api_teacher(server, tmp_path, monkeypatch, max_concurrency=4)
        start = time.time()
        results = t.annotate_many([(f"question {i}?", HISTORY, None, None) for i in range(4)])
        took = time.time() - start
    assert all(note for note, _ in results) and server.max_in_flight > 1 and took < 1.0


def test_api_fixed_recall_and_reference_answer(tmp_path, monkeypatch):
    """gold with a recall list (LoCoMo's evidence) fixes H*: the teacher is shown it and writes
    the rest; its own RECALL section is not what counts."""
    reply = (
        "RECALL: Turn Q1: 'I'm under Apex Tier.'\nANALYSIS: the price\nREASONING: A2 says $180.\nANSWER: $180"
    )
    with ChatServer(default=reply) as server:
        t = api_teacher(server, tmp_path, monkeypatch)
        note = t.annotate(
            "How much is it?",
            HISTORY,
            {"recall": ["A2"], "answer_keys": ["$180"], "query_type": "price"},
            "$180",
        )
    sent = server.requests[0]["body"]["messages"][1]["content"]
    assert "Turn A2: 'The Chakra Balancing service is $180.'" in sent and T.REFERENCE_NOTE + "$180" in sent
    assert note["recall_turns"] == ["Turn A2: 'The Chakra Balancing service is $180.'"]
    assert (
        note["answer_keys"] == ["$180"]
        and note["query_type"] == "price"
        and note["reference_answer"] == "$180"
    )


# ---- reading replies -----------------------------------------------------------------------------
def test_parse_tolerates_markdown_prose_and_quotes():
    reply = (
        "Sure! Here is the annotation.\n\n**Recall:**\n"
        "- Turn **A2**: \u201cThe Chakra Balancing service is $180.\u201d\n"
        '- Turn Q1: "I\'m under Apex Tier"\n\n**Analysis:** the discounted price.\n\n### Reasoning\n'
        'Recall that Apex gives a discount.\nSo $153.\n\n**Final Answer:** "$153"\n\nHope this helps!'
    )
    parsed, reason = T.parse_reply(reply, HISTORY)
    assert reason is None and parsed["recall"] == ["Q1", "A2"] and parsed["answer"] == "$153"
    assert (
        parsed["reasoning"] == "Recall that Apex gives a discount.\nSo $153."
    )  # "Recall that" is not a section
    think = (
        "<think>RECALL: Turn Q9: 'x'</think>RECALL: none\nANALYSIS: a greeting\n"
        "REASONING: nothing earlier\nANSWER: Hi!"
    )
    assert T.parse_reply(think, HISTORY) == (
        {"recall": [], "analysis": "a greeting", "reasoning": "nothing earlier", "answer": "Hi!"},
        None,
    )


@pytest.mark.parametrize(
    "reply, reason",
    [
        ("I cannot help with that.", "no_answer"),
        ("RECALL: Turn A1: 'x'\nANSWER: $153", "no_reasoning"),
        ("ANALYSIS: x\nREASONING: y\nANSWER: $153", "no_recall"),
        ("RECALL: Turn A7: 'The service is $180.'\nREASONING: y\nANSWER: $180", "recall_outside_history"),
        (
            "RECALL: Turn A2: 'We open at nine on Sundays.'\nREASONING: y\nANSWER: $180",
            "recall_text_mismatch",
        ),
        ("RECALL: the second answer\nREASONING: y\nANSWER: $180", "unreadable_recall"),
    ],
)
def test_parse_rejects_what_it_cannot_read(reply, reason):
    assert T.parse_reply(reply, HISTORY) == (None, reason)


# ---- the hf teacher --------------------------------------------------------------------------------
def test_hf_teacher_on_tiny_random_counts_and_drops_unreadable(tmp_path, one_thread):
    items = [(f"What would I pay, take {i}?", HISTORY, None, None) for i in range(3)]
    t = T.make_teacher("hf:tiny-random", cache_dir=tmp_path / "cache", max_new_tokens=12, dtype="float32")
    results = t.annotate_many(items)
    assert [note for note, _ in results] == [None, None, None]
    assert sum(v for k, v in t.stats.items() if k.startswith("rejected:")) == 3 and t.stats["requests"] == 3
    again = T.HFTeacher("hf:tiny-random", cache_dir=tmp_path / "cache", max_new_tokens=12, dtype="float32")
    assert again.annotate_many(items) == results and again.stats["cache_hits"] == 3
    assert again._loaded is None  # a fully cached run never loads the model


# ---- grounding (§3.2's string matching) ------------------------------------------------------------
def test_grounded_matches_on_word_boundaries():
    assert not T.grounded("$20", ["The mat is $207."])["grounded"]
    assert T.grounded("$20", ["The mat is $20."])["grounded"]
    assert not T.grounded("20", ["It weighs 20.5 kg"])["grounded"]
    assert T.grounded("It is $180", ["The Chakra Balancing service is $180."])["grounded"]
    detail = T.grounded("Lisbon on Friday", ["We fly to Lisbon."])
    assert detail["words_missing"] == ["friday"] and detail["word_share"] == 0.5 and detail["grounded"]
    assert not T.grounded("Lisbon on Friday", ["We fly to Lisbon."], min_word_share=1.0)["grounded"]
    assert T.grounded("Yes.", [])["grounded"] and T.grounded("Yes.", [])["checked"] == 0
    assert not T.grounded("Madrid", [])["grounded"]


def test_make_teacher_specs():
    assert isinstance(T.make_teacher("api:m", api_base="http://127.0.0.1:9"), T.APITeacher)
    with pytest.raises(ValueError, match="hf:MODEL or api:MODEL"):
        T.make_teacher("gpt-4")
    assert T.gold_is_complete({"recall": [], "reasoning": "r"}) and not T.gold_is_complete({"recall": ["A1"]})
    assert not T.gold_is_complete({"recall": [], "reasoning": "r", "reasoning_source": "template"})
