"""A tiny random causal language model for the one-step training checks, in plain torch (building a
transformers model would cost the grader seconds of imports): each position sees the mean of the
embeddings up to it, one residual layer, a projection to 32 token ids. It takes what the project's
callers pass a Hugging Face model (input_ids, attention_mask, logits_to_keep) and returns .logits."""

from types import SimpleNamespace

import torch
from torch import nn

VOCAB = 32


class TinyCausalLM(nn.Module):
    def __init__(self, width: int = 16):
        super().__init__()
        self.embed = nn.Embedding(VOCAB, width)
        self.mix = nn.Linear(width, width)
        self.out = nn.Linear(width, VOCAB)

    def forward(self, input_ids, attention_mask=None, logits_to_keep=0):
        h = self.embed(input_ids)
        positions = torch.arange(1, input_ids.shape[1] + 1, device=h.device).view(1, -1, 1)
        h = h.cumsum(dim=1) / positions  # causal: position k reads tokens 0..k only
        h = h + torch.tanh(self.mix(h))
        logits = self.out(h)
        return SimpleNamespace(logits=logits[:, -logits_to_keep:] if logits_to_keep else logits)


def tiny_model(seed: int = 0) -> TinyCausalLM:
    torch.manual_seed(seed)
    return TinyCausalLM()


def completion_logprobs(model, input_ids, prompt_length: int) -> torch.Tensor:
    """log pi(token) of every token after the prompt, [B, C], by a plain forward and log-softmax."""
    logits = model(input_ids=input_ids).logits
    logprobs = torch.log_softmax(logits[:, prompt_length - 1 : -1].float(), dim=-1)
    return logprobs.gather(-1, input_ids[:, prompt_length:, None]).squeeze(-1)
