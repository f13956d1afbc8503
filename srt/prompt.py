"""The prompt format: what the policy reads and what SFT teaches it to write (docs/design.md).

- P(Q_t, C_t): the SRT instruction as the system message, the labelled history and the current
  query as the user message, rendered through the model's own chat template (§3.1, §4.8);
- the target (Z_t, A*_t) that SFT learns (Eq. (3)) and its one recall action o_k (Eq. (1));
- fitting a prompt to a token budget: the oldest utterances go first, whatever they are, because
  H* is unknown when a user asks.
"""

from __future__ import annotations

import re

from srt.loading import CHATML_TEMPLATE

# the <HIS> tags of a reasoning chain Z_t, and what the SRT instruction asks for when none is needed
HIS_TAG = re.compile(r"<HIS>.*?</HIS>", re.S)
NO_RECALL = "No earlier turn is needed."


def render_chat(tokenizer, messages: list[dict]) -> str:
    """Messages as prompt text through the model's own chat template, ending where the assistant
    starts to write."""
    template = None if getattr(tokenizer, "chat_template", None) else CHATML_TEMPLATE
    return tokenizer.apply_chat_template(
        messages, tokenize=False, add_generation_prompt=True, chat_template=template
    )


# --------------------------------------------------------------------------------------------
# The prompt P(Q_t, C_t) and the target (Z_t, A*_t)  (docs/design.md, "Output format")
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
    return "\n".join(
        f"{turn['label']}: {turn['text']}" for turn in history if keep is None or turn["label"] in keep
    )


def build_messages(record, keep=None, system=SRT_SYSTEM_PROMPT, history=None) -> list[dict]:
    """Chat messages for P(Q_t, C_t): the SRT instruction as the system message, the labelled
    history and the current query as the user message."""
    history = record["history"] if history is None else history
    shown = format_history(history, keep)
    user = (
        f"Dialogue history:\n{shown if shown else '(empty)'}\n\n"
        f"Current query (Q{record['query_turn']}): {record['query']}"
    )
    return [{"role": "system", "content": system}, {"role": "user", "content": user}]


def render_prompt(tokenizer, record, keep=None, system=SRT_SYSTEM_PROMPT, history=None) -> str:
    """P(Q_t, C_t) as text, through the model's own chat template, ending where the assistant
    starts to write."""
    return render_chat(tokenizer, build_messages(record, keep=keep, system=system, history=history))


def format_target(record, with_reasoning=True, recall_only=False) -> str:
    """The completion SFT learns: Z_t inside one think block, then the answer A*_t. Without
    reasoning (the "w/o CoT" ablation of Table 2) only the answer line remains; `recall_only` keeps
    the think block with the <HIS> recalls of Z_t and nothing else (no Analyze, no Reasoning prose),
    to tell what the recall costs a small model apart from what the prose costs."""
    answer = f"Final answer: {record['answer']}"
    if not with_reasoning:
        return answer
    if recall_only:
        recalls = "\n".join(HIS_TAG.findall(record["reasoning"])) or NO_RECALL
        return f"<think>\n{recalls}\n</think>\n{answer}"
    return f"<think>\n{record['reasoning'].strip()}\n</think>\n{answer}"


def his_tag(turn) -> str:
    """One recall action o_k of Eq. (1): a label and a verbatim copy of one utterance."""
    return f"<HIS>{turn['label']}: {turn['text']}</HIS>"


# --------------------------------------------------------------------------------------------
# The prompt under a token budget (SFT's --max-length, GRPO's --max-prompt-length): the oldest
# utterances go first, whatever they are.
# H* is unknown at inference time, so it is never protected; a gold turn that falls out is only
# counted (the prompt is then unanswerable from the history, as it would be for a user).
# --------------------------------------------------------------------------------------------
def fit_history(tokenizer, record, history, budget: int) -> tuple[list[dict], str, list[int]]:
    """Drop the oldest utterances, whole ones and whatever they are, until the rendered prompt has
    at most `budget` tokens. -> (history kept, prompt text, prompt ids). The query is never cut.
    The prompt grows monotonically with the turns kept, so a binary search over how many of the
    oldest turns go finds the fewest drops. H* is never protected: at inference time it is
    unknown, and in training an old turn that survived because it is gold would be a tell."""

    def render(kept):
        text = render_prompt(tokenizer, record, history=kept)
        return text, tokenizer(text, add_special_tokens=False)["input_ids"]

    text, ids = render(history)
    if len(ids) <= budget:
        return history, text, ids
    lo, hi = 1, len(history)  # dropping every turn is the best we can do
    while lo < hi:
        mid = (lo + hi) // 2
        if len(render(history[mid:])[1]) <= budget:
            hi = mid
        else:
            lo = mid + 1
    kept = history[hi:]
    text, ids = render(kept)
    return kept, text, ids


def fit_prompt(tokenizer, record, max_prompt_length) -> tuple[str | None, int]:
    """-> (prompt text, or None when even the query alone does not fit; gold turns cut)."""
    if not max_prompt_length:
        return render_prompt(tokenizer, record), 0
    kept, prompt, ids = fit_history(tokenizer, record, record["history"], max_prompt_length)
    if len(ids) > max_prompt_length:
        return None, 0
    kept_labels = {turn["label"] for turn in kept}
    return prompt, sum(label not in kept_labels for label in record["recall"])
