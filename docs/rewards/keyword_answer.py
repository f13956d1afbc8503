"""An example reward that the gallery beats: the answer judged by keywords.

The answer earns 1 when it contains every answer key ("yes", "$180") as a substring, else -1;
format and recall are the project's own (Eqs. (5) and (6)). Run it against the attacks:

    python reward.py --gallery --reward docs/rewards/keyword_answer.py

It ties the honest completion on keyword stuffing ("yes no $180"), on listing every candidate
price, and on pasting the whole history as the answer, as written or in lowercase (it says "Yes"
and "$180" somewhere).
"""

from reward import compute_rewards as project_rewards


def compute_rewards(completions, examples, answer_reward="keys", answer_gate="off"):
    results = project_rewards(completions, examples, "keys")  # format and recall as the project scores them
    for result, example in zip(results, examples):
        answer = (result["final_answer"] or "").lower()
        keys = [str(key).lower() for key in example.get("answer_keys") or []]
        result["answer"] = 1.0 if answer and all(key in answer for key in keys) else -1.0  # the flaw
        result["total"] = result["format"] + result["recall"] + result["answer"]
    return results
