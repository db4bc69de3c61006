"""The GRPO task: continue a chain of the synthetic task along its most likely successors.

The tiny model is pre-trained on `MarkovTask` sequences, where every token is followed by its
first-listed successor with probability 0.7 (then 0.2 / 0.07 / 0.03). Sampled at temperature 1 it
therefore continues a prompt "greedily" only part of the time: the task is one it half knows.

A prompt is a chain sampled from the task (`prompt_len` tokens); the answer is the next
`response_len` tokens. Reward 1 when every answer token is the most likely successor of the token
before it (the chain's rule, checked against the task's table: a verifiable reward like an exact
match on GSM8K), else 0. The pre-trained model starts near 0.7 ** response_len, and a policy that
sharpens its next-token distributions towards the chain's top successor climbs towards 1.
"""
from __future__ import annotations

import dataclasses
from typing import Dict

import torch

from npu_flashrl.sim.synthetic_task import MarkovTask


@dataclasses.dataclass(frozen=True)
class GreedyChainTask:
    markov: MarkovTask
    prompt_len: int
    response_len: int

    def __post_init__(self):
        if self.prompt_len < 1 or self.response_len < 1:
            raise ValueError(f"prompt_len and response_len must be >= 1, got {self.prompt_len}, "
                             f"{self.response_len}")

    def prompts(self, count: int, generator: torch.Generator) -> torch.Tensor:
        """[count, prompt_len] token ids: chains of the synthetic task."""
        return self.markov.sample(count, self.prompt_len, generator)

    def token_correct(self, prompts: torch.Tensor, responses: torch.Tensor) -> torch.Tensor:
        """[B, response_len] bool: response token t is the most likely successor of the token before
        it (the prompt's last token for t = 0). `prompts` has one row per response."""
        m = self.markov
        top = m.successors[:, 0] + m.base  # content token offset -> id of its most likely successor
        prev = torch.cat([prompts[:, -1:], responses[:, :-1]], dim=1).cpu()
        offset = prev - m.base
        content = (offset >= 0) & (offset < m.n_tokens)
        expected = torch.where(content, top[offset.clamp(0, m.n_tokens - 1)], torch.full_like(prev, -1))
        return content & (responses.cpu() == expected)

    def answers(self, prompts: torch.Tensor) -> torch.Tensor:
        """[B, response_len] the exact answers: the chain of most likely successors after each prompt."""
        m = self.markov
        top = m.successors[:, 0] + m.base
        prev, out = prompts[:, -1].cpu(), []
        for _ in range(self.response_len):
            offset = prev - m.base
            if ((offset < 0) | (offset >= m.n_tokens)).any():
                raise ValueError("GreedyChainTask.answers: a prompt ends in a special token (no successor)")
            prev = top[offset]
            out.append(prev)
        return torch.stack(out, dim=1)

    def reward(self, prompts: torch.Tensor, responses: torch.Tensor) -> torch.Tensor:
        """[B] float32: 1.0 when the whole response follows the chain's most likely successors."""
        return self.token_correct(prompts, responses).all(dim=1).float()

    def to_dict(self) -> Dict[str, object]:
        return {"name": "greedy_chain", "prompt_len": self.prompt_len, "response_len": self.response_len,
                "reward": "1 if every response token is the most likely successor of the token before it "
                          "(the chain's first branch), else 0", "chain": self.markov.to_dict()}
