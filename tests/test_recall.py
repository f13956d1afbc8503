"""Recall by pointer (srt/recall.py, --recall copy): the model names a turn, the decoder writes it out
verbatim, its tokens are not the policy's, and SFT in copy mode leaves them out of Eq. (3). Tiny
random models: a random model never writes `<HIS>A1:` of its own accord, so the end-to-end tests
script the first tokens a row draws (decode.next_tokens) and let the loop do the rest."""

import random

import pytest
import torch
from grpo_records import sample, step_on
from records import hand_record
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
from transformers import PreTrainedTokenizerFast

import stage1_sft
import stage2_grpo as g
from srt import decode, generation
from srt.loading import load_model_and_tokenizer
from srt.prompt import fit_prompt, his_tag, render_prompt
from srt.recall import CopyRule, copied_spans, prompt_history, tail_ids

pytestmark = pytest.mark.usefixtures("one_thread")


def joined_tokenizer():
    """A byte-level BPE without the pre-tokenizer's split at punctuation and spaces, trained on tags:
    its merges join the colon and the space (": " is one token) and a word with its space, the case
    the boundary must survive."""
    rng = random.Random(0)
    words = ["agent", "user", "line", "price", "item", "need", "chat", "the", "spa", "opens"]
    corpus = [
        f"<HIS>{rng.choice('QA')}{rng.randint(1, 9)}: "
        + " ".join(rng.choice(words) for _ in range(5))
        + "</HIS>"
        for _ in range(300)
    ]
    bpe = Tokenizer(models.BPE())
    bpe.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    bpe.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=300, special_tokens=["<|endoftext|>", "<|im_end|>"], show_progress=False,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
    )  # fmt: skip
    bpe.train_from_iterator(corpus, trainer=trainer)
    return PreTrainedTokenizerFast(tokenizer_object=bpe, eos_token="<|im_end|>", pad_token="<|endoftext|>")


def scripted(monkeypatch, text_ids):
    """Every row draws `text_ids` first (what the program's trigger reads), then the model's own."""
    real = decode.next_tokens
    state = {"step": 0}

    def next_tokens(logits, *args, **kwargs):
        token, logprob = real(logits, *args, **kwargs)
        if state["step"] < len(text_ids):
            token = torch.full_like(token, text_ids[state["step"]])
        state["step"] += 1
        return token, logprob

    monkeypatch.setattr(decode, "next_tokens", next_tokens)
    return state


# ---------------------------------------------------------------------------------------------
# The rule: what a prompt holds, where the copy starts, what it appends
# ---------------------------------------------------------------------------------------------
def test_prompt_history_reads_the_turns_the_prompt_shows_not_the_record(tiny):
    _, tokenizer = tiny
    record = hand_record(0, 12, ("Q1",), pruned_extra=())
    full = prompt_history(render_prompt(tokenizer, record))
    assert full == {t["label"]: t["text"] for t in record["history"]}
    n_full = len(tokenizer(render_prompt(tokenizer, record), add_special_tokens=False).input_ids)
    fitted, cut = fit_prompt(tokenizer, record, n_full - 1)
    shown = prompt_history(fitted)
    assert cut == 1 and "Q1" not in shown and shown == {k: v for k, v in full.items() if k in shown}
    assert prompt_history("no history here") == {}


@pytest.mark.parametrize("which", ["tiny", "joined"])
def test_an_expanded_tag_equals_its_turn_byte_for_byte_wherever_the_model_stopped(tiny, which):
    """The row has written `<HIS>A2:` and possibly the start of the copy; what the rule appends
    completes the tag exactly, for every place a token boundary can fall, also with a tokenizer
    whose tokens join the colon, the space and the text."""
    tokenizer = tiny[1] if which == "tiny" else joined_tokenizer()
    text = "agent line 2 of chat 0: price $20"
    tag = his_tag({"label": "A2", "text": text})
    whole = tokenizer(tag, add_special_tokens=False, return_offsets_mapping=True)
    colon = len("<HIS>A2:")
    if which == "joined":  # the planted case: a token holds the colon and what follows it
        assert any(a < colon < b or (a <= colon and b > colon + 1) for a, b in whole["offset_mapping"])
    rule = CopyRule(tokenizer, [{"A2": text, "Q1": "user line"}], rows_per_prompt=1)
    opened = next(
        k
        for k in range(len(whole["input_ids"]) + 1)
        if tokenizer.decode(whole["input_ids"][:k]).startswith("<HIS>A2:")
    )
    for cut in range(len(whole["input_ids"]) + 1):
        written = whole["input_ids"][:cut]
        appended = rule(0, tokenizer("<think>\n", add_special_tokens=False).input_ids + written)
        if cut < opened or tokenizer.decode(written) == tag:
            assert appended == [], cut  # no open tag yet, or already closed
            continue
        if cut <= opened + 3:  # the trigger fires at the colon: at most a token or so has passed it
            assert appended, (which, cut)
        if appended:
            assert tokenizer.decode(written + appended) == tag, (which, cut)
    assert rule.expanded[0][0] == "A2"


def test_the_appended_tokens_are_the_sft_targets_tokens(tiny):
    """SFT in copy mode masks exactly the tokens the decoder appends after each `<HIS>LABEL:`, as
    the whole target tokenizes them: SFT and decoding agree at the boundary."""
    _, tokenizer = tiny
    record = hand_record(3, 5, ("Q1", "A2"), pruned_extra=())
    example = stage1_sft.build_example(tokenizer, record, phase=2, max_length=4096, recall="copy")
    free = stage1_sft.build_example(tokenizer, record, phase=2, max_length=4096)
    assert example["input_ids"] == free["input_ids"]
    masked = [i for i, (a, b) in enumerate(zip(example["labels"], free["labels"])) if a != b]
    texts = {t["label"]: t["text"] for t in record["history"]}
    expected = sum((tail_ids(tokenizer, label, texts[label]) for label in ("Q1", "A2")), [])
    assert [example["input_ids"][i] for i in masked] == expected and example["copied"] == len(expected)
    # What stays in the loss: the label and colon of each tag, the prose, the answer.
    kept = tokenizer.decode([t for t, label in zip(example["input_ids"], example["labels"]) if label != -100])
    assert "<HIS>Q1:" in kept and "<HIS>A2:" in kept and "Final answer: $23" in kept and "Reasoning" in kept
    assert texts["Q1"] not in kept and "</HIS>" not in kept
    # A tag whose text is not the turn verbatim is the model's to write: nothing masked.
    assert copied_spans("<HIS>Q1: not the turn</HIS>", texts) == []


# ---------------------------------------------------------------------------------------------
# The decoder: one forward for the copy, or one token a step; the next token is the model's
# ---------------------------------------------------------------------------------------------
def test_generate_in_copy_mode_writes_the_turn_and_marks_it_not_the_policys(tiny, monkeypatch):
    """The copy written in one forward (the grouped step) gives the tokens, log-probs and copied mask
    of the loops that write it one token a step: the model's own forward, and the grouped step
    kept at one shape (static_shapes, what a CUDA graph replays)."""
    model, tokenizer = tiny
    record = hand_record(0, 4, ("A1",), pruned_extra=())
    prompt = render_prompt(tokenizer, record)
    trigger = tokenizer("<think>\n<HIS>A1:", add_special_tokens=False).input_ids
    scripted(monkeypatch, trigger)
    out = generation.generate(model, tokenizer, [prompt], max_new_tokens=40, greedy=True, recall="copy")
    tag = his_tag(record["history"][1])
    assert out["texts"][0].startswith("<think>\n" + tag) and out["expanded"] == [["A1"]]
    copied = (out["completion_mask"] - out["policy_mask"])[0].bool()
    n = len(tail_ids(tokenizer, "A1", record["history"][1]["text"]))
    assert out["copied_tokens"] == [n] and copied.sum() == n
    assert copied[len(trigger) : len(trigger) + n].all()  # right after the colon, contiguous
    assert (out["sampler_logprobs"][0][copied] == 0).all() and out["decoded_tokens"][0] == 40 - n
    # Greedy after the copy: the same tokens as a loop that writes the copy one token a step.
    ids = tokenizer([prompt], return_tensors="pt", add_special_tokens=False)
    stops = generation.stop_token_ids(model, tokenizer)
    for one_a_step in ({"grouped": False}, {"static_shapes": True}):
        scripted(monkeypatch, trigger)
        rule = CopyRule(tokenizer, [prompt_history(prompt)], 1)
        sequences, logprobs, copied_one = decode.decode(
            model, ids.input_ids, ids.attention_mask, 40, stops, tokenizer.pad_token_id, greedy=True,
            with_logprobs=True, copy_rule=rule, **one_a_step,
        )  # fmt: skip
        assert torch.equal(sequences[:, ids.input_ids.shape[1] :], out["completion_ids"]), one_a_step
        assert torch.equal(logprobs, out["sampler_logprobs"]) and torch.equal(copied_one, copied[None])


def test_a_label_missing_from_the_prompt_is_not_expanded(tiny, monkeypatch):
    model, tokenizer = tiny
    prompt = render_prompt(tokenizer, hand_record(0, 4, ("A1",), pruned_extra=()))
    scripted(monkeypatch, tokenizer("<HIS>Q9:", add_special_tokens=False).input_ids)
    out = generation.generate(model, tokenizer, [prompt], max_new_tokens=12, greedy=True, recall="copy")
    assert out["expanded"] == [[]] and out["copied_tokens"] == [0]
    assert torch.equal(out["policy_mask"], out["completion_mask"])
    with pytest.raises(ValueError, match="engine='ours'"):
        generation.generate(model, tokenizer, [prompt], max_new_tokens=2, recall="copy", engine="hf")


def test_a_grpo_step_in_copy_mode_trains_on_the_policys_tokens_only(monkeypatch):
    """Sampled rows that open a tag get the turn from the program: policy_mask 0 there, and the
    update's normalisation, ratio and KL read only the policy's tokens (its token count is the
    policy mask's, the logged copied_length the program's share)."""
    policy, tokenizer = load_model_and_tokenizer("tiny-random", dtype="float32")
    records = [hand_record(i, 4, ("A1",), pruned_extra=()) for i in range(2)]
    prompts = [render_prompt(tokenizer, r) for r in records]
    cfg = g.parse_args(["--model", "tiny-random", "--dtype", "float32", "-K", "2", "--max-new-tokens", "30",
                        "--sample-ratio", "1", "--recall", "copy", "--loss-type", "dapo"])  # fmt: skip
    scripted(monkeypatch, tokenizer("<think>\n<HIS>A1:", add_special_tokens=False).input_ids)
    torch.manual_seed(0)

    def reward(completions, examples):
        return [{"total": float(i), "format": 0.0, "recall": 0.0} for i in range(len(completions))]

    rollout = sample(policy, tokenizer, records, prompts, cfg, reward)
    copied = rollout.completion_mask - rollout.policy_mask
    assert (copied.sum(1) > 0).all() and (copied >= 0).all()
    seen = []
    real_loss = g.grpo_loss
    monkeypatch.setattr(
        g,
        "grpo_loss",
        lambda logprobs, part, *a: seen.append(part.policy_mask.clone()) or real_loss(logprobs, part, *a),
    )
    experience, updates, result = step_on(
        rollout, policy, tokenizer, torch.optim.SGD(policy.parameters(), lr=0.1), cfg
    )
    assert torch.equal(seen[0], rollout.policy_mask.float()) and len(updates) == 1
    assert all(v == v for v in updates[0])  # finite
    # dapo's N: the policy's tokens, not the copied ones
    assert experience.loss_weights.sum().item() == pytest.approx(1.0)
    assert (experience.loss_weights[copied > 0] == 0).all()
    assert result.copied_length == pytest.approx(copied.sum(1).float().mean().item())


def test_the_colon_of_a_tag_ends_a_step_and_the_program_copies_in_the_next(tiny, monkeypatch):
    """A step that copies nothing writes one token a row, so the step that writes the colon of
    `<HIS>A1:` ends there, and the next step feeds the whole turn: one forward of 1 + n positions
    (the colon, then the n tokens the program appends), every other step one position."""
    model, tokenizer = tiny
    record = hand_record(0, 4, ("A1",), pruned_extra=())
    prompt = render_prompt(tokenizer, record)
    trigger = tokenizer("<think>\n<HIS>A1:", add_special_tokens=False).input_ids
    n = len(tail_ids(tokenizer, "A1", record["history"][1]["text"]))
    steps, forward = [], decode.GroupedStep.forward

    def counting(self, tokens, *args):
        steps.append(tokens.shape[1])
        return forward(self, tokens, *args)

    monkeypatch.setattr(decode.GroupedStep, "forward", counting)
    scripted(monkeypatch, trigger)
    out = generation.generate(
        model, tokenizer, [prompt], max_new_tokens=len(trigger) + n + 3, greedy=True, recall="copy"
    )
    assert out["expanded"] == [["A1"]] and out["copied_tokens"] == [n]
    # the prefill draws the trigger's first token, a step each of the others, the colon's the last
    assert steps[: len(trigger)] == [1] * (len(trigger) - 1) + [1 + n]
    assert steps[len(trigger) :] and set(steps[len(trigger) :]) == {1}
