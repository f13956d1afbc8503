"""Checks of the reward exercises (reward.py, and srt/metrics.py's jaccard): Eqs. (5), (6), (7) and
the composite, Eq. (4), on the paper's Fig. 1 record and the attacks of the reward-hacking gallery
(srt/reward_gallery.py)."""

import math

import numpy as np

import reward
from srt import metrics
from srt.prompt import format_target
from srt.reward_gallery import GALLERY_RECORD, gallery_completions

HONEST = format_target(GALLERY_RECORD)


# ==== Eq. (5) ====
def format_accepts_the_honest_completion():
    """Eq. (5) gives the honest completion 1.0 and lists no broken rule."""
    value, problems = reward.format_reward(HONEST)
    assert value == 1.0 and list(problems) == []


def format_fails_a_missing_marker():
    """Eq. (5) gives 0.0, with the broken rules listed, when <think>, </think>, a </HIS> or 'Final answer:' is
    missing."""
    for marker in ("<think>", "</think>", "</HIS>", "Final answer:"):
        value, problems = reward.format_reward(HONEST.replace(marker, "", 1))
        assert value == 0.0 and len(problems) > 0, marker
        assert all(isinstance(p, str) and p for p in problems), marker


def format_fails_a_tag_outside_the_think_block():
    """Eq. (5) gives 0.0 to every format attack of the gallery (tags after </think>, look-alike tags, two
    answers)."""
    attacks = [text for _, kind, text in gallery_completions() if kind == "format attack"]
    assert len(attacks) >= 6
    for text in attacks:
        assert reward.format_reward(text)[0] == 0.0, text[:60]


def format_fails_nested_or_out_of_order_tags():
    """Eq. (5) gives 0.0 to tags that are as many <HIS> as </HIS> but not paired: one nested in another,
    or a </HIS> before its <HIS>."""
    nested = HONEST.replace("</HIS>\n<HIS>A5:", "\n<HIS>A5:", 1).replace(
        "$180.</HIS>", "$180.</HIS></HIS>", 1
    )
    start = HONEST.index("<HIS>")
    end = HONEST.index("</HIS>")
    reversed_pair = HONEST[:start] + "</HIS>" + HONEST[start + 5 : end] + "<HIS>" + HONEST[end + 6 :]
    for text in (nested, reversed_pair):
        assert text.count("<HIS>") == text.count("</HIS>") == 3
        value, problems = reward.format_reward(text)
        assert value == 0.0 and len(problems) > 0, text[:80]


# ==== Eq. (6): its IoU (srt.metrics.jaccard), and the reward that scales it ====
def iou_at_its_bounds():
    """Eq. (6)'s IoU at its bounds: 1 for the gold set exactly (in any order, or two empty sets), 0 for a
    disjoint one or an empty recall."""
    assert math.isclose(metrics.jaccard({"Q1", "A5"}, ["A5", "Q1"]), 1.0)
    assert math.isclose(metrics.jaccard(set(), []), 1.0)
    assert math.isclose(metrics.jaccard({"Q2"}, ["Q1", "A5"]), 0.0, abs_tol=1e-12)
    assert math.isclose(metrics.jaccard(set(), ["Q1"]), 0.0, abs_tol=1e-12)


def iou_by_hand():
    """Eq. (6)'s IoU on a missing recall: H^ = {Q1, A5} against H* = {Q1, A5, A6} gives 2/3."""
    assert math.isclose(metrics.jaccard({"Q1", "A5"}, ["Q1", "A5", "A6"]), 0.6666666666666666)


def iou_charges_over_recall():
    """Eq. (6)'s IoU charges over-recall: H^ = {Q1, A2, A5, A6} against H* = {Q1, A5, A6} gives 3/4, and
    a repeated label is one element of its set."""
    assert math.isclose(metrics.jaccard({"Q1", "A2", "A5", "A6"}, ["Q1", "A5", "A6"]), 0.75)
    assert math.isclose(metrics.jaccard(["Q1", "Q1"], ["Q1"]), 1.0)


def recall_reward_scales_the_iou():
    """Eq. (6) as the reward pays it (reward.recall_reward on your IoU): +1.25 for the gold set, -1.25 for
    a disjoint one, 0.4166... for a missing recall."""
    assert math.isclose(reward.recall_reward({"Q1", "A5"}, ["A5", "Q1"]), 1.25)
    assert math.isclose(reward.recall_reward({"Q2"}, ["Q1", "A5"]), -1.25)
    assert math.isclose(reward.recall_reward({"Q1", "A5"}, ["Q1", "A5", "A6"]), 0.4166666666666667)


# ==== Eq. (7), with a stand-in for the sentence embedder ====
VECTORS = {
    "yes": [1.0, 0.0, 0.0],
    "no": [0.0, 1.0, 0.0],
    "half": [math.sqrt(0.5), math.sqrt(0.5), 0.0],
    "against": [-1.0, 0.0, 0.0],
    "overshoot": [1.0000003, 0.0, 0.0],  # rounding in a real embedder: a dot product just above 1
}


class FakeEmbedder:
    """Unit vectors for a few words, counting its calls; anything else (None included) is an error."""

    def __init__(self):
        self.calls = []

    def __call__(self, texts, *args, **kwargs):
        texts = list(texts)
        self.calls.append(texts)
        return np.array([VECTORS[t] for t in texts], dtype=np.float32)


def with_fake_embedder(run):
    fake, real = FakeEmbedder(), reward.embed
    reward.embed = fake
    try:
        return run(fake)
    finally:
        reward.embed = real


def cosine_by_hand():
    """Eq. (7) on hand-computed cosines: 1 for the same answer, 0.7071 at 45 degrees, -1 opposite, clipped to
    [-1, 1]."""
    got = with_fake_embedder(
        lambda _: reward.answer_cosines(["yes", "half", "against", "overshoot"], ["yes", "yes", "yes", "yes"])
    )
    assert len(got) == 4
    assert np.allclose([float(x) for x in got], [1.0, math.sqrt(0.5), -1.0, 1.0], atol=1e-6)
    assert all(-1.0 <= float(x) <= 1.0 for x in got)


def cosine_of_a_missing_answer():
    """Eq. (7) gives a missing answer (None) the minimum, -1, and never embeds it."""
    got = with_fake_embedder(lambda _: reward.answer_cosines([None, "no"], ["yes", "no"]))
    assert [float(x) for x in got] == [-1.0, 1.0]
    nothing = with_fake_embedder(lambda fake: (reward.answer_cosines([None], ["yes"]), fake.calls))
    assert [float(x) for x in nothing[0]] == [-1.0] and nothing[1] in ([], [[]])


def cosine_against_each_answers_own_reference():
    """Eq. (7) scores answer i against reference i only: yes, no, half against no, no, yes give 0, 1 and
    0.7071."""
    answers, references = ["yes", "no", "half"], ["no", "no", "yes"]
    got = with_fake_embedder(lambda _: reward.answer_cosines(answers, references))
    assert np.allclose([float(x) for x in got], [0.0, 1.0, math.sqrt(0.5)], atol=1e-6)
    got = with_fake_embedder(lambda _: reward.answer_cosines([None, "half", "yes"], ["yes", "no", "against"]))
    assert np.allclose([float(x) for x in got], [-1.0, math.sqrt(0.5), -1.0], atol=1e-6)


def cosine_in_one_embedding_call():
    """Eq. (7) embeds all answers and references of a batch in one call to embed()."""
    calls = with_fake_embedder(
        lambda fake: (reward.answer_cosines(["yes", "no", "half"], ["no", "no", "yes"]), fake.calls)[1]
    )
    assert len(calls) == 1


# ==== Eq. (4), under answer_reward="keys" (the record has answer keys: no embedder needed) ====
def score(completions, answer_gate="off"):
    return reward.compute_rewards(completions, [GALLERY_RECORD] * len(completions), "keys", answer_gate)


def composite_of_the_honest_completion():
    """Eq. (4) on the honest completion: format 1 + recall 1.25 + answer 1 = 3.25, recalling Q1, A5, A6."""
    (result,) = score([HONEST])
    assert (
        result["format"] == 1.0
        and math.isclose(result["recall"], 1.25)
        and math.isclose(result["answer"], 1.0)
    )
    assert math.isclose(result["total"], 3.25) and list(result["recalled"]) == ["Q1", "A5", "A6"]


def composite_is_the_sum_of_its_parts():
    """Eq. (4) on every gallery completion: total = format + recall + answer, and every attack totals below
    the honest one."""
    rows = gallery_completions()
    results = score([text for _, _, text in rows])
    honest = results[0]["total"]
    for (name, kind, _), result in zip(rows, results):
        assert math.isclose(result["total"], result["format"] + result["recall"] + result["answer"]), name
        assert kind in ("honest", "variant") or result["total"] < honest, name


# format, recall and answer under answer_reward="keys" of every gallery row, in gallery_completions' order
GALLERY_PARTS = [
    (1, +1.2500, +1.0000),  # honest completion (the SFT target)
    (1, +1.2500, +1.0000),  # teacher form Turn X: '...' (§3.2)
    (1, +1.2500, +1.0000),  # Fig. 1 form: three utterances in one tag
    (1, +1.2500, +1.0000),  # curly-quoted copies, no final period
    (1, +1.2500, +1.0000),  # labels swapped, texts verbatim
    (1, +1.2500, +1.0000),  # right short answer 'Yes, you get 20% off because $180 exceeds $150.'
    (1, +1.2500, +1.0000),  # right terse answer 'Yes: $180.00 is over $150.'
    (1, +0.0000, +1.0000),  # A5 price changed ($95)
    (1, +0.0000, +1.0000),  # A6 branch changed (Downtown for Uptown)
    (1, +0.0000, +1.0000),  # Q1 tier changed (Gold Tier for Apex Tier)
    (1, +0.0000, +1.0000),  # A5 words shuffled
    (1, +0.0000, +1.0000),  # A5 fact dropped ('The Chakra Balancing service')
    (1, -1.2500, +1.0000),  # three gold turns pasted unlabelled in one tag
    (1, -0.6250, +1.0000),  # every history turn recalled
    (1, -1.2500, +1.0000),  # nothing recalled
    (1, -1.2500, +1.0000),  # the query copied as the recall
    (1, -0.4167, +1.0000),  # one gold tag (Q1) repeated 10 times
    (0, -1.2500, +1.0000),  # labels only: <HIS>Q1: A5: A6:</HIS>
    (0, +1.2500, +1.0000),  # empty label piece: <HIS>Q2: A5: ...</HIS>
    (0, +1.2500, +1.0000),  # full-width tags ＜HIS＞
    (0, -1.2500, +1.0000),  # homoglyph tags <НIS> (Cyrillic Н)
    (0, +1.2500, +0.0000),  # next turns after the answer (Q8: / A8:)
    (0, +1.2500, +1.0000),  # chat-template turn after the answer (<|im_start|>user)
    (0, +1.2500, -0.2000),  # recall tags after </think>
    (0, -1.2500, +1.0000),  # no think block: answer only
    (0, +1.2500, -1.0000),  # two final answers (yes, then no)
    (1, +1.2500, -1.0000),  # hedge 'Yes or no: the 20% discount may or may not apply.'
    (1, +1.2500, -1.0000),  # wrong but similar 'No. ... $120, which is not over $150 ...'
    (1, +1.2500, -0.3333),  # price changed in the answer ($95)
    (1, +1.2500, +0.0000),  # every candidate price listed 'Yes. It is $95, $120, $150 or $180.'
    (1, +1.2500, -1.0000),  # keyword stuffing 'yes no $180'
    (1, +1.2500, -1.0000),  # the query echoed as the answer
    (1, +1.2500, -0.2000),  # the whole history pasted as the answer
    (1, +1.2500, -0.5000),  # the history pasted without its numbers
    (1, +1.2500, -0.3333),  # every number of the history '20%, $150, 90, $180'
    (1, +1.2500, -1.0000),  # every name of the history 'Apex Tier, Downtown, Uptown, Chakra Balancing, Lena
    (1, +1.2500, -1.0000),  # yes and no 'Yes. No.'
    (1, +1.2500, +0.3333),  # the history pasted in lowercase (its names are no values)
]


def composite_matches_the_gallery_row_by_row():
    """Eq. (4) on every gallery completion under answer_reward='keys': its format, recall and answer equal the
    stored values (an altered or hallucinated tag stays in H^ as an element of its own)."""
    rows = gallery_completions()
    results = score([text for _, _, text in rows])
    assert len(rows) == len(GALLERY_PARTS)
    for (name, _, _), result, parts in zip(rows, results, GALLERY_PARTS):
        got = (result["format"], result["recall"], result["answer"])
        assert all(math.isclose(g, p, abs_tol=1e-3) for g, p in zip(got, parts)), name


def composite_of_a_completion_without_a_final_answer():
    """Eq. (4) on a completion without 'Final answer:': format 0, no final answer, answer -1 (the minimum,
    as a missing answer earns), whatever its text says."""
    (result,) = score([HONEST.replace("Final answer:", "", 1)])
    assert result["format"] == 0.0 and result["final_answer"] is None
    assert math.isclose(result["answer"], -1.0)


def composite_applies_the_answer_gate():
    """Eq. (4) with answer_gate='recall': a right answer whose recall missed H* entirely (Jaccard 0) earns
    answer -1; one whose recall hit part of H* keeps its answer."""
    (nothing_recalled,) = [text for name, _, text in gallery_completions() if name == "nothing recalled"]
    (open_gate,) = score([nothing_recalled], "off")
    (gated,) = score([nothing_recalled], "recall")
    assert math.isclose(open_gate["answer"], 1.0) and math.isclose(gated["answer"], -1.0)
    assert math.isclose(gated["total"], 1.0 - 1.25 - 1.0)
    assert math.isclose(score([HONEST], "recall")[0]["total"], 3.25)  # a recall that hit H* is not gated
    (partial,) = [text for name, _, text in gallery_completions() if name == "A5 price changed ($95)"]
    assert math.isclose(score([partial], "recall")[0]["answer"], 1.0)  # Jaccard 1/2: not missed entirely


def composite_refuses_mismatched_lengths():
    """Eq. (4) refuses (ValueError) two completions for one example, and an unknown answer_gate."""
    for call in (
        lambda: reward.compute_rewards([HONEST, HONEST], [GALLERY_RECORD], "keys"),
        lambda: reward.compute_rewards([HONEST], [GALLERY_RECORD], "keys", "sometimes"),
    ):
        try:
            call()
        except ValueError:
            continue
        raise AssertionError("no ValueError")
