"""TIS on verl 0.7.1 .. 0.9.x (read from verl 0.9.1): which ``algorithm.rollout_correction``
combination multiplies the truncated IS weights into the policy loss, and the overrides for it.

Read from verl 0.9.1: ``trainer/config/algorithm/rollout_correction.yaml`` and
``trainer/config/algorithm.py`` (``RolloutCorrectionConfig``: the keys below; 0.7 replaced
``use_policy_gradient`` with ``loss_type`` and dropped ``rollout_rs_threshold_lower`` /
``rollout_token_veto_threshold``), ``trainer/ppo/ray_trainer.py`` (``fit``: bypass mode calls
``apply_bypass_mode`` and skips ``compute_rollout_correction_and_add_to_batch``),
``trainer/ppo/rollout_corr_helper.py``, ``trainer/ppo/core_algos.py`` (every registered policy
loss but ``bypass_mode`` multiplies ``rollout_is_weights`` in; ``bypass_mode`` ignores them and
dispatches on ``loss_type``) and ``workers/engine_workers.py`` / ``workers/utils/losses.py`` (the
workers' ``ppo_loss`` uses the actor config built at init: ``partial(ppo_loss, config=actor_config)``).

* Decoupled mode (``bypass_mode=False``, ``rollout_is=token|sequence``): the driver puts
  ``rollout_is_weights = min(exp(old - rollout), threshold)`` into the batch and the workers'
  policy loss multiplies them in. This is what :func:`overrides` writes.
* Bypass mode with ``loss_type=ppo_clip`` (verl's default): the weights are computed for metrics
  only (``compute_policy_loss_bypass_mode`` hands ``rollout_is_weights=None`` to PPO-clip), so the
  TIS level and threshold do nothing.
* Bypass mode with ``loss_type=reinforce``: verl's bypass loss multiplies the weights in, but
  ``apply_bypass_mode`` switches ``loss_mode`` on the DRIVER's copy of ``actor.policy_loss`` only;
  the workers keep the loss their config had at start (PPO-clip, no weights in the batch). It works
  only if the workers start with it: ``actor_rollout_ref.actor.policy_loss.loss_mode=bypass_mode``
  and ``+actor_rollout_ref.actor.policy_loss.rollout_correction.{loss_type=reinforce,rollout_is=...}``.
"""
from __future__ import annotations

from typing import Any, Callable, List, Optional

RC = "algorithm.rollout_correction."
WORKER_LOSS = "actor_rollout_ref.actor.policy_loss."

# RolloutCorrectionConfig's fields at verl 0.9.1
KEYS = ("rollout_is", "rollout_is_threshold", "rollout_is_batch_normalize", "rollout_rs",
        "rollout_rs_threshold", "bypass_mode", "loss_type")
# keys of the 51d2104 schema that verl 0.9 no longer has, and what replaced them
REMOVED = {"use_policy_gradient": "loss_type=reinforce|ppo_clip (bypass mode only)",
           "rollout_rs_threshold_lower": "a 'lower_upper' rollout_rs_threshold string",
           "rollout_token_veto_threshold": "a rollout_rs mode such as token_k3 with rollout_rs_threshold"}
LOSS_TYPES = ("ppo_clip", "reinforce")
# rollout_corr_helper.compute_rollout_rejection_mask's canonical options (comma-separated list)
RS_MODES = ("token_k1", "token_k2", "token_k3", "seq_sum_k1", "seq_sum_k2", "seq_sum_k3",
            "seq_mean_k1", "seq_mean_k2", "seq_mean_k3", "seq_max_k2", "seq_max_k3")

FIX = (f"{RC}bypass_mode=False with {RC}rollout_is=token|sequence, and "
       f"{WORKER_LOSS}loss_mode anything but bypass_mode (verl's default vanilla): decoupled mode, "
       "the driver's truncated IS weights are multiplied into the workers' policy loss "
       "(npu_flashrl.adapters.verl.tis_overrides(verl='0.9') writes them)")

Select = Callable[[str, Any], Any]  # select(dotted_key, default)


def _none(value: Any) -> bool:
    return value is None or str(value).strip().lower() in ("", "null", "none")


def _true(value: Any) -> bool:
    return value is True or str(value).strip().lower() == "true"


def problems(select: Select, missing: Any) -> List[str]:
    """Why this config does no TIS (or does not start) at verl 0.9; empty when it works.
    ``select(key, default)`` reads a dotted key, returning ``missing`` when it is absent."""
    out = []
    for key, instead in REMOVED.items():
        if select(RC + key, missing) is not missing:
            out.append(f"{RC}{key} does not exist at verl 0.7+ (verl refuses the key at start); "
                       f"it was replaced by {instead}")
    level = select(RC + "rollout_is", None)
    bypass = _true(select(RC + "bypass_mode", False))
    loss_type = str(select(RC + "loss_type", None) or "ppo_clip")
    worker_mode = str(select(WORKER_LOSS + "loss_mode", None) or "vanilla")
    if bypass and loss_type not in LOSS_TYPES:
        out.append(f"{RC}loss_type={loss_type}: verl's bypass loss takes {' or '.join(LOSS_TYPES)}")
    elif bypass and not _none(level) and loss_type == "ppo_clip":
        out.append(
            f"{RC}bypass_mode=True with loss_type=ppo_clip and rollout_is={level}: verl's bypass "
            "loss computes the IS weights for metrics only (compute_policy_loss_bypass_mode passes "
            "rollout_is_weights=None to PPO-clip), so the TIS level and threshold do nothing")
    elif bypass and not _none(level):  # reinforce: only if the workers start with that loss
        w_type = select(WORKER_LOSS + "rollout_correction.loss_type", None)
        w_level = select(WORKER_LOSS + "rollout_correction.rollout_is", None)
        if worker_mode != "bypass_mode" or str(w_type) != "reinforce" or _none(w_level):
            out.append(
                f"{RC}bypass_mode=True with loss_type=reinforce: apply_bypass_mode switches the loss "
                "on the driver's copy of actor.policy_loss only; the Ray workers built their actor "
                f"config at start and run {WORKER_LOSS}loss_mode={worker_mode} on the rollout "
                "log-probs with no IS weights. For this mode the workers need "
                f"{WORKER_LOSS}loss_mode=bypass_mode and "
                f"+{WORKER_LOSS}rollout_correction.loss_type=reinforce "
                f"+{WORKER_LOSS}rollout_correction.rollout_is={level} from the start")
    if not bypass and worker_mode == "bypass_mode":
        out.append(
            f"{WORKER_LOSS}loss_mode=bypass_mode with {RC}bypass_mode=False: that loss ignores the "
            "batch's rollout_is_weights and takes the trainer's old_log_probs for the rollout's")
    return out


def overrides(level: Optional[str], threshold: float, batch_normalize: Optional[bool],
              rs: Optional[str], rs_threshold: Optional[float], hydra_value) -> List[str]:
    """The ``algorithm.rollout_correction.*`` overrides of decoupled-mode TIS at verl 0.9 (options
    left at None are not written: verl's default stays)."""
    if rs is not None:
        bad = [m for m in str(rs).split(",") if m.strip() not in RS_MODES]
        if bad:
            raise ValueError(f"rs={rs!r}: verl 0.9's {RC}rollout_rs takes a comma-separated list of "
                             f"{', '.join(RS_MODES)}; not {', '.join(bad)}")
    out = [f"{RC}rollout_is={hydra_value(level)}",
           f"{RC}rollout_is_threshold={float(threshold)!r}",
           f"{RC}bypass_mode=False"]
    optional = (("rollout_is_batch_normalize", batch_normalize), ("rollout_rs", rs),
                ("rollout_rs_threshold", None if rs_threshold is None else float(rs_threshold)))
    return out + [f"{RC}{k}={hydra_value(v)}" for k, v in optional if v is not None]
