"""An example reward that the gallery beats: recall judged by the labels a tag names.

A gold turn counts as recalled when its label (Q1, A5) appears in a <HIS> tag, whatever the tag
copies after it; Eq. (6)'s union is gone too, so naming more turns costs nothing. Format and answer
are the project's own (Eq. (5); Eq. (7) by answer keys). Run it against the attacks:

    python reward.py --gallery --reward docs/rewards/substring_recall.py

It ties the honest completion on every tag whose copy was altered (a price, a branch, a tier
changed; words shuffled; a fact dropped) and on recalling every turn of the history.

In a student's copy it needs exercise eq5 (format_reward) done, and no other: the gallery says so
when it is not.
"""

import re

from reward import answer_rewards, format_reward
from srt.completion import parse_completion


def compute_rewards(completions, examples, answer_reward="keys", answer_gate="off"):
    parsed = [parse_completion(text) for text in completions]
    answers = answer_rewards([p.final_answer for p in parsed], examples, answer_reward)
    results = []
    for text, p, example, answer in zip(completions, parsed, examples, answers):
        tags = " ".join(p.tags)
        gold = example["recall"]
        named = [label for label in gold if re.search(rf"\b{label}\b", tags)]  # the flaw: a label is no copy
        recall = 2.5 * len(named) / len(gold) - 1.25 if gold else 1.25
        format_value = format_reward(text)[0]
        total = format_value + recall + answer["answer"]
        results.append({"format": format_value, "recall": recall, "answer": answer["answer"], "total": total})
    return results
