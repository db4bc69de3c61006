"""Rollout: autoregressive sampling from the vLLM rollout model (temperature 1, no KV cache).

The rollout model is the one the rehearsal builds through the real vLLM + vllm-ascend code (bf16,
or vllm-ascend W8A8_DYNAMIC layers reloaded by npu_flashrl). Each new token: the whole batch of
sequences goes through the model's own layers (`model.model(input_ids, positions)`), its logits come
from vLLM's `compute_logits` at the last position, and the token is drawn from softmax(logits) with a
private generator. The rollout log-prob recorded for it is log_softmax(logits)[token] in fp32, the
value vLLM's sampler returns for the sampled token at temperature 1 (`SamplingParams(logprobs=0)`).

`logit_scale` (the positive control's settings, `positive.SETTINGS`): the rollout samples from its
logits x the scale, i.e. at temperature 1 / scale while the trainer computes at temperature 1, and
records the log-probs of the distribution it sampled from (verl's rollout default
`logprobs_mode: processed_logprobs`, vLLM's log-probs after temperature): a rollout / trainer mismatch
of known size, standing in for one a quantized rollout would bring.

Stand-in (harness): vLLM's attention backend is replaced by plain causal attention on the CPU
(`cpu_vllm.use_plain_attention`, one sequence per forward); `batched_attention` lets one forward
carry a batch of equally long sequences (flattened as vLLM flattens a batch), each attending only
to its own earlier tokens, as vLLM's attention metadata would make the real backend do.
"""
from __future__ import annotations

import contextlib
from typing import Tuple

import torch

_BATCH = {"size": None}


def _batched_attention_forward(self, query, key, value, *args, **kwargs):
    """Causal attention per sequence of a flattened batch of `_BATCH['size']` equal-length sequences."""
    b = _BATCH["size"]
    n = query.shape[0]
    t = n // b
    q = query.view(b, t, self.num_heads, self.head_size).transpose(1, 2)
    k = key.view(b, t, self.num_kv_heads, self.head_size).transpose(1, 2)
    v = value.view(b, t, self.num_kv_heads, self.head_size).transpose(1, 2)
    rep = self.num_heads // self.num_kv_heads
    if rep > 1:
        k = k.repeat_interleave(rep, dim=1)
        v = v.repeat_interleave(rep, dim=1)
    scale = self.impl.scale if hasattr(self, "impl") and hasattr(self.impl, "scale") else None
    o = torch.nn.functional.scaled_dot_product_attention(q.float(), k.float(), v.float(), is_causal=True,
                                                         scale=scale)
    return o.transpose(1, 2).reshape(n, self.num_heads * self.head_size).to(query.dtype)


@contextlib.contextmanager
def batched_attention(batch: int):
    """Within: vLLM's Attention layers treat their flattened input as `batch` sequences of equal length."""
    from npu_flashrl.sim import ascend_harness

    attention = ascend_harness.vllm_attention_class()
    saved = attention.forward
    attention.forward = _batched_attention_forward
    _BATCH["size"] = batch
    try:
        yield
    finally:
        attention.forward = saved
        _BATCH["size"] = None


def forward_last_logits(model, ids: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """[B, vocab] fp32 logits of the vLLM model at the last position of each row of `ids` [B, T]."""
    from npu_flashrl.sim import ascend_harness

    b, t = ids.shape
    flat = ids.reshape(-1)
    positions = torch.arange(t, device=ids.device).repeat(b)
    with batched_attention(b):
        hidden = model.model(flat, positions, None)  # Llama: intermediate_tensors has no default
    last = hidden.view(b, t, -1)[:, -1]
    return ascend_harness.compute_logits(model, last).float()[:, :vocab_size]


def sample(model, prompts: torch.Tensor, n: int, response_len: int, generator: torch.Generator,
           vocab_size: int, device: str, logit_scale: float = 1.0) -> Tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """`n` responses per prompt (a GRPO group; rows of one group adjacent).

    Returns (prompt rows [P*n, Tp], responses [P*n, L], rollout log-probs [P*n, L] fp32), on the CPU."""
    rows = prompts.repeat_interleave(n, dim=0)
    ids = rows.to(device)
    tokens, logps = [], []
    with torch.no_grad():
        for _ in range(response_len):
            logp = torch.log_softmax(_scaled(forward_last_logits(model, ids, vocab_size), logit_scale), dim=-1).cpu()
            tok = torch.multinomial(logp.exp(), 1, generator=generator)
            tokens.append(tok)
            logps.append(logp.gather(1, tok))
            ids = torch.cat([ids, tok.to(device)], dim=1)
    return rows, torch.cat(tokens, dim=1), torch.cat(logps, dim=1)



def _scaled(logits: torch.Tensor, logit_scale: float) -> torch.Tensor:
    return logits if logit_scale == 1.0 else logits * logit_scale


def replay(model, rows: torch.Tensor, responses: torch.Tensor, vocab_size: int, device: str,
           logit_scale: float = 1.0) -> torch.Tensor:
    """The rollout model's log-probs [B, L] (fp32) of given responses, computed as `sample` computes
    them (one forward per position), without sampling: what the rollout log-probs of these rows must
    be if they are the rollout model's own."""
    ids = torch.cat([rows, responses], dim=1).to(device)
    tp = rows.shape[1]
    out = []
    with torch.no_grad():
        for t in range(responses.shape[1]):
            logp = torch.log_softmax(_scaled(forward_last_logits(model, ids[:, :tp + t], vocab_size), logit_scale),
                                     dim=-1).cpu()
            out.append(logp.gather(1, responses[:, t:t + 1].cpu()))
    return torch.cat(out, dim=1)
