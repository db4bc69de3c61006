"""verl's own GRPO algorithm code, called (never copied), on the installed verl line.

* advantages: `verl.trainer.ppo.core_algos.compute_grpo_outcome_advantage` (outcome reward at the
  last response token, groups by prompt index, normalised by the group's std, as GRPO does);
* rollout correction: `verl.trainer.ppo.rollout_corr_helper.compute_rollout_correction_and_add_to_batch`
  on a `DataProto` with `old_log_probs` (trainer), `rollout_log_probs` (rollout model) and
  `response_mask`, with the `algorithm.rollout_correction` config verl's own trainer config has after
  the overrides npu_flashrl writes for decoupled-mode TIS (`adapters.verl.tis_overrides()`: token
  level, threshold 2.0, the recipes' settings) or with TIS off (`rollout_is=null`: verl then adds no
  weights and only reports its metrics);
* policy loss: `core_algos.get_policy_loss_fn("vanilla")` (PPO clip, dual clip) with the batch's
  `rollout_is_weights`, which multiplies them in and aggregates with verl's `agg_loss`
  (`token-mean`), on verl's own actor config dataclass (`FSDPActorConfig`, `PolicyLossConfig`).

Every function is looked up on verl's module at call time, so a test can spy on it there.

Lines: the verl of every stack line has these functions with the same names and arguments (the
sync-mode verl lines call `agg_loss` without the server-mode lines' global batch info, which the
same actor config carries); the rollout-correction keys differ per verl line and come from
`tis_overrides()` for the installed verl. verl's generated trainer config is read from the installed verl.
"""
from __future__ import annotations

import functools
import os
from typing import Any, Dict, Optional, Tuple

import torch

TIS_LEVEL = "token"
TIS_THRESHOLD = 2.0
LOSS_AGG_MODE = "token-mean"
RC_PREFIX = "algorithm.rollout_correction."


@functools.lru_cache(maxsize=None)
def _verl_trainer_config():
    from omegaconf import OmegaConf

    import verl

    return OmegaConf.load(os.path.join(os.path.dirname(verl.__file__), "trainer", "config",
                                       "_generated_ppo_trainer.yaml"))


def rollout_correction_config(tis: bool):
    """verl's own `algorithm.rollout_correction` (its generated trainer config) with npu_flashrl's
    TIS overrides merged in (TIS off: `rollout_is=null`)."""
    from omegaconf import OmegaConf

    from npu_flashrl.adapters.verl import tis_overrides

    base = _verl_trainer_config()
    overrides = [o for o in tis_overrides(TIS_LEVEL if tis else None, TIS_THRESHOLD, calculate_log_probs=False)
                 if o.startswith(RC_PREFIX)]
    merged = OmegaConf.merge(base, OmegaConf.from_dotlist(overrides))
    return merged.algorithm.rollout_correction, overrides


def actor_config(mini_batch_size: int, group_size: int):
    """verl's actor config dataclass as its FSDP workers hold it (defaults: clip_ratio 0.2, dual clip 3.0)."""
    from verl.workers.config import FSDPActorConfig
    from verl.workers.config.actor import PolicyLossConfig

    return FSDPActorConfig(strategy="fsdp", ppo_mini_batch_size=mini_batch_size, ppo_micro_batch_size_per_gpu=1,
                           use_dynamic_bsz=False, rollout_n=group_size, loss_agg_mode=LOSS_AGG_MODE,
                           policy_loss=PolicyLossConfig(loss_mode="vanilla"))


class VerlGrpo:
    """The three algorithm calls of one GRPO step, for one variant (TIS on or off)."""

    def __init__(self, tis: bool, mini_batch_size: int, group_size: int):
        from verl.trainer.ppo import core_algos, rollout_corr_helper

        self.core_algos, self.rollout_corr_helper = core_algos, rollout_corr_helper
        self.tis = tis
        self.rc_config, self.overrides = rollout_correction_config(tis)
        self.actor_config = actor_config(mini_batch_size, group_size)
        self.loss_mode = self.actor_config.policy_loss.loss_mode

    def advantages(self, rewards: torch.Tensor, response_mask: torch.Tensor, group_index) -> torch.Tensor:
        """GRPO advantages [B, L]: the outcome reward placed on the last response token."""
        import numpy as np

        token_level = torch.zeros_like(response_mask, dtype=torch.float32)
        last = response_mask.long().cumsum(-1).argmax(-1)
        token_level[torch.arange(len(rewards)), last] = rewards.float()
        adv, _ = self.core_algos.compute_grpo_outcome_advantage(
            token_level_rewards=token_level, response_mask=response_mask, index=np.asarray(group_index))
        return adv

    def rollout_correction(self, old_log_prob: torch.Tensor, rollout_log_prob: torch.Tensor,
                           response_mask: torch.Tensor) -> Tuple[Optional[torch.Tensor], torch.Tensor,
                                                                  Dict[str, float]]:
        """(rollout_is_weights or None, response_mask after verl's rejection sampling, verl's metrics)."""
        from verl.protocol import DataProto

        batch = DataProto.from_dict(tensors={"old_log_probs": old_log_prob, "rollout_log_probs": rollout_log_prob,
                                             "response_mask": response_mask.clone()})
        batch, metrics = self.rollout_corr_helper.compute_rollout_correction_and_add_to_batch(batch, self.rc_config)
        weights = batch.batch["rollout_is_weights"] if "rollout_is_weights" in batch.batch.keys() else None
        return weights, batch.batch["response_mask"], {k: _scalar(v) for k, v in metrics.items()}

    def policy_loss(self, old_log_prob, log_prob, advantages, response_mask, rollout_is_weights
                    ) -> Tuple[torch.Tensor, Dict[str, Any]]:
        loss_fn = self.core_algos.get_policy_loss_fn(self.loss_mode)
        return loss_fn(old_log_prob=old_log_prob, log_prob=log_prob, advantages=advantages,
                       response_mask=response_mask, loss_agg_mode=LOSS_AGG_MODE, config=self.actor_config,
                       rollout_is_weights=rollout_is_weights)

    def info(self) -> Dict[str, Any]:
        import verl

        return {"verl": getattr(verl, "__version__", None), "tis": self.tis, "rollout_correction_overrides":
                self.overrides, "policy_loss": self.loss_mode, "loss_agg_mode": LOSS_AGG_MODE,
                "clip_ratio": self.actor_config.clip_ratio,
                "functions": ["verl.trainer.ppo.core_algos.compute_grpo_outcome_advantage",
                              "verl.trainer.ppo.rollout_corr_helper.compute_rollout_correction_and_add_to_batch",
                              f"verl.trainer.ppo.core_algos.get_policy_loss_fn({self.loss_mode!r}) "
                              "(-> core_algos.agg_loss)"]}


def _scalar(v):
    if isinstance(v, torch.Tensor):
        return float(v.item())
    return float(v) if isinstance(v, (int, float)) else v
