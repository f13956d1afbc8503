"""corpora.py: each loader against a small fixture written in that corpus's published schema; the
LoCoMo windows and evidence blemishes; the shared conventions (merging, opening assistant turns,
query marks). Each test names the fields its fixture relies on."""

import json
import subprocess
import sys
from pathlib import Path

import pytest

from srt.data import corpora
from srt.data_io import DataError

ROOT = Path(__file__).resolve().parent.parent


def labelled(dialogue, upto=None):
    """{label: text} of a dialogue's rounds (before round `upto`, 1-based, when given)."""
    rounds = dialogue["rounds"][: (upto - 1) if upto else None]
    return {
        f"{side}{i}": r[key]
        for i, r in enumerate(rounds, 1)
        for side, key in (("Q", "user"), ("A", "assistant"))
    }


def check_form(dialogues):
    """The dialogue form stage 0 annotates (corpora.py's docstring), plus: every round has both
    sides, recall labels name earlier turns, and query rounds are not the first."""
    for d in dialogues:
        assert isinstance(d["id"], str) and d["source"] and d["domain"]
        assert len(d["rounds"]) >= 2
        for t, r in enumerate(d["rounds"], 1):
            assert isinstance(r["user"], str) and isinstance(r["assistant"], str) and r["user"]
            assert r["assistant"] or (
                d["source"] == "locomo" and t == len(d["rounds"]) - 1
            )  # an unanswered last turn
            if "gold" in r:
                assert set(r["gold"]["recall"]) <= set(labelled(d, t))
            if r.get("query") or "gold" in r:
                assert t > 1


# ---- LoCoMo ----------------------------------------------------------------------------------
DATES = {1: "1:56 pm on 8 May, 2023", 2: "1:14 pm on 25 May, 2023", 3: "7:55 pm on 9 June, 2023"}
PLANTED = {
    "D1:3": "I went to a LGBTQ support group yesterday.",
    "D2:4": "I ran a charity race for mental health.",
    "D3:5": "My dog is called Pip and he loves the beach.",
    "D3:20": "We painted a sunrise last week.",
    "D3:21": "Bye, see you at the lake!",
}


def locomo_fixture(tmp_path) -> Path:
    """Fields: sample_id, conversation.speaker_a/b, session_<n> (speaker, dia_id, text,
    blip_caption), session_<n>_date_time, qa (question, answer, adversarial_answer, evidence,
    category). Session 1 ends with Melanie and session 2 opens with her (merged across the
    session boundary); D2:7 and D2:8 are one speaker's consecutive turns."""
    conversation = {"speaker_a": "Caroline", "speaker_b": "Melanie"}
    for s in (1, 2, 3):
        turns, speaker = [], "Caroline" if s != 2 else "Melanie"
        for k in range(1, 21):
            dia_id = f"D{s}:{k}"
            turns.append(
                {"speaker": speaker, "dia_id": dia_id, "text": PLANTED.get(dia_id, f"chat line {s}-{k}")}
            )
            if dia_id != "D2:7":
                speaker = "Melanie" if speaker == "Caroline" else "Caroline"
        turns[9]["blip_caption"] = "a painted bowl"
        if s == 3:  # the conversation ends on the user's side, and that last turn is evidence
            turns.append({"speaker": "Caroline", "dia_id": "D3:21", "text": PLANTED["D3:21"]})
        conversation[f"session_{s}"] = turns
        conversation[f"session_{s}_date_time"] = DATES[s]
    qa = [
        {
            "question": "When did Caroline go to the support group?",
            "answer": "7 May 2023",
            "evidence": ["D1:3"],
            "category": 2,
        },
        {
            "question": "What is the dog's name and what did they paint?",
            "answer": "Pip; a sunrise",
            "evidence": ["D3:20", "D3:5"],
            "category": 1,
        },  # given out of order
        {
            "question": "What did Melanie do for charity?",
            "answer": "a race",
            "evidence": ["D2:04"],
            "category": 4,
        },  # leading zero
        {
            "question": "Support group and dog?",
            "answer": "yes",
            "evidence": ["D1:3; D3:5"],
            "category": 1,
        },  # packed
        {
            "question": "Race and sunrise?",
            "answer": "both",
            "evidence": ["D2:4 D3:20"],
            "category": 1,
        },  # packed
        {"question": "Odd id?", "answer": "x", "evidence": ["D:1:3"], "category": 4},  # stray colon
        {
            "question": "Dangling?",
            "answer": "x",
            "evidence": ["D1:3", "D9:99"],
            "category": 4,
        },  # no such turn
        {"question": "Bare D?", "answer": "x", "evidence": ["D"], "category": 4},  # unreadable
        {"question": "What year?", "answer": 2022, "evidence": [], "category": 3},  # number, no evidence
        {
            "question": "Where will they meet?",
            "answer": "the lake",
            "evidence": ["D3:21"],
            "category": 4,
        },  # last turn
        {
            "question": "What did Caroline run for charity?",
            "adversarial_answer": "a charity race",
            "evidence": ["D2:4"],
            "category": 5,
        },
    ]
    path = tmp_path / "locomo10.json"
    path.write_text(json.dumps([{"sample_id": "conv-1", "conversation": conversation, "qa": qa}]))
    return path


def test_locomo_planted_evidence_maps_to_the_right_labels(tmp_path):
    dialogues, report = corpora.load_corpus("locomo", locomo_fixture(tmp_path), max_rounds=32)
    check_form(dialogues)
    for d in dialogues:
        query = d["rounds"][-1]
        texts = labelled(d, len(d["rounds"]))
        for dia_id in query["gold"]["evidence"]:
            holders = [label for label, text in texts.items() if PLANTED.get(dia_id, "@@") in text]
            assert holders and holders[0] in query["gold"]["recall"], (d["id"], dia_id)
            # the map LoCoMo's evidence recall counts dia_ids through: the utterance that holds it
            assert query["gold"]["evidence_labels"][dia_id] == holders[0]
        assert len(query["gold"]["recall"]) == len(
            {t for i in query["gold"]["evidence"] for t in texts if PLANTED[i] in texts[t]}
        )
    by_question = {d["rounds"][-1]["user"]: d for d in dialogues}
    two = by_question["What is the dog's name and what did they paint?"]["rounds"][-1]["gold"]
    assert two["evidence"] == ["D3:20", "D3:5"]
    assert [int(label[1:]) for label in two["recall"]] == sorted(
        int(label[1:]) for label in two["recall"]
    )  # dialogue order


def test_locomo_blemishes_normalised_or_counted(tmp_path):
    dialogues, report = corpora.load_corpus("locomo", locomo_fixture(tmp_path))
    questions = {d["rounds"][-1]["user"]: d["rounds"][-1]["gold"] for d in dialogues}
    assert questions["What did Melanie do for charity?"]["evidence"] == ["D2:4"]
    assert questions["Support group and dog?"]["evidence"] == ["D1:3", "D3:5"]
    assert questions["Race and sunrise?"]["evidence"] == ["D2:4", "D3:20"]
    assert questions["Odd id?"]["evidence"] == ["D1:3"]
    assert "Dangling?" not in questions and "Bare D?" not in questions
    assert report["qa_read"] == 11 and report["dialogues"] == 9 and report["trailing_user_kept"] == 1
    assert report["qa_skipped_unresolved_evidence"] == 2
    assert report["evidence_ids_dangling"] == 1 and report["evidence_fragments_unreadable"] == 1
    assert report["evidence_ids_normalised"] >= 6  # two leading-zero/colon fixes + two packed pairs
    assert corpora.normalise_evidence(["D8:6; D9:17", "D30:05", "D:11:26", "D"]) == (
        ["D8:6", "D9:17", "D30:5", "D11:26"],
        ["D"],
        4,
    )


def test_locomo_answers_categories_dates_and_roles(tmp_path):
    dialogues, _ = corpora.load_corpus("locomo", locomo_fixture(tmp_path))
    questions = {d["rounds"][-1]["user"]: d for d in dialogues}
    year = questions["What year?"]["rounds"][-1]
    assert year["assistant"] == "2022" and year["gold"]["recall"] == [] and year["gold"]["category"] == 3
    # Category 5 by default: SFT learns to decline, never the planted answer, and its chain says so
    adversarial = questions["What did Caroline run for charity?"]["rounds"][-1]
    assert (
        adversarial["assistant"] == corpora.LOCOMO_ABSTAIN
        and adversarial["gold"]["query_type"] == "locomo-adversarial"
        and adversarial["gold"]["adversarial_answer"] == "a charity race"
        and "a charity race" not in adversarial["gold"]["reasoning"]
        and "premise is not in the conversation" in adversarial["gold"]["reasoning"]
    )
    keep, _ = corpora.load_corpus("locomo", locomo_fixture(tmp_path), adversarial="keep")
    assert keep[-1]["rounds"][-1]["assistant"] == "a charity race"
    assert keep[-1]["rounds"][-1]["gold"]["reasoning"].endswith("the answer is: a charity race")
    skip, report = corpora.load_corpus("locomo", locomo_fixture(tmp_path), adversarial="skip")
    assert len(skip) == 8 and report["qa_skipped_adversarial"] == 1
    for d in dialogues:
        assert d["meta"]["user_speaker"] == "Caroline" and d["meta"]["split_group"] == "conv-1"
        history = d["rounds"][:-1]
        assert all("Caroline: " in r["user"] and "Melanie: " not in r["user"] for r in history)
        assert all(
            r["assistant"].startswith("Melanie: ")
            or r["assistant"].split("] ", 1)[-1].startswith("Melanie: ")
            or not r["assistant"]
            for r in history
        )
        first = history[0]["user"]
        assert first.startswith("[") and any(
            date in first for date in DATES.values()
        )  # the window opens on its date
    whole = next(d for d in dialogues if d["meta"]["window"]["how"] == "whole")
    text = " ".join(r["user"] + " " + r["assistant"] for r in whole["rounds"])
    assert "chat line 1-10 [shares a photo of a painted bowl]" in text  # an image turn keeps its caption
    assert all(f"[{date}]" in text for date in DATES.values())  # every session's date, once


def test_locomo_window_keeps_evidence_and_at_most_max_rounds(tmp_path):
    for max_rounds in (6, 8, 12, 32):
        dialogues, report = corpora.load_corpus(
            "locomo", locomo_fixture(tmp_path), max_rounds=max_rounds, window="evidence"
        )
        assert report["dialogues"] == 9  # every resolvable question survives every window size
        for d in dialogues:
            gold, window = d["rounds"][-1]["gold"], d["meta"]["window"]
            assert len(d["rounds"]) <= max_rounds
            texts = labelled(d, len(d["rounds"]))
            in_conversation_order = sorted(gold["evidence"], key=lambda i: tuple(map(int, i[1:].split(":"))))
            positions = [
                list(texts).index(next(t for t in texts if PLANTED[i] in texts[t]))
                for i in in_conversation_order
            ]
            assert positions == sorted(positions)  # the window keeps the evidence turns in order
            assert all(any(PLANTED[i] in texts[t] for t in gold["recall"]) for i in gold["evidence"])
            kept = sum(b - a + 1 for a, b in window["kept_rounds"])
            assert kept == len(d["rounds"]) - 1 and window["how"] in (
                "whole",
                "latest",
                "contiguous",
                "segments",
            )
            assert all(any(a <= e <= b for a, b in window["kept_rounds"]) for e in window["evidence_rounds"])
            assert (
                window["kind"] == "evidence" and window["evidence_in_window"] == [len(gold["evidence"])] * 2
            )
    small, _ = corpora.load_corpus("locomo", locomo_fixture(tmp_path), max_rounds=6, window="evidence")
    far = next(d for d in small if d["rounds"][-1]["user"] == "Support group and dog?")
    assert far["meta"]["window"]["how"] == "segments" and len(far["meta"]["window"]["kept_rounds"]) == 2
    text = " ".join(r["user"] + " " + r["assistant"] for r in far["rounds"])
    assert f"[{DATES[1]}]" in text and f"[{DATES[3]}]" in text  # each segment carries its session's date


def test_locomo_window_placement_is_seeded():
    import random

    a = corpora.choose_window(100, [40, 45], 10, random.Random("s"))
    assert a == corpora.choose_window(100, [40, 45], 10, random.Random("s"))
    assert a[1] == "contiguous" and 40 in a[0] and 45 in a[0] and len(a[0]) == 10
    starts = {corpora.choose_window(100, [40, 45], 10, random.Random(seed))[0][0] for seed in range(30)}
    assert len(starts) > 1  # the evidence does not always sit at the same place in the window
    assert corpora.choose_window(100, list(range(0, 100, 5)), 10, random.Random(0)) == (
        None,
        "evidence_exceeds_window",
    )


GUITAR_QUESTION = "What guitar did Melanie buy for her band?"
RETRIEVAL_DATES = {1: "2:00 pm on 3 March, 2023", 2: "6:30 pm on 12 April, 2023"}
GUITAR = {  # the rounds retrieval must find: rounds 2, 8, 15 and 23 of 24
    "D1:4": "I bought a red Fender guitar for my band last week.",
    "D1:15": "Does your band like the new guitar you bought, Melanie?",
    "D2:6": "The band loves my new electric guitar, it sounds great.",
    "D2:21": "Which guitar shop did Melanie buy the band's guitar from?",
}
UNREACHABLE = "My grandmother's plum dumplings need poppy seeds and butter."  # D1:9, round 5


def locomo_retrieval_fixture(tmp_path) -> Path:
    """Fields as locomo_fixture. Two sessions of 24 turns (24 rounds; Caroline opens each round);
    four rounds about Melanie's guitar and one evidence turn (D1:9) that shares no word or topic
    with the question about it; the same question asked with its evidence altered."""
    conversation = {"speaker_a": "Caroline", "speaker_b": "Melanie"}
    for s in (1, 2):
        conversation[f"session_{s}"] = [
            {
                "speaker": ("Caroline", "Melanie")[(k - 1) % 2],
                "dia_id": f"D{s}:{k}",
                "text": GUITAR.get(f"D{s}:{k}", UNREACHABLE if (s, k) == (1, 9) else f"chat line {s}-{k}"),
            }
            for k in range(1, 25)
        ]
        conversation[f"session_{s}_date_time"] = RETRIEVAL_DATES[s]
    qa = [
        {"question": GUITAR_QUESTION, "answer": "a red Fender", "evidence": ["D1:9", "D2:6"], "category": 1},
        {"question": GUITAR_QUESTION, "answer": "another", "evidence": ["D1:1"], "category": 4},
        {"question": GUITAR_QUESTION, "answer": "none", "evidence": [], "category": 3},
        {
            "question": "What did Caroline bake?",
            "adversarial_answer": "bread",
            "evidence": ["D1:9"],
            "category": 5,
        },
    ]
    path = tmp_path / "locomo10.json"
    path.write_text(json.dumps([{"sample_id": "conv-g", "conversation": conversation, "qa": qa}]))
    return path


def test_locomo_retrieved_window_is_chosen_from_the_question_alone(tmp_path):
    """all-MiniLM-L6-v2 (the default embedder) keeps the four guitar rounds of 24, in conversation
    order, and not the evidence round that shares nothing with the question: H* holds the
    evidence inside the window, the gold every evidence id."""
    dialogues, report = corpora.load_corpus("locomo", locomo_retrieval_fixture(tmp_path), max_rounds=5)
    check_form(dialogues)
    assert report["dialogues"] == 4 and "qa_skipped_evidence_exceeds_window" not in report
    first = dialogues[0]
    window, gold = first["meta"]["window"], first["rounds"][-1]["gold"]
    assert window["kind"] == "retrieved" and window["how"] == "retrieved"
    assert window["kept_rounds"] == [[2, 2], [8, 8], [15, 15], [23, 23]]
    history = first["rounds"][:-1]
    assert [r["assistant"] for r in history][0] == f"Melanie: {GUITAR['D1:4']}"
    assert history[1]["user"] == f"Caroline: {GUITAR['D1:15']}"
    assert history[2]["user"].startswith(f"[{RETRIEVAL_DATES[2]}] Caroline: ")  # the session changes
    assert history[0]["user"].startswith(f"[{RETRIEVAL_DATES[1]}] Caroline: ")
    assert not any(UNREACHABLE in r["user"] + r["assistant"] for r in history)
    assert gold["recall"] == ["A3"] and gold["evidence_labels"] == {"D2:6": "A3"}
    assert gold["evidence"] == ["D1:9", "D2:6"] and window["evidence_in_window"] == [1, 2]
    assert window["evidence_rounds"] == [5, 15]
    # the evidence is not read: the same question with other evidence, or none, keeps the same rounds
    for other in dialogues[1:3]:
        assert other["meta"]["window"]["kept_rounds"] == window["kept_rounds"]
        assert other["rounds"][:-1] == history
    assert dialogues[1]["rounds"][-1]["gold"]["recall"] == []  # D1:1 lies outside
    assert dialogues[1]["meta"]["window"]["evidence_in_window"] == [0, 1]
    assert dialogues[1]["rounds"][-1]["gold"]["reasoning"].startswith("No single earlier turn states it")


def test_locomo_recent_and_all_windows(tmp_path):
    path = locomo_retrieval_fixture(tmp_path)
    recent, report = corpora.load_corpus("locomo", path, max_rounds=5, window="recent")
    assert report["dialogues"] == 4
    for d in recent:
        assert d["meta"]["window"]["kept_rounds"] == [[21, 24]] and d["meta"]["window"]["how"] == "recent"
        assert d["rounds"][0]["user"].startswith(f"[{RETRIEVAL_DATES[2]}] Caroline: chat line 2-17")
    gold = recent[0]["rounds"][-1]["gold"]  # D1:9 and D2:6 both lie before the last four rounds
    assert gold["recall"] == [] and gold["evidence_labels"] == {} and gold["evidence"] == ["D1:9", "D2:6"]
    assert gold["reasoning"].startswith("No single earlier turn states it")
    adversarial = recent[3]["rounds"][-1]["gold"]  # category 5 declines in its own words
    assert adversarial["recall"] == [] and "premise is not in the conversation" in adversarial["reasoning"]
    everything, _ = corpora.load_corpus("locomo", path, max_rounds=5, window="all")
    whole = corpora.locomo_conversations(path)[0]
    for d in everything:
        assert d["meta"]["window"]["how"] == "all" and d["meta"]["window"]["kept_rounds"] == [[1, 24]]
        assert d["rounds"][:-1] == whole["rounds"]  # every round, whatever max_rounds
    gold = everything[0]["rounds"][-1]["gold"]
    assert gold["recall"] == ["Q5", "A15"] and everything[0]["meta"]["window"]["evidence_in_window"] == [2, 2]
    with pytest.raises(ValueError, match="window must be"):
        corpora.load_corpus("locomo", path, window="oracle")


def test_gold_free_window_breaks_ties_towards_the_earlier_round():
    similarity = [0.5, 0.9, 0.5, 0.5, 0.1]
    assert corpora.gold_free_window("retrieved", 5, 3, similarity) == ([0, 1, 2], "retrieved")
    assert corpora.gold_free_window("recent", 5, 3) == ([2, 3, 4], "recent")
    assert corpora.gold_free_window("all", 5, 3) == ([0, 1, 2, 3, 4], "all")
    assert corpora.gold_free_window("retrieved", 3, 3, [0.0] * 3) == ([0, 1, 2], "whole")


def test_locomo_conversations_are_the_whole_window(tmp_path):
    """conversations.jsonl's rows: every round as a window of every round renders it, and each
    dia_id's label in it (D2:7 and D2:8, one speaker's consecutive turns, share one utterance)."""
    path = locomo_fixture(tmp_path)
    (conversation,) = corpora.locomo_conversations(path)
    assert conversation["conversation_id"] == "conv-1" and len(conversation["rounds"]) == 30
    texts = {
        f"{side}{i}": r[key]
        for i, r in enumerate(conversation["rounds"], 1)
        for side, key in (("Q", "user"), ("A", "assistant"))
    }
    for dia_id, text in PLANTED.items():
        assert text in texts[conversation["dia_labels"][dia_id]]
    labels = conversation["dia_labels"]
    assert labels["D2:7"] == labels["D2:8"] == "A13" and labels["D3:21"] == "Q30" and len(labels) == 61
    assert conversation["rounds"][-1]["assistant"] == ""  # the unanswered last turn stays
    everything, _ = corpora.load_corpus("locomo", path, max_rounds=6, window="all", embed=bag_of_words)
    for d in everything:
        assert d["rounds"][:-1] == conversation["rounds"]
        gold = d["rounds"][-1]["gold"]
        assert gold["evidence_labels"] == {i: labels[i] for i in gold["evidence"]}


def bag_of_words(texts):
    """A stand-in embedder where the test does not look at which rounds are retrieved."""
    import numpy as np

    vocabulary = {}
    rows = [[vocabulary.setdefault(w, len(vocabulary)) for w in t.lower().split()] for t in texts]
    out = np.zeros((len(texts), len(vocabulary) or 1), np.float32)
    for i, row in enumerate(rows):
        out[i, row] = 1.0
    return out / np.maximum(np.linalg.norm(out, axis=1, keepdims=True), 1e-9)


# ---- CoQA ------------------------------------------------------------------------------------
def coqa_fixture(tmp_path) -> Path:
    """Fields: data[].id, .source, .story, .questions[] {turn_id, input_text}, .answers[]
    {turn_id, input_text, span_text, span_start}."""
    story = (
        "Once upon a time, in a barn near a farm house, there lived a little white kitten named Cotton. "
        "Cotton lived high up in a nice warm place above the barn where all of the farmer's horses slept. "
        "But Cotton wasn't alone in her little home above the barn, oh no. She shared her hay bed with her "
        "mommy and 5 other sisters. All of her sisters were cute and fluffy, like Cotton. "
        "But she was the only white one in the bunch. The rest of her sisters were all orange with beautiful "
        "white tiger stripes like Cotton's mommy."
    )
    late = story.index("The rest of her sisters")
    data = {
        "version": "1.0",
        "data": [
            {
                "id": "3dr23u6we5",
                "source": "mctest",
                "story": story,
                "questions": [
                    {"input_text": "what color was cotton?", "turn_id": 1},
                    {"input_text": "what color were her sisters?", "turn_id": 2},
                ],
                "answers": [
                    {
                        "input_text": "white",
                        "span_text": "a little white kitten named Cotton",
                        "span_start": 59,
                        "turn_id": 1,
                    },
                    {"input_text": "orange", "span_text": "all orange", "span_start": late, "turn_id": 2},
                ],
            }
        ],
    }
    path = tmp_path / "coqa-dev-v1.0.json"
    path.write_text(json.dumps(data))
    return path


def test_coqa_story_parts_then_questions(tmp_path):
    coqa_fixture(tmp_path)
    (d,), report = corpora.load_corpus("coqa", tmp_path, story_part_words=30)
    check_form([d])
    parts = [r for r in d["rounds"] if r["user"].startswith("Story (part")]
    assert len(parts) >= 2 and all(r["assistant"] == corpora.STORY_ACK for r in parts)
    questions = d["rounds"][len(parts) :]
    assert [q["user"] for q in questions] == ["what color was cotton?", "what color were her sisters?"]
    assert [q["assistant"] for q in questions] == ["white", "orange"] and all(q["query"] for q in questions)
    assert questions[0]["meta"]["rationale_label"] == "Q1"
    holder = questions[1]["meta"]["rationale_label"]
    assert "all orange" in d["rounds"][int(holder[1:]) - 1]["user"] and holder != "Q1"
    assert d["domain"] == "mctest" and report["queries"] == 2


# ---- MultiWOZ --------------------------------------------------------------------------------
def multiwoz_fixture(tmp_path) -> tuple[Path, list]:
    """Fields: {dialogue id: {"goal": {domain: {...}}, "log": [{"text", "metadata"}]}}; even
    index = user, odd = system."""
    log = []
    for i in range(5):
        log.append({"text": f"I need a hotel in the north, request {i}.", "metadata": {}})
        log.append({"text": f"The Acorn Guest House has {i} rooms free.", "metadata": {"hotel": {}}})
    log.append({"text": "Thanks, bye.", "metadata": {}})  # ends on the user side
    data = {
        "SNG0129.json": {
            "goal": {"hotel": {"info": {"area": "north"}}, "taxi": {}, "train": {"info": {}}},
            "log": log,
        },
        "BROKEN.json": {"goal": {}},
    }
    (tmp_path / "data.json").write_text(json.dumps(data))
    return tmp_path / "data.json", log


def test_multiwoz_log_alternates_user_system(tmp_path):
    _, log = multiwoz_fixture(tmp_path)
    (d,), report = corpora.load_corpus("multiwoz", tmp_path / "data.json")
    check_form([d])
    assert d["id"] == "multiwoz-SNG0129" and d["domain"] == "hotel+train" and len(d["rounds"]) == 5
    assert d["rounds"][0] == {"user": log[0]["text"], "assistant": log[1]["text"]}
    assert d["rounds"][-1]["query"] and not any(r.get("query") for r in d["rounds"][:-1])
    assert report["trailing_user_dropped"] == 1 and report["malformed"] == 1
    (cut,), report = corpora.load_corpus("multiwoz", tmp_path / "data.json", max_rounds=3, queries="all")
    assert len(cut["rounds"]) == 3 and report["truncated"] == 1
    assert [bool(r.get("query")) for r in cut["rounds"]] == [False, True, True]


# ---- DailyDialog -----------------------------------------------------------------------------
def dailydialog_fixture(tmp_path) -> Path:
    """Fields: one dialogue per line, utterances ended by '__eou__', speakers alternate;
    dialogues_topic.txt beside it gives the topic number."""
    lines = [
        "Say , Jim , how about going for a few beers after dinner ? __eou__ You know that is tempting but "
        "is really not good for our fitness . __eou__ What do you mean ? It will help us to relax . __eou__ "
        "Do you really think so ? I don't . __eou__ I guess you are right . __eou__\n",
        "Hi ! __eou__\n",
    ]
    (tmp_path / "dialogues_text.txt").write_text("".join(lines))
    (tmp_path / "dialogues_topic.txt").write_text("1\n6\n")
    return tmp_path


def test_dailydialog_eou_lines_and_topics(tmp_path):
    dialogues, report = corpora.load_corpus("dailydialog", dailydialog_fixture(tmp_path))
    (d,) = dialogues
    check_form(dialogues)
    assert d["rounds"][0]["user"] == "Say, Jim, how about going for a few beers after dinner?"
    assert d["rounds"][1]["assistant"] == "Do you really think so? I don't."
    assert len(d["rounds"]) == 2 and report["trailing_user_dropped"] == 2 and report["too_short"] == 1
    assert d["domain"] == "ordinary-life" and d["id"] == "dailydialog-00000"


# ---- ReDial ----------------------------------------------------------------------------------
def redial_fixture(tmp_path) -> Path:
    """Fields: conversationId, initiatorWorkerId (seeker), messages[] {text, senderWorkerId},
    movieMentions {id: title}. The recommender speaks first here: that greeting is dropped. Two
    malformed lines follow the conversation."""
    messages = [
        (1, "Hello! What kind of movies do you like?"),
        (0, "hi"),
        (0, "I loved @111776"),
        (1, "Then try @204974"),
        (0, "Seen it. Anything else like @111776?"),
        (1, "Maybe @999 then"),
    ]
    record = {
        "conversationId": "391",
        "initiatorWorkerId": 0,
        "respondentWorkerId": 1,
        "movieMentions": {"111776": "Super Troopers (2001)", "204974": "Hot Fuzz (2007)"},
        "messages": [
            {"timeOffset": k, "text": t, "senderWorkerId": w, "messageId": k}
            for k, (w, t) in enumerate(messages)
        ],
    }
    path = tmp_path / "train_data.jsonl"
    path.write_text(json.dumps(record) + "\n{not json\n" + json.dumps({"conversationId": "x"}) + "\n")
    return path


def test_redial_seeker_is_user_and_movies_named(tmp_path):
    (d,), report = corpora.load_corpus("redial", redial_fixture(tmp_path))
    check_form([d])
    assert d["rounds"][0] == {
        "user": "hi I loved Super Troopers (2001)",
        "assistant": "Then try Hot Fuzz (2007)",
    }
    assert d["rounds"][1]["assistant"] == "Maybe @999 then"  # an unknown id stays as written
    assert (
        report["leading_assistant_dropped"] == 1
        and report["merged_messages"] == 1
        and report["malformed"] == 2
    )
    assert d["rounds"][-1]["query"] and d["domain"] == "movies"


# ---- MG-ShopDial -----------------------------------------------------------------------------
def mgshopdial_fixture(tmp_path) -> Path:
    """Fields: id ("Books:45:109:118"), metadata.desc, utterances[] {utterance_id, participant
    Client|Wizard, utterance, goal}."""
    said = [
        ("Wizard", "Hello, how I can help?", "recommendation"),
        ("Client", "Hello! I'm looking for some book", "recommendation"),
        ("Wizard", "Any genre or author in particular?", "recommendation"),
        ("Client", "romance, probably", "recommendation"),
        ("Wizard", "I have Regretting You by Colleen Hoover", "recommendation"),
        ("Client", "what's the price?", "qa"),
        ("Wizard", "Only $6.99", "qa"),
        ("Wizard", "$4.99 for the ebook", "recommendation"),
        ("Client", "is it a family drama?", "qa"),
        ("Wizard", "Yes that is correct", "qa"),
        ("Client", "thanks!", "meta"),
    ]
    data = [
        {
            "id": "Books:45:109:118",
            "metadata": {"desc": "You are looking for a book.", "type": "simple"},
            "utterances": [
                {"utterance_id": k + 1, "participant": p, "utterance": u, "goal": g, "intents": []}
                for k, (p, u, g) in enumerate(said)
            ],
        }
    ]
    path = tmp_path / "MGShopDial.json"
    path.write_text(json.dumps(data))
    return path


def test_mgshopdial_roles_and_qa_queries(tmp_path):
    (d,), report = corpora.load_corpus("mgshopdial", mgshopdial_fixture(tmp_path))
    check_form([d])
    assert d["domain"] == "books" and d["meta"]["scenario"] == "You are looking for a book."
    assert d["rounds"][2] == {"user": "what's the price?", "assistant": "Only $6.99 $4.99 for the ebook"}
    assert report["leading_assistant_dropped"] == 1 and report["trailing_user_dropped"] == 1
    assert [bool(r.get("query")) for r in d["rounds"]] == [False, False, False, True]
    (qa,), _ = corpora.load_corpus("mgshopdial", mgshopdial_fixture(tmp_path), queries="qa")
    assert [bool(r.get("query")) for r in qa["rounds"]] == [False, False, True, True]


# ---- chitchat --------------------------------------------------------------------------------
def chitchat_fixture(tmp_path) -> Path:
    """Fields: {conversation id: {"messages": [[{text, sender, timestamp}]], "prompt"}}."""
    conv = {
        "messages": [
            [
                {"text": "Hello", "sender": "a", "timestamp": "t"},
                {"text": "How are you?", "sender": "a", "timestamp": "t"},
            ],
            [{"text": "good, you?", "sender": "b", "timestamp": "t"}],
            [{"text": "fine", "sender": "a", "timestamp": "t"}],
            [{"text": "cool", "sender": "b", "timestamp": "t"}],
        ],
        "prompt": "Do you like dogs?",
    }
    (tmp_path / "dataset.json").write_text(
        json.dumps({"c1": conv, "c2": {"messages": [[conv["messages"][0][0]]]}})
    )
    return tmp_path


def test_chitchat_fixture_and_the_installed_package(tmp_path):
    (d,), report = corpora.load_corpus("chitchat", chitchat_fixture(tmp_path))
    assert (
        d["rounds"][0] == {"user": "Hello How are you?", "assistant": "good, you?"}
        and report["too_short"] == 1
    )
    real, report = corpora.load_corpus("chitchat", limit=40)  # the real conversations in the wheel
    check_form(real)
    assert len(real) == 40 and report["dialogues"] == 40
    assert all(2 <= len(d["rounds"]) <= 32 and d["rounds"][-1]["query"] for d in real)


# ---- our JSONL -------------------------------------------------------------------------------
def jsonl_fixture(tmp_path) -> Path:
    """Fields: id; rounds [{user, assistant, gold?, query?}] or messages [{role, content}]. The
    third line's gold names a turn that does not exist."""
    gold_dialogue = {
        "id": "g1",
        "domain": "spa",
        "rounds": [
            {"user": "I'm Apex tier.", "assistant": "Welcome back."},
            {"user": "Price of Chakra Balancing?", "assistant": "$180."},
            {
                "user": "What do I pay?",
                "assistant": "$153",
                "gold": {"recall": ["Q1", "A2"], "answer_keys": ["$153"]},
            },
        ],
    }
    chat = {
        "id": 7,
        "messages": [
            {"role": "system", "content": "be nice"},
            {"role": "user", "content": "hi"},
            {"role": "assistant", "content": "hello"},
            {"role": "user", "content": "my name is Ana"},
            {"role": "user", "content": "and yours?"},
            {"role": "assistant", "content": "Bot."},
        ],
    }
    bad_recall = {
        "id": "b",
        "rounds": [{"user": "a", "assistant": "b", "gold": {"recall": ["A3"], "answer_keys": []}}],
    }
    path = tmp_path / "mine.jsonl"
    path.write_text("\n".join(json.dumps(x) for x in (gold_dialogue, chat, bad_recall)) + "\n")
    return path


def test_jsonl_rounds_with_gold_and_chat_messages(tmp_path):
    path = jsonl_fixture(tmp_path)
    with pytest.raises(DataError, match=r"mine.jsonl:3: field 'rounds\[0\].gold.recall'"):
        corpora.load_corpus("jsonl", path)
    dialogues, report = corpora.load_corpus("jsonl", path, on_error="skip")
    check_form(dialogues)
    g, c = dialogues
    assert g["rounds"][-1]["gold"]["recall"] == ["Q1", "A2"] and not any(r.get("query") for r in g["rounds"])
    assert c["id"] == "7" and c["rounds"][1] == {
        "user": "my name is Ana and yours?",
        "assistant": "Bot.",
        "query": True,
    }
    assert report["malformed"] == 1 and report["rounds_with_gold"] == 1


def test_load_corpus_errors_and_imports(tmp_path):
    with pytest.raises(ValueError, match="unknown source"):
        corpora.load_corpus("nope", tmp_path)
    with pytest.raises(DataError, match="needs --path"):
        corpora.load_corpus("coqa")
    with pytest.raises(DataError, match="no such file"):
        corpora.load_corpus("multiwoz", tmp_path / "missing.json")
    (tmp_path / "data.json").write_text("{oops")
    with pytest.raises(DataError, match="not valid JSON"):
        corpora.load_corpus("multiwoz", tmp_path)
    assert set(corpora.LOADERS) == {
        "locomo",
        "coqa",
        "multiwoz",
        "dailydialog",
        "redial",
        "mgshopdial",
        "chitchat",
        "jsonl",
    }
    code = (
        "import sys; import srt.data.corpora, srt.data.teacher; "
        "print(sorted(m for m in sys.modules if m.startswith('stage')))"
    )
    out = subprocess.run(
        [sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, check=True
    ).stdout
    assert out.strip() == "[]"
