"""The held-out score: each trained policy (the trainer's weights after its last step) on prompts it
never trained on, apart from the rollout's own reward.

The score of a policy is its probability of the exact answer, averaged over the held-out prompts:
mean_p prod_t pi(answer_t | prompt_p, answer_<t), the expected reward of sampling at temperature 1,
computed exactly (one teacher-forced forward of each prompt + answer) instead of estimated from
samples, so it carries no sampling noise. The prompts come from their own random stream; any that
occurs among the training prompts of the run (every seed, every step) is dropped and redrawn. The
chain is first order (an answer depends on the prompt's last token), so "never trained on" holds for
the prompts, not for every transition within them.
"""
from __future__ import annotations

from typing import Any, Dict, Set, Tuple

import torch

from npu_flashrl.rehearsal.common import RehearsalError
from npu_flashrl.rehearsal.grpo.loop import prompt_generator

HELDOUT_STREAM = 99_991


def training_prompts(task, s, base_seed: int, seeds: int, steps: int) -> Set[Tuple[int, ...]]:
    seen: Set[Tuple[int, ...]] = set()
    for seed in range(seeds):
        for step in range(1, steps + 1):
            seen.update(tuple(r) for r in task.prompts(s.prompts, prompt_generator(base_seed, seed, step)).tolist())
    return seen


def heldout_prompts(task, s, base_seed: int) -> Tuple[torch.Tensor, Dict[str, Any]]:
    """[heldout_prompts, prompt_len] prompts none of the runs trains on, and how they were drawn."""
    seen = training_prompts(task, s, base_seed, s.seeds, s.steps)
    g = torch.Generator().manual_seed(HELDOUT_STREAM * (base_seed + 1))
    kept, dropped, draws = [], 0, 0
    while len(kept) < s.heldout_prompts:
        draws += 1
        if draws > 100:
            raise RehearsalError(f"held-out prompts: fewer than {s.heldout_prompts} prompts of the task are unseen "
                               f"by training ({len(seen)} training prompts)")
        for row in task.prompts(s.heldout_prompts, g).tolist():
            if tuple(row) in seen or tuple(row) in {tuple(k) for k in kept}:
                dropped += 1
            elif len(kept) < s.heldout_prompts:
                kept.append(row)
    return torch.tensor(kept), {"prompts": len(kept), "dropped_as_seen_or_repeated": dropped,
                                "training_prompts": len(seen), "score": "mean over the held-out prompts of the "
                                "trained policy's probability of the exact answer (expected reward, exact)"}


def score(trainer, task, prompts: torch.Tensor, fp32_head: bool) -> float:
    """The trainer's current policy: mean probability of the exact answer over `prompts`."""
    answers = task.answers(prompts)
    ids = torch.cat([prompts, answers], dim=1)
    logp = trainer.logp(ids, prompts.shape[1], fp32_head, grad=False)
    return float(logp.double().sum(dim=1).exp().mean())
