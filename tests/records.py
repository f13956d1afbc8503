"""Hand-made stage-0 records shared by the training tests (no generator, no embedder)."""


def hand_record(i: int, rounds: int = 6, recall=("Q1", "A2"), pruned_extra=("Q4",), price=None) -> dict:
    """A dialogue of `rounds - 1` earlier rounds in which every utterance text is unique; the
    answer is `price` (default ${20 + i})."""
    history = []
    for r in range(1, rounds):
        history.append(
            {"label": f"Q{r}", "speaker": "user", "text": f"user line {r} of chat {i}: need item {r * 7 + i}"}
        )
        history.append(
            {
                "label": f"A{r}",
                "speaker": "assistant",
                "text": f"agent line {r} of chat {i}: price ${r * 10 + i}",
            }
        )
    text = {t["label"]: t["text"] for t in history}
    his = "\n".join(f"<HIS>{label}: {text[label]}</HIS>" for label in recall)
    answer = f"${20 + i if price is None else price}"
    return {
        "id": f"hand-{i:03d}-t{rounds:02d}",
        "source": "jsonl",
        "history": history,
        "query": f"what was the price for chat {i}?",
        "query_turn": rounds,
        "recall": list(recall),
        "reasoning": f"1. Analyze Query: price.\n2. Recall History: {his}\n3. Reasoning: it is {answer}.",
        "answer": answer,
        "answer_keys": [answer],
        "pruned": list(recall) + [x for x in pruned_extra if x in text and x not in recall],
        "meta": {"num_turns": rounds, "bucket": 8, "scores": {}},
    }
