"""An example reward that the gallery beats: the answer judged by keywords.

The answer earns 1 when it contains every answer key ("yes", "$180") as a substring, else -1;
format and recall are the project's own (Eqs. (5) and (6)). Run it against the attacks:

    python reward.py --gallery --reward docs/rewards/keyword_answer.py

It ties the honest completion on keyword stuffing ("yes no $180"), on listing every candidate
price, and on pasting the whole history as the answer, as written or in lowercase (it says "Yes"
and "$180" somewhere).

In a student's copy it needs exercises eq5 (format_reward) and eq6 (jaccard, which recall_reward
scales) done, and no other: the gallery says which one is missing.
"""

from reward import format_reward, match_tags, recall_reward, recall_sets
from srt.completion import index_history, parse_completion


def compute_rewards(completions, examples, answer_reward="keys", answer_gate="off"):
    results = []
    for text, example in zip(completions, examples):
        parsed, index = parse_completion(text), index_history(example["history"])
        _, _, recalled = recall_sets(match_tags(parsed.tags, index), index.labels)  # H^ as Eq. (6) reads it
        answer = (parsed.final_answer or "").lower()
        keys = [str(key).lower() for key in example.get("answer_keys") or []]
        parts = {
            "format": format_reward(text)[0],
            "recall": recall_reward(recalled, example["recall"]),
            "answer": 1.0 if answer and all(key in answer for key in keys) else -1.0,  # the flaw
        }
        results.append({**parts, "total": sum(parts.values())})
    return results
