"""§4.6 attention analysis (Fig. 3): the share of attention mass flowing from the answer tokens
onto each history turn's line in the prompt, with and without a self-recall chain before the
answer. A library module used by evaluate.py: it imports no stage."""

from __future__ import annotations

import re

import numpy as np
import torch

from srt.metrics import final_answer


@torch.inference_mode()
def attention_share(model, tokenizer, prompt_text: str, completion_text: str, spans) -> np.ndarray:
    """Share of attention mass flowing from the answer tokens (the completion after its last
    'Final answer:', or the whole completion without one) onto each span, averaged over answer
    tokens, heads and layers. spans[j] is a list of (start, end) character ranges in
    prompt_text + completion_text, e.g. a turn's line in the prompt and its <HIS> copy in the
    completion. Every value lies in [0, 1], and for disjoint spans they sum to at most 1.

    Attention weights exist only in the eager implementation, so the model is switched to
    attn_implementation="eager" for this forward pass (output_attentions=True) and switched back
    afterwards; no second copy of the weights is loaded. The text is tokenized piece by piece
    between span boundaries so that every token belongs to exactly one piece."""
    text = prompt_text + completion_text
    cut = completion_text.rfind("Final answer:")
    answer_start = len(prompt_text) + (cut + len("Final answer:") if cut >= 0 else 0)
    bounds = sorted({0, len(text), answer_start} | {b for ranges in spans for r in ranges for b in r})
    ids, starts = [], []
    for a, b in zip(bounds, bounds[1:]):
        piece = tokenizer(text[a:b], add_special_tokens=False)["input_ids"]
        ids += piece
        starts += [a] * len(piece)
    starts = np.array(starts)
    rows = torch.from_numpy(np.flatnonzero(starts >= answer_start))
    if len(rows) == 0:  # an empty answer: read the attention of the last token instead
        rows = torch.tensor([len(ids) - 1])

    def tokens_in(ranges):
        inside = np.zeros(len(ids), dtype=bool)
        for s, e in ranges:
            inside |= (starts >= s) & (starts < e)
        return torch.from_numpy(np.flatnonzero(inside))

    columns = [tokens_in(ranges) for ranges in spans]
    previous = model.config._attn_implementation
    model.set_attn_implementation("eager")
    try:
        output = model(input_ids=torch.tensor([ids], device=model.device), output_attentions=True)
    finally:
        model.set_attn_implementation(previous)
    share = np.zeros(len(spans))
    for layer in output.attentions:  # (1, heads, T, T); each row sums to 1 over keys
        from_answer = layer[0][:, rows.to(layer.device), :].float()
        for j, cols in enumerate(columns):
            if len(cols):
                share[j] += from_answer[:, :, cols.to(layer.device)].sum(-1).mean().item()
    return np.clip(share / len(output.attentions), 0.0, 1.0)


HIS_TAG = re.compile(r"<HIS>\s*([QA]\d+)\s*:(.*?)</HIS>", re.S)


def turn_spans(
    record, prompt_text: str, completion_text: str = "", copies: bool = False
) -> list[list[tuple[int, int]]]:
    """For each history turn: where its line sits in the prompt (offsets in prompt_text +
    completion_text); with copies=True also every <HIS> tag of the completion that names it.
    §4.6 compares the prompt lines alone: attention on a turn's own <HIS> copy, which sits right
    before the answer, would make the self-recall setting win by construction."""
    spans, cursor = [], 0
    for turn in record["history"]:
        line = f"{turn['label']}: {turn['text']}"
        at = prompt_text.find(line, cursor)
        ranges = [] if at < 0 else [(at, at + len(line))]
        cursor = cursor if at < 0 else at + len(line)
        spans.append(ranges)
    if copies:
        index = {turn["label"]: j for j, turn in enumerate(record["history"])}
        for match in HIS_TAG.finditer(completion_text):
            if match.group(1) in index:
                spans[index[match.group(1)]].append(
                    (len(prompt_text) + match.start(), len(prompt_text) + match.end())
                )
    return spans


def attention_analysis(
    model, tokenizer, rows, records_by_id, n_examples, build_prompt, reference_chain
) -> list[dict]:
    """Fig. 3: the per-turn attention share of the answer tokens when the model answers after
    recalling (its own chain; the reference chain Z_t where it recalled nothing) against the same
    answer written right after the same prompt, without recall; in both settings the share is
    read on the turns' prompt lines alone (turn_spans). Examples: records with a non-empty
    H*, longest dialogues first, those whose completion recalls and answers first. Memory:
    output_attentions keeps layers x heads x T x T floats, ~2.5 GB for SmolLM2-135M at T = 1500.
    build_prompt(record) -> the prompt text the variant answered; reference_chain(record) -> Z_t
    and A*_t as SFT learns them (srt.prompt.format_target)."""

    def own_chain(row):
        return bool(HIS_TAG.search(row["completion"])) and bool(final_answer("srt", row["completion"]))

    candidates = sorted(
        (r for r in rows if records_by_id[r["id"]]["recall"]),
        key=lambda r: (not own_chain(r), -r["num_turns"], r["id"]),
    )
    results = []
    for row in candidates[:n_examples]:
        record = records_by_id[row["id"]]
        prompt = build_prompt(record)
        from_model = own_chain(row)
        chain = row["completion"] if from_model else reference_chain(record)
        answer = final_answer("srt", chain)
        settings = {"no_recall": f"Final answer: {answer}", "self_recall": chain}
        entry = {
            "id": record["id"],
            "num_turns": row["num_turns"],
            "chain": "model" if from_model else "reference",
            "turns": [t["label"] for t in record["history"]],
            "gold": record["recall"],
        }
        for setting, completion in settings.items():
            share = attention_share(
                model, tokenizer, prompt, completion, turn_spans(record, prompt, completion)
            )
            entry[setting] = share.tolist()
            total = share.sum()
            entry[f"{setting}_on_gold"] = (
                float(sum(s for t, s in zip(entry["turns"], share) if t in record["recall"]) / total)
                if total > 0
                else 0.0
            )
        results.append(entry)
    return results
