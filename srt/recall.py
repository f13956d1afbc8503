"""Recall by pointer (--recall copy): the model names the turn, the program writes it out.

The paper's recall action o_k (Eq. (1)) is a `<HIS>` tag holding a verbatim copy of one earlier
utterance, "a predefined signal to replay" a turn. In copy mode the model writes the signal, the
opening tag and a label, `<HIS>A3:`, and the decoder replays the turn: it appends the rest of
utterance A3 exactly as the row's own prompt renders it, then `</HIS>`, and the row samples on.
A label the prompt does not hold is not expanded: the model writes on, and the reward scores what
it wrote (a wrong recall). Free mode (`--recall free`) is the paper's: the model copies every token.

The program's tokens are not the policy's: GRPO gives them policy_mask 0 (no ratio, no KL, no
entropy, no normalisation), and stage 1 in copy mode leaves them out of Eq. (3), so both spend
their signal on the choice of the turn. They stay in the sequence: later tokens attend to them.

Nothing here reads gold: the turns come from the prompt text the model reads (after fitting to
the token budget), never from the record's H*.
"""

from __future__ import annotations

import re

RECALL_MODES = ("free", "copy")
# The turns of a prompt as srt/prompt.format_history renders them, one per line: "A3: text".
HISTORY_LINE = re.compile(r"^([QA]\d+): (.*)$")
# An open tag at the end of what a row has written: `<HIS>`, a label, its colon, and possibly the
# start of the copy (a token may join the colon, or the space, with the text that follows).
OPEN_TAG = re.compile(r"<HIS>\s*([QA]\d+):([^<]*)\Z")
TAIL_TOKENS = 24  # how much of a row's end the trigger decodes: the tag, its label and a few tokens


def prompt_history(prompt: str) -> dict[str, str]:
    """{label: utterance} of the dialogue history a rendered prompt shows (srt/prompt.build_messages:
    "Dialogue history:" up to "Current query"), as the prompt renders it."""
    start = prompt.find("Dialogue history:\n")
    end = prompt.find("\n\nCurrent query", start)
    if start < 0 or end < 0:
        return {}
    turns, label = {}, None
    for line in prompt[start + len("Dialogue history:\n") : end].split("\n"):
        match = HISTORY_LINE.match(line)
        if match:
            label = match.group(1)
            turns[label] = match.group(2)
        elif label is not None:  # an utterance that holds a newline goes on on the next line
            turns[label] += "\n" + line
    return turns


def tag_tail(label: str, text: str) -> str:
    """What the program writes after `<HIS>LABEL:`: the rest of srt/prompt.his_tag's string."""
    return f" {text}</HIS>"


def tail_ids(tokenizer, label: str, text: str, written: str = "") -> list[int]:
    """The token ids of the tag's tail after what the row has `written` past the colon, as the SFT
    target tokenizes them: the tag is tokenized whole (srt/prompt.his_tag's string) and the tokens
    that start at or after the boundary are kept. Where a token of the whole tag straddles the
    boundary (the row stopped inside it), the rest is tokenized on its own."""
    tag = f"<HIS>{label}:{tag_tail(label, text)}"
    boundary = len(f"<HIS>{label}:") + len(written)
    encoded = tokenizer(tag, add_special_tokens=False, return_offsets_mapping=True)
    offsets = encoded["offset_mapping"]
    if any(start < boundary < end for start, end in offsets):
        return tokenizer(tag[boundary:], add_special_tokens=False)["input_ids"]
    return [i for i, (start, _) in zip(encoded["input_ids"], offsets) if start >= boundary]


class CopyRule:
    """The decoder's trigger (srt/decode.py `copy_rule`): called with a row and its completion ids
    so far, -> the ids the program appends now ([] for none). `histories[j]` is prompt j's
    {label: utterance}; rows j*K .. j*K+K-1 are prompt j's. Records what it expanded per row."""

    def __init__(self, tokenizer, histories: list[dict], rows_per_prompt: int):
        self.tokenizer, self.histories, self.K = tokenizer, histories, rows_per_prompt
        self.expanded: dict[int, list[str]] = {}
        self.longest = max(
            (len(tail_ids(tokenizer, label, text)) for h in histories for label, text in h.items()), default=0
        )

    def __call__(self, row: int, completion: list[int]) -> list[int]:
        text = self.tokenizer.decode(completion[-TAIL_TOKENS:], skip_special_tokens=False)
        match = OPEN_TAG.search(text)
        if match is None:
            return []
        label, written = match.group(1), match.group(2)
        utterance = self.histories[row // self.K].get(label)
        if utterance is None or not tag_tail(label, utterance).startswith(written):
            return []  # not a turn of this prompt, or the row already wrote something else
        self.expanded.setdefault(row, []).append(label)
        return tail_ids(self.tokenizer, label, utterance, written)


def copied_spans(target: str, history: dict[str, str]) -> list[tuple[int, int]]:
    """Character spans of `target` that copy mode's program would write: in each `<HIS>LABEL: text</HIS>`
    whose label the prompt holds and whose text is that turn verbatim, the tail after the colon
    (the text and the closing tag). Stage 1 leaves their tokens out of Eq. (3)."""
    spans = []
    for match in re.finditer(r"<HIS>([QA]\d+):( (.*?)</HIS>)", target, re.S):
        if history.get(match.group(1)) == match.group(3):
            spans.append((match.start(2), match.end(2)))
    return spans


def add_recall_flag(parser, help) -> None:
    """--recall: free (the paper: the model copies every token of a recalled turn) or copy."""
    parser.add_argument("--recall", choices=RECALL_MODES, default="free", help=help)
