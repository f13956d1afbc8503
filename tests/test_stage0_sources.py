"""Stage 0 (§3.2) on the real sources: each corpus's fixture (tests/test_corpora.py) end to end
through stage0_build.main, with the oracle where the corpus carries gold and with the API teacher
(a chat-completions server on 127.0.0.1) otherwise; the API run repeated from its cache; hf:tiny-random;
LoCoMo's H* = evidence, its split groups, and a LoCoMo file at the release's scale.

Eq. (2) needs only cosines, so a hashing bag-of-words embedder stands in for all-MiniLM-L6-v2
(tests/test_stage0.py runs the real one on the synthetic corpus)."""

import json
import random
import re
import zlib
from collections import Counter

import numpy as np
import pytest
from test_corpora import (
    PLANTED,
    chitchat_fixture,
    coqa_fixture,
    dailydialog_fixture,
    jsonl_fixture,
    locomo_fixture,
    mgshopdial_fixture,
    multiwoz_fixture,
    redial_fixture,
)
from test_teacher import KEY, ChatServer

import stage0_build as s0
from srt.config import LOCK_NAME
from srt.data import teacher as T
from srt.data_io import read_jsonl, validate_record

SPLITS = ("train", "dev", "test")


def hashed_embed(texts, *_, **__):
    out = np.zeros((len(texts), 384), np.float32)
    for i, text in enumerate(texts):
        for word in re.findall(r"[a-z0-9$]+", text.lower()):
            out[i, zlib.crc32(word.encode()) % 384] += 1.0
    return out / np.maximum(np.linalg.norm(out, axis=1, keepdims=True), 1e-9)


@pytest.fixture(autouse=True)
def no_embedder(monkeypatch):
    monkeypatch.setattr(s0, "embed", hashed_embed)


def reads_its_prompt(body):
    """A teacher reply built from the prompt: the fixed H* when one is given (then the reference
    answer), else the history utterance sharing most words with the query (then its first words)."""
    user = body["messages"][1]["content"]
    history = dict(re.findall(r"^([QA]\d+): (.+)$", user.split("\n\nCurrent query")[0], re.M))
    query = re.search(r"Current query \(Q\d+\): (.*)", user)[1]
    reference = user.split(T.REFERENCE_NOTE)[1].strip() if T.REFERENCE_NOTE in user else ""
    if T.FIXED_RECALL_NOTE in user:
        recall, answer = user.split(T.FIXED_RECALL_NOTE)[1].split("\n\n")[0], reference
    else:
        words = set(query.lower().split())
        label = max(history, key=lambda lb: (len(words & set(history[lb].lower().split())), int(lb[1:]), lb))
        recall, answer = f"Turn {label}: '{history[label]}'", " ".join(history[label].split()[:6])
    return (
        f"RECALL:\n{recall}\nANALYSIS: what the user asks\nREASONING: The recalled turns say so.\n"
        f"ANSWER: {answer}"
    )


SOURCES = {  # source -> (fixture writer, flags its fixture needs)
    "locomo": (locomo_fixture, []),
    "coqa": (coqa_fixture, []),
    "multiwoz": (lambda tmp: multiwoz_fixture(tmp)[0], []),
    "dailydialog": (dailydialog_fixture, []),
    "redial": (redial_fixture, ["--on-error", "skip"]),  # two malformed lines
    "mgshopdial": (mgshopdial_fixture, ["--queries", "qa"]),
    "chitchat": (chitchat_fixture, []),
    "jsonl": (jsonl_fixture, ["--on-error", "skip"]),  # one gold names a turn that does not exist
}


def build(out, source, path, *flags):
    """stage0 on a tiny fixture: the §3.2 length filter and Eq. (2)'s selection relaxed so that
    every query round reaches the teacher."""
    s0.main(
        [
            "--source",
            source,
            "--path",
            str(path),
            "--out",
            str(out),
            "--min-rounds",
            "2",
            "--threshold",
            "0.3",
            "--quiet",
            *flags,
        ]
    )
    records = [r for split in SPLITS for r in read_jsonl(out / f"{split}.jsonl")]
    return records, json.loads((out / "stats.json").read_text())


OUTPUTS = (*(f"{split}.jsonl" for split in SPLITS), "stats.json", "config.json", "conversations.jsonl")


def failed_build(out, source, path, *flags) -> dict:
    """A build that keeps no record: a one-line error naming its input and the drops, and no output
    written. Returns the drop counts the message names."""
    with pytest.raises(SystemExit) as e:
        build(out, source, path, *flags)
    message = str(e.value)
    assert message.startswith(f"error: no records survived the build of {path} ") and "\n" not in message
    assert not any((out / name).exists() for name in OUTPUTS)
    dropped = re.search(r"dropped: (.*)\); nothing written to ", message)[1]
    return {key: int(n) for key, n in (item.rsplit(" ", 1) for item in dropped.split(", "))}


def accounted(stats):
    """Every query round a loader marked is a record or a counted drop."""
    dropped = sum(v for k, v in stats["dropped"].items() if k.startswith(("teacher:", "verification:")))
    return stats["queries"] + dropped == stats["source_report"]["queries"]


# ---- every source, end to end -------------------------------------------------------------------
@pytest.mark.parametrize("source", sorted(SOURCES))
def test_each_source_end_to_end(tmp_path, monkeypatch, source):
    writer, flags = SOURCES[source]
    path = writer(tmp_path)
    if source == "locomo":  # gold for every query
        records, stats = build(tmp_path / "oracle", source, path, *flags)
        assert records and accounted(stats) and stats["source"] == source
        assert "teacher:no_gold_for_oracle" not in stats["dropped"]
    elif source == "jsonl":  # one round without gold; the other gold's "$153" is derived, not in H*
        dropped = failed_build(tmp_path / "oracle", source, path, *flags)
        assert dropped["teacher:no_gold_for_oracle"] == 1 and dropped["verification:ungrounded_answer"] == 1
    else:
        with pytest.raises(SystemExit, match="carries no gold answers"):
            build(tmp_path / "oracle", source, path, *flags)

    monkeypatch.setenv("SRT_TEST_KEY", KEY)
    with ChatServer(default=reads_its_prompt) as server:
        records, stats = build(
            tmp_path / "api",
            source,
            path,
            *flags,
            "--teacher",
            "api:test-model",
            "--api-base",
            server.base,
            "--api-key-env",
            "SRT_TEST_KEY",
            "--max-concurrency",
            "2",
        )
    assert records and accounted(stats) and stats["teacher"]["requests"] == len(server.requests) > 0
    for r in records:
        validate_record(r)
        assert (
            r["source"] == source and r["meta"]["teacher"] == "api:test-model" and s0.verify_record(r) is None
        )
        assert r["meta"]["reference_answer"] and r["meta"]["reasoning_source"] == "teacher"
        if r["recall"] and not r["answer_keys"]:
            assert r["meta"]["grounding"]["grounded"] or r["meta"].get("derived_answer")
    for f in (tmp_path / "api").rglob("*.json*"):
        assert KEY not in f.read_text()


def test_api_teacher_second_run_from_cache(tmp_path, monkeypatch):
    monkeypatch.setenv("SRT_TEST_KEY", KEY)
    path = locomo_fixture(tmp_path)
    flags = [
        "--teacher",
        "api:test-model",
        "--api-key-env",
        "SRT_TEST_KEY",
        "--teacher-cache",
        str(tmp_path / "cache"),
    ]
    with ChatServer(default=reads_its_prompt) as server:
        first, stats = build(tmp_path / "a", "locomo", path, *flags, "--api-base", server.base)
        paid = len(server.requests)
    assert paid == 9 and len(first) == 9 and stats["teacher"]["requests"] == 9
    with ChatServer([400] * 50) as server:  # any request now fails
        second, stats = build(tmp_path / "b", "locomo", path, *flags, "--api-base", server.base)
        assert len(server.requests) == 0
    assert stats["teacher"] == {"name": "api:test-model", "cache_hits": 9, "annotated": 9}
    for split in SPLITS:
        assert (tmp_path / "a" / f"{split}.jsonl").read_bytes() == (
            tmp_path / "b" / f"{split}.jsonl"
        ).read_bytes()
    for r in second:  # the teacher wrote Z, but H* is LoCoMo's evidence
        assert r["recall"] == evidence_labels(r)


def test_api_teacher_on_real_chitchat_runs_concurrently_across_dialogues(tmp_path):
    """One query per dialogue: the requests of different dialogues are in flight together."""
    with ChatServer([("sleep", 0.2)] * 12, default=reads_its_prompt) as server:
        s0.main(
            [
                "--source",
                "chitchat",
                "--limit",
                "12",
                "--out",
                str(tmp_path),
                "--min-rounds",
                "2",
                "--threshold",
                "0.3",
                "--quiet",
                "--teacher",
                "api:m",
                "--api-base",
                server.base,
                "--max-concurrency",
                "4",
            ]
        )
    stats = json.loads((tmp_path / "stats.json").read_text())
    assert len(server.requests) == stats["teacher"]["requests"] >= 10 and server.max_in_flight > 1
    assert stats["queries"] > 0 and accounted(stats)


def test_api_failures_are_counted_drops(tmp_path, monkeypatch):
    with ChatServer(["malformed", 400]) as server:
        dropped = failed_build(
            tmp_path / "x",
            "coqa",
            coqa_fixture(tmp_path),
            "--teacher",
            "api:test-model",
            "--api-base",
            server.base,
            "--max-concurrency",
            "1",
        )
    assert len(server.requests) == 2  # the fixture's two queries, each a counted drop
    assert dropped == {"teacher:malformed_response": 1, "teacher:http_400": 1}


def test_ungrounded_teacher_answer_is_dropped_unless_derived(tmp_path, monkeypatch):
    """No answer keys: §3.2's string matching between A* and H* decides; a LoCoMo answer (derived
    from session dates) that fails it is kept and reported."""
    invent = "RECALL:\nTurn Q1: '{q1}'\nANALYSIS: x\nREASONING: y\nANSWER: Zanzibar on 31 March"
    with ChatServer(
        default=lambda body: invent.format(
            q1=re.search(r"^Q1: (.+)$", body["messages"][1]["content"], re.M)[1]
        )
    ) as server:
        dropped = failed_build(
            tmp_path / "m",
            "multiwoz",
            multiwoz_fixture(tmp_path)[0],
            "--teacher",
            "api:m",
            "--api-base",
            server.base,
        )
        assert dropped["verification:ungrounded_answer_words"] == 1
        records, stats = build(
            tmp_path / "l",
            "locomo",
            locomo_fixture(tmp_path),
            "--teacher",
            "api:m",
            "--api-base",
            server.base,
        )
    assert len(records) == 9 and stats["ungrounded_kept_as_derived"] == sum(
        bool(r["recall"]) for r in records
    )
    assert all(r["answer"] == "Zanzibar on 31 March" for r in records)


def test_hf_tiny_random_counts_and_drops_unreadable(tmp_path, one_thread):
    dropped = failed_build(
        tmp_path / "hf",
        "coqa",
        coqa_fixture(tmp_path),
        "--teacher",
        "hf:tiny-random",
        "--teacher-max-new-tokens",
        "8",
    )
    rejected = {k: v for k, v in dropped.items() if k.startswith("teacher:")}
    assert sum(rejected.values()) == 2  # the fixture's two queries, each unreadable


@pytest.mark.parametrize("source, content", [("jsonl", ""), ("locomo", "[]")])
def test_an_empty_source_is_a_one_line_error_that_writes_nothing(tmp_path, source, content):
    path = tmp_path / ("empty.jsonl" if source == "jsonl" else "empty.json")
    path.write_text(content, encoding="utf-8")
    out = tmp_path / "out"
    out.mkdir()
    (out / "train.jsonl").write_text("precious\n")
    with pytest.raises(SystemExit) as e:  # --overwrite: a folder of other files is stage 0's to write
        build(out, source, path, "--overwrite")
    assert str(e.value) == f"error: {path} holds no dialogues; nothing written to {out}"
    assert (out / "train.jsonl").read_text() == "precious\n"  # nothing already written is lost
    assert sorted(p.name for p in out.iterdir() if p.name != LOCK_NAME) == ["train.jsonl"]
    with pytest.raises(SystemExit, match=r"the synthetic corpus \(--num-dialogues 0\) holds no dialogues"):
        s0.main(["--num-dialogues", "0", "--out", str(out), "--quiet"])
    assert sorted(p.name for p in out.iterdir() if p.name != LOCK_NAME) == ["train.jsonl"]


def test_a_build_that_keeps_no_record_leaves_the_previous_build(tmp_path):
    out = tmp_path / "out"
    build(out, "locomo", locomo_fixture(tmp_path))
    before = {name: (out / name).read_bytes() for name in OUTPUTS}
    dropped = failed_build(tmp_path / "fresh", "jsonl", jsonl_fixture(tmp_path), "--on-error", "skip")
    assert dropped["malformed"] == 1
    with pytest.raises(SystemExit, match="no records survived"):
        build(out, "jsonl", jsonl_fixture(tmp_path), "--on-error", "skip", "--overwrite")
    assert {name: (out / name).read_bytes() for name in OUTPUTS} == before


def test_flags(tmp_path):
    assert s0.parse_args(["--source", "jsonl", "--input", "x.jsonl"]).path == "x.jsonl"
    for argv in (
        ["--source", "coqa"],
        ["--teacher", "gpt-4"],
        ["--source", "multiwoz", "--path", "x", "--queries", "qa"],
    ):
        with pytest.raises(SystemExit):
            s0.parse_args(argv)
    assert s0.parse_args(["--source", "chitchat"]).path is None  # the installed package


# ---- LoCoMo ---------------------------------------------------------------------------------------
def evidence_labels(record):
    """The history labels whose utterance holds an evidence turn of the record's question (the
    fixture's PLANTED texts, or locomo_release's <conversation/dia_id> marks)."""
    conversation = record["meta"]["conversation_id"]
    wanted = [
        PLANTED[i] if conversation == "conv-1" else f"<{conversation}/{i}>"
        for i in record["meta"]["evidence"]
    ]
    return [u["label"] for u in record["history"] if any(w in u["text"] for w in wanted)]


def test_locomo_oracle_h_star_is_the_evidence_and_eq2_only_scores(tmp_path):
    records, stats = build(tmp_path / "o", "locomo", locomo_fixture(tmp_path), "--threshold", "0.99")
    assert len(records) == 9 and "dependency_selection" not in stats["dropped"]  # corpus H* is exempt
    for r in records:
        assert r["recall"] == evidence_labels(r) and r["meta"]["reasoning_source"] == "template"
        assert set(r["pruned"]) >= set(r["recall"]) and set(r["meta"]["scores"]) == {
            u["label"] for u in r["history"]
        }
        assert (
            r["meta"]["derived_answer"]
            and r["meta"]["category"] in range(1, 6)
            and r["meta"]["window"]["how"]
        )
    assert stats["grounding_checked"] == sum(bool(r["recall"]) for r in records)


VIOLIN = "violin lesson tuesday evening"  # in D1:3 (Q2), D1:10 (A5), D1:17 (Q9)
TOMATO = "tomatoes garden harvest basket"  # in D1:6 (A3), D1:12 (A6), D1:19 (Q10)


def locomo_ceiling_fixture(path):
    """One session of 20 turns (10 rounds, Ann's turn first in each) whose filler turns share no word
    with the questions, and three rounds for each of two topics. With --max-rounds 4 (windows of 3
    rounds) and stage 0's bag-of-words embedder, the rounds retrieved for a question are its
    topic's rounds 2, 5, 9 or 3, 6, 10; the recent ones 8-10. The evidence ids inside each window:

        question (category)                     evidence            retrieved  recent  evidence
        violin (1 multi-hop)                    D1:3 D1:17 D1:1     2 of 3     1 of 3  3 of 3
        tomato (4 single-hop)                   D1:19 D1:12         2 of 2     1 of 2  2 of 2
        violin, adversarial (5)                 D1:10               1 of 1     0 of 1  1 of 1
        no evidence (3 open-domain)             -                   not counted
    """
    planted = {3: VIOLIN, 10: VIOLIN, 17: VIOLIN, 6: TOMATO, 12: TOMATO, 19: TOMATO}
    conversation = {
        "speaker_a": "Ann",
        "speaker_b": "Bob",
        "session_1_date_time": "3:00 pm on 2 June, 2023",
        "session_1": [
            {
                "speaker": ("Ann", "Bob")[(k - 1) % 2],
                "dia_id": f"D1:{k}",
                "text": planted.get(k, f"filler w{k}"),
            }
            for k in range(1, 21)
        ],
    }
    qa = [
        {
            "question": "Which violin lesson tuesday?",
            "answer": "x",
            "evidence": ["D1:3", "D1:17", "D1:1"],
            "category": 1,
        },
        {"question": "Tomatoes garden harvest?", "answer": "y", "evidence": ["D1:19; D1:12"], "category": 4},
        {
            "question": "Violin lesson tuesday evening?",
            "adversarial_answer": "z",
            "evidence": ["D1:10"],
            "category": 5,
        },
        {"question": "What year?", "answer": 2023, "evidence": [], "category": 3},
    ]
    path.write_text(json.dumps([{"sample_id": "conv-c", "conversation": conversation, "qa": qa}]))
    return path


def test_locomo_window_ceilings_in_stats(tmp_path):
    path = locomo_ceiling_fixture(tmp_path / "locomo10.json")
    records, stats = build(tmp_path / "o", "locomo", path, "--max-rounds", "4")
    windows = stats["locomo_windows"]
    assert windows["used"] == "retrieved" and windows["budget_rounds"] == 3
    assert windows["questions_with_evidence"] == 3 and windows["evidence_window_cannot_hold"] == 0
    assert "locomo_windows" not in stats["source_report"]

    def row(kind, group):
        r = windows["kinds"][kind][group]
        return (
            r["questions"],
            r["evidence_ids"],
            r["ids_inside"],
            r["evidence_recall_ceiling"],
            r["all_inside"],
        )

    assert row("retrieved", "all") == (3, 6, round(5 / 6, 4), round((2 / 3 + 1 + 1) / 3, 4), round(2 / 3, 4))
    assert row("retrieved", "answerable") == (2, 5, 0.8, round((2 / 3 + 1) / 2, 4), 0.5)
    assert row("retrieved", "multi-hop") == (1, 3, 0.6667, 0.6667, 0.0)
    assert row("recent", "all") == (3, 6, 0.3333, round((1 / 3 + 1 / 2 + 0) / 3, 4), 0.0)
    assert row("recent", "answerable") == (2, 5, 0.4, round((1 / 3 + 1 / 2) / 2, 4), 0.0)
    assert row("recent", "single-hop") == (1, 2, 0.5, 0.5, 0.0)
    assert row("recent", "adversarial") == (1, 1, 0.0, 0.0, 0.0)
    assert row("evidence", "all") == row("all", "all") == (3, 6, 1.0, 1.0, 1.0)
    assert "temporal" not in windows["kinds"]["recent"]  # no question of that category
    by_question = {r["query"]: r for r in records}
    violin = by_question["Which violin lesson tuesday?"]  # rounds 2, 5, 9 as Q1..A3
    assert violin["meta"]["window"]["kept_rounds"] == [[2, 2], [5, 5], [9, 9]]
    assert violin["recall"] == ["Q1", "Q3"] and violin["meta"]["evidence_labels"] == {
        "D1:3": "Q1",
        "D1:17": "Q3",
    }
    assert violin["meta"]["window"]["evidence_in_window"] == [2, 3] and len(violin["meta"]["evidence"]) == 3
    # the same ceilings whichever window the records use
    _, recent = build(tmp_path / "r", "locomo", path, "--max-rounds", "4", "--locomo-window", "recent")
    assert recent["locomo_windows"]["used"] == "recent"
    assert recent["locomo_windows"]["kinds"] == windows["kinds"]


def test_train_drops_answerable_questions_whose_window_holds_none_of_their_evidence(tmp_path):
    """A chain that could cite no shown turn would teach SFT to state unseen gold; only train drops
    them (categories 1-4 with evidence, none inside). Dev and test keep every question."""

    def record(category, inside, total):
        evidence = [f"D1:{k}" for k in range(total)]
        meta = {"category": category, "evidence": evidence, "window": {"evidence_in_window": [inside, total]}}
        return {"id": f"{category}-{inside}-{total}", "meta": meta}

    records = [record(1, 0, 2), record(4, 1, 2), record(5, 0, 1), record(3, 0, 0), record(2, 0, 1)]
    kept, dropped = s0.drop_unsupported(records)
    assert [r["id"] for r in kept] == ["4-1-2", "5-0-1", "3-0-0"] and dropped == 2
    path = locomo_ceiling_fixture(tmp_path / "locomo10.json")
    for split in ("train", "dev"):
        out = tmp_path / split
        records, stats = build(
            out, "locomo", path, "--max-rounds", "2", "--locomo-window", "recent", "--split", split
        )
        unsupported = [
            r
            for r in records
            if r["meta"]["category"] != 5
            and r["meta"]["evidence"]
            and r["meta"]["window"]["evidence_in_window"][0] == 0
        ]
        assert (len(unsupported) == 0) == (split == "train")
        assert stats["dropped"].get("train_evidence_outside_window", 0) == (
            1 if split == "train" else 0
        )  # violin: 0 of 3


def test_locomo_conversations_file_and_the_window_in_the_build_identity(tmp_path, capsys):
    path = locomo_ceiling_fixture(tmp_path / "locomo10.json")
    out = tmp_path / "o"
    records, _ = build(out, "locomo", path, "--max-rounds", "4")
    rows = read_jsonl(out / "conversations.jsonl", validate=False)
    assert rows == s0.locomo_conversations(path) and rows[0]["conversation_id"] == "conv-c"
    assert len(rows[0]["rounds"]) == 10 and rows[0]["dia_labels"]["D1:17"] == "Q9"
    assert rows[0]["rounds"][0]["user"] == "[3:00 pm on 2 June, 2023] Ann: filler w1"
    assert {r["meta"]["conversation_id"] for r in records} == {"conv-c"}
    assert json.loads((out / "config.json").read_text())["locomo_window"] == "retrieved"
    build(out, "locomo", path, "--max-rounds", "4", "--resume")
    assert "nothing to do" in capsys.readouterr().out
    # another window is another build: --resume refuses it, naming the window; 'all' keeps every
    # round, past --max-rounds
    with pytest.raises(SystemExit, match=r"locomo_window \('retrieved' there, 'all' now\)"):
        build(out, "locomo", path, "--max-rounds", "4", "--locomo-window", "all", "--resume")
    records, stats = build(out, "locomo", path, "--max-rounds", "4", "--locomo-window", "all", "--overwrite")
    assert "nothing to do" not in capsys.readouterr().out and stats["dropped"].get("length", 0) == 0
    assert len(records) == 4 and all(
        len(r["history"]) == 20 and r["meta"]["window"]["how"] == "all" for r in records
    )
    labels = rows[0]["dia_labels"]  # a window of every round labels every turn as the file does
    assert all(r["meta"]["evidence_labels"] == {i: labels[i] for i in r["meta"]["evidence"]} for r in records)


def locomo_release(path, conversations=10, sessions=30, turns=20, questions=1986, broken=6, seed=0):
    """locomo10.json at the release's scale: conversations of sessions x turns, questions over
    categories 1-5 in the release's proportions, blemishes that can be normalised (packed,
    zero-padded and stray-colon ids) and `broken` questions whose evidence cannot be resolved
    (an id that names no turn, a bare 'D'). Every turn ends on its mark <chat-c/D<s>:<k>>."""
    rng = random.Random(seed)
    broken_at, n = set(rng.sample(range(questions), broken)), 0
    samples = []
    for c in range(conversations):
        a, b = f"Ann{c}", f"Bob{c}"
        conversation = {"speaker_a": a, "speaker_b": b}
        for s in range(1, sessions + 1):
            conversation[f"session_{s}_date_time"] = f"{1 + s % 12}:{s:02d} pm on {1 + s % 28} May, 2023"
            conversation[f"session_{s}"] = [
                {
                    "speaker": (a, b)[k % 2],
                    "dia_id": f"D{s}:{k + 1}",
                    "text": f"Line {k + 1} of session {s} in chat {c} <chat-{c}/D{s}:{k + 1}>",
                    **({"blip_caption": "a photo of a lake"} if k == 9 else {}),
                }
                for k in range(turns)
            ]
        qa = []
        for _ in range(questions // conversations + (c < questions % conversations)):
            category = rng.choices([1, 2, 3, 4, 5], [282, 321, 96, 841, 446])[0]
            s = rng.randint(1, sessions)
            ids = [f"D{s}:{rng.randint(1, turns)}"] + [
                f"D{rng.randint(1, sessions)}:{rng.randint(1, turns)}"
                for _ in range(rng.randint(0, 2) if category == 1 else 0)
            ]
            evidence = [] if category == 3 and rng.random() < 0.3 else ids
            style = rng.random()
            if n in broken_at:
                evidence = ["D99:1"] if n % 2 else ["D"]
            elif len(evidence) >= 2 and style < 0.2:
                evidence = ["; ".join(evidence)]
            elif evidence and style < 0.3:
                evidence = [re.sub(r":(\d)$", r":0\1", evidence[0])] + evidence[1:]
            elif evidence and style < 0.35:
                evidence = ["D:" + evidence[0][1:]] + evidence[1:]
            answer = rng.choice([f"in session {s}", 2023, "a lake"])
            qa.append(
                {
                    "question": f"Question {n} about chat {c}?",
                    "evidence": evidence,
                    "category": category,
                    **({"adversarial_answer": str(answer)} if category == 5 else {"answer": answer}),
                }
            )
            n += 1
        samples.append({"sample_id": f"chat-{c}", "conversation": conversation, "qa": qa})
    path.write_text(json.dumps(samples))
    return path


def test_locomo_conversations_never_span_splits_nor_dedup_each_other(tmp_path):
    path = locomo_release(
        tmp_path / "locomo10.json", conversations=4, sessions=2, turns=10, questions=40, broken=0
    )
    records, stats = build(
        tmp_path / "o", "locomo", path, "--dev-fraction", "0.25", "--test-fraction", "0.25"
    )
    assert len(records) == 40 and stats["dropped"]["deduplication"] == 0
    owner = {}
    for split in SPLITS:
        for r in read_jsonl(tmp_path / "o" / f"{split}.jsonl"):
            assert owner.setdefault(r["meta"]["split_group"], split) == split
    assert sorted(owner.values()) == ["dev", "test", "train", "train"]
    dialogues, _ = s0.load_corpus("locomo", path)
    for d in dialogues:
        del d["meta"]
    assert (
        s0.deduplicate(dialogues)[1] > 30
    )  # whole-conversation windows: near-identical but for the question


def test_a_file_goes_whole_to_one_split_or_by_conversation_into_train_and_dev(tmp_path):
    """--split test: a new file in LoCoMo's schema is scored whole, no record left in train or dev.
    Without it, 7 conversations with --dev-fraction 0.3 --test-fraction 0 split by conversation,
    seeded: round(2.1) = 2 whole conversations in dev, 5 in train, none in test."""
    path = locomo_release(
        tmp_path / "locomo7.json", conversations=7, sessions=2, turns=10, questions=70, broken=0
    )
    records, stats = build(tmp_path / "whole", "locomo", path, "--split", "test")
    assert stats["queries_per_split"] == {"train": 0, "dev": 0, "test": 70}
    assert [len(read_jsonl(tmp_path / "whole" / f"{s}.jsonl")) for s in SPLITS] == [0, 0, 70]
    assert json.loads((tmp_path / "whole" / "config.json").read_text())["split"] == "test"
    owners = []
    for seed in ("0", "1"):
        out = tmp_path / f"seed{seed}"
        build(out, "locomo", path, "--dev-fraction", "0.3", "--test-fraction", "0", "--seed", seed)
        owner = {}
        for split in SPLITS:
            for r in read_jsonl(out / f"{split}.jsonl"):
                assert owner.setdefault(r["meta"]["conversation_id"], split) == split
        assert sorted(Counter(owner.values()).items()) == [("dev", 2), ("train", 5)]
        owners.append(owner)
    assert owners[0] != owners[1]  # the seed, not a conversation id, chooses dev
    with pytest.raises(SystemExit):
        s0.parse_args(["--source", "locomo", "--path", str(path), "--split", "holdout"])
    with pytest.raises(SystemExit):
        s0.parse_args(["--source", "locomo", "--path", str(path), "--dev-fraction", "1.5"])


def test_locomo_release_scale_converts_every_resolvable_question(tmp_path):
    path = locomo_release(tmp_path / "locomo10.json")
    # the oracle window: every resolvable question keeps all of its evidence, so H* is all of it
    records, stats = build(
        tmp_path / "o",
        "locomo",
        path,
        "--min-rounds",
        "8",
        "--threshold",
        "0.6",
        "--locomo-window",
        "evidence",
    )
    report = stats["source_report"]
    assert report["qa_read"] == 1986 and report["qa_skipped_unresolved_evidence"] == 6
    assert report["evidence_ids_normalised"] > 100
    assert stats["queries"] == len(records) == 1980 and set(stats["dropped"]) == {"deduplication", "length"}
    assert all(r["recall"] == evidence_labels(r) and len(r["history"]) <= 62 for r in records)
    assert stats["dialogues_per_split"]["test"] and len({r["meta"]["split_group"] for r in records}) == 10
    print(
        f"LoCoMo at release scale: {stats['queries']} of {report['qa_read']} questions converted; "
        f"dropped {stats['dropped']}; report {report}"
    )
