"""A synthetic language-modelling task small enough to train a tiny LM on a CPU in seconds.

Why: a random-init tiny Qwen2 has near-uniform next-token distributions (logits ~0), so an INT8
rollout looks harmless against it (token_mult_prob_error ~1.0016). After a few seconds of training
on this task the model's distributions are peaked like a real LM's: most positions put 0.7 on one
token, some have a few plausible alternatives, and the logits of the ~250 unused vocabulary entries
are pushed far down. INT8 rounding then moves log-probs the way it does on real models.

The task: a fixed random Markov chain over `n_tokens` content tokens (ids `base .. base+n_tokens-1`):
every token has `len(branch_probs)` successors drawn once from the seed, taken with probabilities
`branch_probs` (default 0.7 / 0.2 / 0.07 / 0.03, entropy 0.86 nats per token). A sequence starts at a
uniformly drawn token. Everything is deterministic given the seed (a private torch.Generator).
"""
from __future__ import annotations

import dataclasses
import math
import time
from typing import Callable, Dict, Iterator, List, Optional, Sequence

import torch


@dataclasses.dataclass(frozen=True)
class MarkovTask:
    n_tokens: int = 256
    base: int = 3                      # ids 0..2 stay special (<unk>, <pad>, <eos> of the tiny tokenizer)
    branch_probs: Sequence[float] = (0.7, 0.2, 0.07, 0.03)
    seed: int = 1234

    def __post_init__(self):
        if self.n_tokens < len(self.branch_probs):
            raise ValueError(f"n_tokens={self.n_tokens} must be >= the number of branches "
                             f"({len(self.branch_probs)})")
        if abs(sum(self.branch_probs) - 1.0) > 1e-6 or min(self.branch_probs) <= 0:
            raise ValueError(f"branch_probs must be positive and sum to 1, got {self.branch_probs}")
        g = torch.Generator().manual_seed(self.seed)
        succ = torch.stack([torch.randperm(self.n_tokens, generator=g)[: len(self.branch_probs)]
                            for _ in range(self.n_tokens)])
        object.__setattr__(self, "_succ", succ)
        object.__setattr__(self, "_probs", torch.tensor(list(self.branch_probs), dtype=torch.float64))

    @property
    def successors(self) -> torch.Tensor:
        """[n_tokens, branches] int64: row i lists the successors of content token i (offsets from
        `base`) in the order of `branch_probs` (column 0 = the most likely one)."""
        return self._succ.clone()

    @property
    def min_vocab_size(self) -> int:
        return self.base + self.n_tokens

    @property
    def entropy(self) -> float:
        """Per-token entropy (nats) of the chain after the first token: the best achievable loss."""
        p = self._probs
        return float(-(p * p.log()).sum())

    def to_dict(self) -> Dict[str, object]:
        return {"name": "markov", "n_tokens": self.n_tokens, "base": self.base,
                "branch_probs": [float(p) for p in self.branch_probs], "seed": self.seed}

    def sample(self, batch: int, length: int, generator: torch.Generator) -> torch.Tensor:
        """[batch, length] int64 token ids."""
        x = torch.empty(batch, length, dtype=torch.long)
        x[:, 0] = torch.randint(0, self.n_tokens, (batch,), generator=generator)
        probs = self._probs.expand(batch, -1)
        for t in range(1, length):
            branch = torch.multinomial(probs, 1, generator=generator).squeeze(1)
            x[:, t] = self._succ[x[:, t - 1], branch]
        return x + self.base

    def batches(self, batch: int, length: int, seed: int) -> Iterator[torch.Tensor]:
        g = torch.Generator().manual_seed(seed)
        while True:
            yield self.sample(batch, length, g)


def lm_loss(model: torch.nn.Module, ids: torch.Tensor) -> torch.Tensor:
    """Mean next-token cross entropy of a HF causal LM on `ids` (fp32 logits)."""
    logits = model(input_ids=ids).logits[:, :-1].float()
    return torch.nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]),
                                             ids[:, 1:].reshape(-1))


def train(model: torch.nn.Module, task: MarkovTask, iters: int, lr: float = 1e-2, batch: int = 16,
          length: int = 32, seed: int = 0, warmup: int = 10, min_lr_ratio: float = 0.1,
          callback: Optional[Callable[[int, float], None]] = None) -> Dict[str, float]:
    """Pre-train `model` (fp32 params) with plain torch AdamW, linear warm-up then cosine decay.

    Returns {"iters", "final_loss" (mean of the last 10 iterations), "entropy", "seconds"}.
    """
    device = next(model.parameters()).device
    opt = torch.optim.AdamW(model.parameters(), lr=lr, betas=(0.9, 0.98), weight_decay=0.0)

    def lr_at(i: int) -> float:
        if i < warmup:
            return lr * (i + 1) / warmup
        progress = (i - warmup) / max(1, iters - warmup)
        return lr * (min_lr_ratio + (1 - min_lr_ratio) * 0.5 * (1 + math.cos(math.pi * progress)))

    model.train()
    t0 = time.perf_counter()
    losses: List[float] = []
    data = task.batches(batch, length, seed)
    for i in range(iters):
        for group in opt.param_groups:
            group["lr"] = lr_at(i)
        loss = lm_loss(model, next(data).to(device))
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        opt.zero_grad(set_to_none=True)
        losses.append(float(loss.detach()))
        if callback is not None:
            callback(i, losses[-1])
    model.eval()
    tail = losses[-10:] or [float("nan")]
    return {"iters": iters, "final_loss": sum(tail) / len(tail), "entropy": task.entropy,
            "seconds": time.perf_counter() - t0}
