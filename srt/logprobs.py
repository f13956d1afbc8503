"""Log-probabilities of chosen tokens, without full-vocabulary fp32 copies: `token_logprobs` from
logits, and `target_logprobs`, the labelled tokens of a teacher-forced batch (stage 1's Eq. (3)).
The log-probs of sampled completions (Eq. (9)'s pi_old, pi_theta, pi_ref) are
srt/generation.py's completion_logprobs: the temperature and the suppressed tokens must be the
sampler's, so they sit beside it and call token_logprobs.
"""

from __future__ import annotations

import torch

from srt.precision import autocast


def token_logprobs(logits, targets, temperature=1.0, chunk_size=256, with_entropy=False, suppress=None):
    """logits [B, C, V] (any dtype), targets [B, C] -> (log softmax(logits / T)[target] [B, C] fp32,
    entropy [B, C] or None). suppress: token ids the sampler never draws (generation_config's
    suppress_tokens), left out of the softmax as the sampler leaves them out. Computed `chunk_size`
    positions at a time as the chosen token's logit minus a log-sum-exp: the fp32 copy of one chunk is the
    only full-vocabulary temporary. Under autograd each chunk is recomputed in backward (activation
    checkpointing) instead of kept, so memory holds the logits in their own dtype (bf16 on a GPU) and one
    fp32 chunk, where `log_softmax(logits.float())` kept two fp32 copies of all of them (~10 GB each for
    16 rows of 1024 tokens over Qwen2.5's 152k vocabulary). The entropy is a no-grad diagnostic."""

    def tempered(x):
        x = x.float() / temperature
        return x if suppress is None else x.index_fill(-1, suppress.to(x.device), float("-inf"))

    def chosen_minus_lse(x, t):
        x = tempered(x)
        return x.gather(-1, t.unsqueeze(-1)).squeeze(-1) - x.logsumexp(-1)

    logprobs, entropy = [], []
    for x, t in zip(logits.split(chunk_size, dim=1), targets.split(chunk_size, dim=1)):
        if torch.is_grad_enabled() and x.requires_grad:
            from torch.utils.checkpoint import checkpoint

            logprobs.append(checkpoint(chosen_minus_lse, x, t, use_reentrant=False))
        else:
            logprobs.append(chosen_minus_lse(x, t))
        if with_entropy:
            with torch.no_grad():  # H = lse - sum_v p_v z_v, with z = logits / T
                z = tempered(x)
                p = z.softmax(-1)
                entropy.append(z.logsumexp(-1) - (p * z.masked_fill(p == 0, 0.0)).sum(-1))
    return torch.cat(logprobs, dim=1), (torch.cat(entropy, dim=1) if with_entropy else None)


def target_logprobs(model, input_ids, attention_mask, labels, autocast_dtype=None, ignore_index=-100):
    """log pi(y_k | x, y_<k) of the labelled tokens of each row (labels [B, W], `ignore_index` on the
    others) -> (logprobs [B, W - start], start): column j is the token at column start + j, anything
    where unlabelled. Token k's logits predict token k + 1, so the vocabulary projection (a fifth of
    SmolLM2's compute) runs only from the earliest label on (logits_to_keep), and the log-softmax in
    chunks (token_logprobs), without an fp32 copy of every logit."""
    width = labels.size(1)
    first_target = labels.ne(ignore_index).float().argmax(dim=1).min().item()
    keep = width - max(first_target, 1) + 1
    with autocast(input_ids.device, autocast_dtype):
        logits = model(input_ids=input_ids, attention_mask=attention_mask, logits_to_keep=keep).logits
    start = width - keep + 1
    return token_logprobs(logits[:, :-1], labels[:, start:].clamp(min=0))[0], start
