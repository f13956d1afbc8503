"""Generation, and the log-probabilities of what was generated.

- sampling: the one batched `generate` every caller uses (GRPO rollouts, evaluation, CueMem, SFT's
  check): srt/decode.py's loop, or Hugging Face `generate` as the reference (engine="hf"), with
  every sampling setting explicit, so samples come from exactly softmax(logits / T); which generated
  tokens belong to a completion (`completion_mask`, up to the first stop token);
- scoring a sample: GRPO's log pi(o_t | q, o_<t) of a sampled completion under the distribution it
  was drawn from (`completion_logprobs`: Eq. (9)'s pi_old, pi_theta and pi_ref). It sits beside the
  sampler because the two must agree on the temperature and the suppressed tokens, and a GRPO step
  enters both (tests/test_grpo_loss_family.py counts the files a step walks through). The log-prob
  of a chosen token itself, and of a taught target (SFT), is srt/logprobs.py's.
"""

from __future__ import annotations

import torch

from srt import decode
from srt.logprobs import token_logprobs
from srt.precision import autocast
from srt.recall import RECALL_MODES, CopyRule, prompt_history


# --------------------------------------------------------------------------------------------
# Sampling: the one `generate`, the stop tokens, the completion mask
# --------------------------------------------------------------------------------------------
def stop_token_ids(model, tokenizer) -> list[int]:
    ids = model.generation_config.eos_token_id
    ids = [] if ids is None else ([ids] if isinstance(ids, int) else list(ids))
    return list(dict.fromkeys(ids + ([tokenizer.eos_token_id] if tokenizer.eos_token_id is not None else [])))


def completion_mask(completion_ids, stop_ids) -> torch.Tensor:
    """1 up to and including the first stop token (the model must learn to stop), 0 after it:
    generate pads finished rows, and those pads are no part of o_i. |o_i| = mask.sum(1)."""
    is_stop = torch.isin(completion_ids, torch.tensor(stop_ids, device=completion_ids.device))
    positions = torch.arange(completion_ids.shape[1], device=completion_ids.device)
    first_stop = torch.where(is_stop, positions, completion_ids.shape[1]).min(dim=1).values
    return (positions.unsqueeze(0) <= first_stop.unsqueeze(1)).long()


@torch.no_grad()
def generate(
    model,
    tokenizer,
    prompts,
    max_new_tokens=128,
    num_generations=1,
    temperature=1.0,
    top_p=1.0,
    greedy=False,
    autocast_dtype=None,
    prefill_once=True,
    stop_when=None,
    engine="ours",
    recall="free",
) -> dict:
    """Completions of prompt texts (already chat-templated) -> {prompt_ids, prompt_mask,
    completion_ids, completion_mask, policy_mask, sampler_logprobs, texts, input_tokens,
    generated_tokens}, rows grouped by prompt (prompt j owns rows j*K .. j*K+K-1). Prompts are left
    padded so every completion starts at the same column. policy_mask: 1 where the model drew the
    token (today every completion token; the mask GRPO's loss reads). sampler_logprobs [B * K, C]:
    each token's log-probability under the distribution it was drawn from, in the precision it was
    drawn in (engine "ours"; None for "hf"), 0 on padding.

    engine "ours": srt/decode.py's loop (each prompt prefilled once for its K samples, a static KV
    cache, a CUDA graph on a GPU), on a bf16 copy of the model where autocast_dtype is bf16
    (decode.sampling_model). engine "hf": Hugging Face `generate` under autocast, the reference the
    tests and bench/rollout_speed.py compare against; greedy, both give the same tokens.

    Samples come from exactly softmax(logits / T) cut only by top_p and suppress_tokens, whatever a
    checkpoint's generation_config.json says (Qwen2.5-Instruct ships repetition_penalty 1.05 and
    top_k 20): the "hf" path passes every setting explicitly in a fresh GenerationConfig. The one
    field of the model's generation_config both paths honour is suppress_tokens
    (bench/grpo_vs_trl.py forces equal lengths with it), which GRPO's log-probs also leave out
    (completion_logprobs' `suppress`); GRPO's ratio and KL cannot follow top_p < 1, so stage 2
    refuses it. T = 0 is greedy.

    stop_when(text) -> bool ends a row early once its decoded completion satisfies it (evaluate's
    direct methods stop at their first complete line); the row is then padded like a row that
    emitted a stop token, and generated_tokens counts its tokens up to that point.

    recall "copy" (engine "ours"; srt/recall.py): once a row writes `<HIS>` and a label of its own
    prompt's history with its colon, the decoder appends the rest of that turn and `</HIS>`. The
    result then also holds `expanded` (the labels expanded, per row) and `copied_tokens` (the tokens
    the program wrote, per row; policy_mask is 0 on them); generated_tokens counts every token of a
    completion, decoded_tokens the model's own. "free" is the paper's: the model copies every token."""
    device = next(model.parameters()).device
    tokenizer.padding_side = "left"
    encoded = tokenizer(prompts, return_tensors="pt", padding=True, add_special_tokens=False).to(device)
    prompt_ids = encoded.input_ids.repeat_interleave(num_generations, dim=0)
    prompt_mask = encoded.attention_mask.repeat_interleave(num_generations, dim=0)
    stop_ids = stop_token_ids(model, tokenizer)
    greedy = greedy or temperature == 0
    # Only a forward pass over still-sharded weights (FSDP outside sharding.full_weights) communicates;
    # then, and only then, every rank must run as many decode steps (HF's synced_gpus).
    synced = any(hasattr(p, "to_local") for p in model.parameters())
    stopped_at = {}  # row -> completion length where stop_when ended it
    stopping = row_stopper(tokenizer, stop_when, stopped_at)
    copy_rule = copy_rule_of(recall, engine, tokenizer, prompts, num_generations)
    sampling = dict(
        max_new_tokens=max_new_tokens,
        num_generations=num_generations,
        temperature=temperature,
        top_p=top_p,
        greedy=greedy,
        prefill_once=prefill_once,
    )
    model_side = dict(stop_ids=stop_ids, pad_id=tokenizer.pad_token_id, autocast_dtype=autocast_dtype)
    was_training = model.training
    model.eval()
    if engine == "ours":
        sequences, sampler_logprobs, copied = decode.sample(
            model, encoded, synced=synced, stopping=stopping, copy_rule=copy_rule, **model_side, **sampling
        )
    elif engine == "hf":
        sampler_logprobs, copied = None, None  # HF keeps no scores: the sampler's log-probs are unknown
        sequences = hf_generate(model, encoded, synced=synced, stop_rows=stopping, **model_side, **sampling)
    else:
        raise ValueError(f"generate: unknown engine {engine!r}; use 'ours' or 'hf'")
    model.train(was_training)
    completion = (sequences[:, prompt_ids.shape[1] :], sampler_logprobs, copied)
    return generation_result(tokenizer, prompt_ids, prompt_mask, completion, stop_ids, stopped_at, copy_rule)


def copy_rule_of(recall, engine, tokenizer, prompts, num_generations):
    """The CopyRule of generate's `recall` "copy" (srt/recall.py), None for "free"."""
    if recall not in RECALL_MODES:
        raise ValueError(f"generate: unknown recall mode {recall!r}; use {' or '.join(RECALL_MODES)}")
    if recall != "copy":
        return None
    if engine != "ours":
        raise ValueError("generate: recall='copy' needs engine='ours' (the decoder writes the copies)")
    return CopyRule(tokenizer, [prompt_history(p) for p in prompts], num_generations)


def row_stopper(tokenizer, stop_when, stopped_at):
    """generate's stop_when as the decoders' per-step test: -> stop_rows(generated completions
    [rows, t]) -> True per row that has ended, recording in `stopped_at` where each row ended; None
    without stop_when."""
    if stop_when is None:
        return None

    def stop_rows(generated) -> torch.Tensor:  # after each decode step
        done = []
        for i, text in enumerate(tokenizer.batch_decode(generated, skip_special_tokens=True)):
            if i not in stopped_at and stop_when(text):
                stopped_at[i] = generated.shape[1]
            done.append(i in stopped_at)
        return torch.tensor(done, device=generated.device)

    return stop_rows


def generation_result(
    tokenizer, prompt_ids, prompt_mask, completion, stop_ids, stopped_at, copy_rule
) -> dict:
    """generate's dict (its docstring) from the completions sampled: completion = (completion ids
    [B * K, C], the sampler's log-probs or None, True where the copy rule wrote the token or None)."""
    completion_ids, sampler_logprobs, copied = completion
    mask = completion_mask(completion_ids, stop_ids)
    for i, n in stopped_at.items():  # what follows a row stopped by stop_when is padding
        mask[i, n:] = 0
    lengths = mask.sum(1).tolist()
    texts = tokenizer.batch_decode(
        [row[:n] for row, n in zip(completion_ids, lengths)], skip_special_tokens=True
    )
    policy_mask = mask if copied is None else mask * ~copied
    result = dict(
        prompt_ids=prompt_ids,
        prompt_mask=prompt_mask,
        completion_ids=completion_ids,
        completion_mask=mask,
        policy_mask=policy_mask.clone(),
        sampler_logprobs=None if sampler_logprobs is None else sampler_logprobs * policy_mask,
        texts=texts,
        input_tokens=prompt_mask.sum(1).tolist(),
        generated_tokens=lengths,
        decoded_tokens=policy_mask.sum(1).tolist(),
    )
    if copy_rule is not None:
        result["expanded"] = [copy_rule.expanded.get(row, []) for row in range(len(texts))]
        result["copied_tokens"] = (mask - policy_mask).sum(1).tolist()
    return result


def hf_generate(
    model,
    encoded,
    *,
    num_generations,
    max_new_tokens,
    temperature,
    top_p,
    greedy,
    stop_ids,
    pad_id,
    autocast_dtype,
    prefill_once,
    synced,
    stop_rows,
):
    """The reference path of `generate`: Hugging Face `generate`, every sampling setting explicit.
    -> sequences [B * K, P + C] (prompt + completion) as decode.decode returns them."""
    from transformers import GenerationConfig, StoppingCriteria, StoppingCriteriaList

    device = encoded.input_ids.device
    prompt_ids = encoded.input_ids.repeat_interleave(num_generations, dim=0)
    prompt_mask = encoded.attention_mask.repeat_interleave(num_generations, dim=0)
    config = GenerationConfig(
        max_new_tokens=max_new_tokens,
        eos_token_id=stop_ids,
        pad_token_id=pad_id,
        do_sample=not greedy,
        repetition_penalty=1.0,
        no_repeat_ngram_size=0,
        encoder_repetition_penalty=1.0,
        length_penalty=1.0,
        num_beams=1,
        use_cache=True,
        **({} if greedy else dict(temperature=temperature, top_p=top_p, top_k=0, min_p=None, typical_p=1.0)),
    )
    cache = {}
    if num_generations > 1 and encoded.input_ids.shape[1] > 1 and not synced and prefill_once:
        # Prefill each prompt once and copy its KV cache to its K samples, instead of K identical
        # prefills: generate then runs the last prompt token and the decode steps only.
        with autocast(device, autocast_dtype):
            shared = model(
                input_ids=encoded.input_ids[:, :-1],
                attention_mask=encoded.attention_mask[:, :-1],
                position_ids=(encoded.attention_mask[:, :-1].cumsum(-1) - 1).clamp(min=0),
                use_cache=True,
            ).cache
        shared.batch_repeat_interleave(num_generations)
        cache = {"cache": shared}
    criteria = {}
    if stop_rows is not None:

        class StopWhen(StoppingCriteria):  # called after each decode step
            def __call__(self, input_ids, scores, **kwargs):
                return stop_rows(input_ids[:, prompt_ids.shape[1] :])

        criteria = {"stopping_criteria": StoppingCriteriaList([StopWhen()])}
    with autocast(device, autocast_dtype):
        return model.generate(
            input_ids=prompt_ids,
            attention_mask=prompt_mask,
            generation_config=config,
            synced_gpus=synced,
            **cache,
            **criteria,
        )


# --------------------------------------------------------------------------------------------
# Scoring: log pi(o_t | q, o_<t) of a sampled completion under the distribution it was drawn from
# --------------------------------------------------------------------------------------------
def completion_logprobs(
    model,
    input_ids,
    attention_mask,
    completion_length,
    temperature=1.0,
    with_entropy=False,
    share_prompts=False,
    suppress=None,
    autocast_dtype=None,
):
    """-> (log pi(o_t | q, o_<t) [B, C], entropy [B, C] or None) for the last C = completion_length
    columns of left-padded prompt + right-padded completion rows. Logits are divided by the sampling
    temperature and `suppress`ed tokens left out (token_logprobs), so these are the log-probs of the
    distribution the completions were drawn from, top_p = 1.
    Position ids follow the attention mask, as in generate: RoPE models do not mind the shift left
    padding causes, learned absolute positions do.

    share_prompts: the K rows of a GRPO group repeat one prompt. Run each distinct prompt once, copy
    its KV cache to its rows, and run only the completions on top: the same numbers (up to float
    rounding) for about 1/K of the prompt compute, gradients included (they flow back through the
    copies into the one prompt pass). One module call becomes two, which DDP's and FSDP's backward
    hooks do not allow, and gradient checkpointing turns the cache off: the caller decides.
    The forward runs under autocast_dtype (precision.resolve_dtype), None: none."""
    with autocast(input_ids.device, autocast_dtype):
        logits = completion_logits(model, input_ids, attention_mask, completion_length, share_prompts)
        return token_logprobs(
            logits,
            input_ids[:, -completion_length:],
            temperature,
            with_entropy=with_entropy,
            suppress=suppress,
        )


def completion_logits(model, input_ids, attention_mask, completion_length, share_prompts=False):
    """-> logits [B, C, V] that predict the last C = completion_length tokens of each row: column t's
    logits predict completion token t (see completion_logprobs for share_prompts)."""
    C = completion_length
    prompt_ids, prompt_mask = input_ids[:, :-C], attention_mask[:, :-C]
    distinct, rows_of = None, None
    if share_prompts and prompt_ids.shape[1] > 0:
        distinct, rows_of = torch.unique(torch.cat([prompt_ids, prompt_mask], 1), dim=0, return_inverse=True)
    if distinct is None or len(distinct) == len(input_ids):
        position_ids = (attention_mask.cumsum(-1) - 1).clamp(min=0)
        logits = model(
            input_ids=input_ids,
            attention_mask=attention_mask,
            position_ids=position_ids,
            use_cache=False,
            logits_to_keep=C + 1,
        ).logits
        return logits[:, :-1]  # position t predicts token t + 1
    P = prompt_ids.shape[1]
    shared_ids, shared_mask = distinct[:, :P], distinct[:, P:]
    prompt_out = model(
        input_ids=shared_ids,
        attention_mask=shared_mask,
        use_cache=True,
        logits_to_keep=decode.last_column(P, shared_ids.device),  # an index, not 1: its docstring says why
        position_ids=(shared_mask.cumsum(-1) - 1).clamp(min=0),
    )
    cache = prompt_out.cache
    cache.batch_select_indices(rows_of)  # each row gets its prompt's keys and values
    tail = model(
        input_ids=input_ids[:, -C:],
        attention_mask=attention_mask,
        cache=cache,
        use_cache=True,
        position_ids=(attention_mask.cumsum(-1) - 1).clamp(min=0)[:, -C:],
    ).logits
    # The prompt's last position predicts o_1; completion position t predicts o_{t+1}.
    return torch.cat([prompt_out.logits[rows_of], tail[:, :-1]], dim=1)
