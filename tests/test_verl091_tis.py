"""TIS on verl 0.7+ (0.9.1): which `algorithm.rollout_correction` combination really multiplies
the truncated IS weights into the policy loss, with verl's own driver and loss code.

verl's functions run as the trainer calls them: `compute_rollout_correction_and_add_to_batch`
(driver, decoupled mode), `apply_bypass_mode` (driver, bypass mode) and the registered policy
losses (`get_policy_loss_fn`, which the workers' `ppo_loss` calls). No stand-ins: the tensors are
small CPU tensors in place of a rollout batch.
"""
import pytest
import torch

from npu_flashrl import compat

pytestmark = [
    pytest.mark.every_line,
    pytest.mark.skipif(not compat.verl_server_mode(),
                       reason="needs verl 0.7.1+ (rollout_correction with loss_type), e.g. 0.9.1"),
]

B, T, THRESHOLD = 4, 6, 2.0


@pytest.fixture()
def batch():
    torch.manual_seed(0)
    old = -torch.rand(B, T)
    rollout = old + 0.8 * torch.randn(B, T)  # an INT8 rollout disagreeing with the trainer
    current = old + 0.05 * torch.randn(B, T)
    mask = torch.ones(B, T)
    mask[0, -2:] = 0
    return dict(old=old, rollout=rollout, current=current, mask=mask, adv=torch.randn(B, T))


def _actor_config(loss_mode="vanilla", **rollout_correction):
    from verl.trainer.config.algorithm import RolloutCorrectionConfig
    from verl.workers.config import FSDPActorConfig
    from verl.workers.config.actor import PolicyLossConfig

    policy_loss = PolicyLossConfig(loss_mode=loss_mode,
                                   rollout_correction=RolloutCorrectionConfig(**rollout_correction))
    return FSDPActorConfig(strategy="fsdp", ppo_mini_batch_size=4, ppo_micro_batch_size_per_gpu=1,
                           use_dynamic_bsz=False, rollout_n=1, policy_loss=policy_loss)


def _ppo_clip_per_token(cfg, old, current, adv):
    """PPO-clip with dual clip, per token (verl's vanilla loss before weighting/aggregation)."""
    ratio = torch.exp(current - old)
    low = cfg.clip_ratio_low if cfg.clip_ratio_low is not None else cfg.clip_ratio
    high = cfg.clip_ratio_high if cfg.clip_ratio_high is not None else cfg.clip_ratio
    pg = torch.maximum(-adv * ratio, -adv * torch.clamp(ratio, 1 - low, 1 + high))
    return torch.where(adv < 0, torch.minimum(pg, -adv * cfg.clip_ratio_c), pg)


def _masked_mean(x, mask):
    return (x * mask).sum() / mask.sum()


def test_decoupled_mode_multiplies_truncated_is_weights_into_the_loss(batch):
    from verl import DataProto
    from verl.trainer.config.algorithm import RolloutCorrectionConfig
    from verl.trainer.ppo.core_algos import get_policy_loss_fn
    from verl.trainer.ppo.rollout_corr_helper import compute_rollout_correction_and_add_to_batch

    data = DataProto.from_dict(tensors={"old_log_probs": batch["old"],
                                        "rollout_log_probs": batch["rollout"],
                                        "response_mask": batch["mask"]})
    rc = RolloutCorrectionConfig(rollout_is="token", rollout_is_threshold=THRESHOLD, bypass_mode=False)
    data, _ = compute_rollout_correction_and_add_to_batch(data, rc)
    w = data.batch["rollout_is_weights"]
    want_w = torch.clamp(torch.exp(batch["old"] - batch["rollout"]), max=THRESHOLD) * batch["mask"]
    torch.testing.assert_close(w, want_w)
    assert (w[batch["mask"].bool()] < 1).any() and (w == THRESHOLD).any()  # both sides exercised

    cfg = _actor_config()
    assert cfg.policy_loss.loss_mode == "vanilla"
    loss_fn = get_policy_loss_fn(cfg.policy_loss.loss_mode)
    args = dict(old_log_prob=batch["old"], log_prob=batch["current"], advantages=batch["adv"],
                response_mask=batch["mask"].bool(), loss_agg_mode="token-mean", config=cfg)
    weighted, _ = loss_fn(rollout_is_weights=w, **args)
    plain, _ = loss_fn(rollout_is_weights=None, **args)
    pg = _ppo_clip_per_token(cfg, batch["old"], batch["current"], batch["adv"])
    torch.testing.assert_close(weighted, _masked_mean(pg * w, batch["mask"]))
    torch.testing.assert_close(plain, _masked_mean(pg, batch["mask"]))
    assert not torch.isclose(weighted, plain)


@pytest.mark.parametrize("loss_type", ["reinforce", "ppo_clip"])
def test_bypass_mode_loss_types(batch, loss_type):
    """Bypass mode (old_log_probs := rollout_log_probs): verl's bypass loss multiplies IS weights
    in only for loss_type=reinforce; ppo_clip computes them for metrics and leaves them out."""
    from omegaconf import OmegaConf

    from verl import DataProto
    from verl.trainer.config.algorithm import RolloutCorrectionConfig
    from verl.trainer.ppo.core_algos import get_policy_loss_fn
    from verl.trainer.ppo.rollout_corr_helper import apply_bypass_mode

    data = DataProto.from_dict(tensors={"old_log_probs": batch["old"],
                                        "rollout_log_probs": batch["rollout"],
                                        "response_mask": batch["mask"]})
    rc = RolloutCorrectionConfig(rollout_is="token", rollout_is_threshold=THRESHOLD, bypass_mode=True,
                                 loss_type=loss_type)
    driver_policy_loss = OmegaConf.create({"loss_mode": "vanilla"})
    apply_bypass_mode(batch=data, rollout_corr_config=rc, policy_loss_config=driver_policy_loss)
    assert torch.equal(data.batch["old_log_probs"], batch["rollout"])
    assert driver_policy_loss.loss_mode == "bypass_mode"  # the DRIVER's copy (see docs)

    # what a worker's own actor config would need to say for this loss to run there
    cfg = _actor_config("bypass_mode", rollout_is="token", rollout_is_threshold=THRESHOLD,
                        bypass_mode=True, loss_type=loss_type)
    loss, _ = get_policy_loss_fn("bypass_mode")(
        old_log_prob=data.batch["old_log_probs"], log_prob=batch["current"],
        advantages=batch["adv"], response_mask=batch["mask"].bool(), loss_agg_mode="token-mean",
        config=cfg)
    mask = batch["mask"]
    w = torch.clamp(torch.exp(batch["current"] - batch["rollout"]), max=THRESHOLD)
    if loss_type == "reinforce":
        want = _masked_mean(-batch["adv"] * w.detach() * batch["current"], mask)
    else:
        want = _masked_mean(_ppo_clip_per_token(cfg, batch["rollout"], batch["current"],
                                                batch["adv"]), mask)
    torch.testing.assert_close(loss, want)
