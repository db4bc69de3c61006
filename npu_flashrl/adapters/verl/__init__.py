"""verl integration: mismatch metrics in verl's metrics, rollout-mode and TIS checks, TIS override
strings; the end of every weight sync into the rollout is in :mod:`.sync_mode` (verl 0.7+ server
mode: :mod:`.server_mode`; what differs per verl line: :mod:`npu_flashrl.lines.verl`).

Written against verl commit 51d2104ecb61563c41123a8f0bce2f06b18387dc (the pin); verl 0.6.1 on PyPI has
the same ``algorithm.rollout_correction`` schema and the same ``rollout_corr_helper`` functions, verl
0.9.1 the same function names and argument order (its TIS keys: :mod:`npu_flashrl.lines.verl`).

Where the metrics hook attaches (and why)
-----------------------------------------
verl computes its own rollout-vs-trainer metrics in ``verl/trainer/ppo/rollout_corr_helper.py``, and
every caller imports those functions *at call time* (``from verl.trainer.ppo.rollout_corr_helper
import ...`` inside the function body), so replacing the module attributes is enough:

* ``verl_rollout_corr_metrics`` wraps ``compute_rollout_correction_and_add_to_batch``: the driver
  (``RayPPOTrainer.fit``; on verl 0.9 also the default v1 trainer, ``trainer.use_v1=true``,
  ``verl/trainer/ppo/v1/trainer_base.py``, which imports the function at module level, so its copy
  is re-pointed when that module is imported) calls it once per step in *decoupled* mode (``bypass_mode=false``) when the
  batch has ``rollout_log_probs`` (``actor_rollout_ref.rollout.calculate_log_probs=True``); the
  ``algorithm.rollout_correction`` group is in verl's default config, so it runs whether or not TIS is
  on. There ``old_log_probs`` are the trainer's log-probs of the rollout policy's weights: exactly the
  INT8-vs-trainer mismatch. Our metrics go in under ``npu_flashrl/`` (computed on the response mask
  *before* verl's rejection sampling changes it), next to verl's ``rollout_corr/*``.
* ``verl_actor_rollout_corr_metrics`` wraps ``compute_rollout_corr_metrics_from_logprobs`` (called by
  ``dp_actor``/``megatron_actor`` ``update_policy`` per micro-batch with the *current* policy's
  log-probs, up to 51d2104; verl 0.9 has no caller) and ``compute_rollout_correction_and_rejection_mask``
  when it is called from the policy loss (51d2104: ``bypass_mode=true, use_policy_gradient=true``,
  the published Ascend INT8 recipe, which does no TIS there: :func:`check_tis` refuses it; verl 0.9:
  ``core_algos.compute_policy_loss_bypass_mode``, the workers' ``loss_mode=bypass_mode``, both
  ``loss_type`` values). In bypass mode no separate trainer forward
  exists before the update, so this is the only place trainer log-probs meet the rollout's. These keys are ``npu_flashrl/actor/*`` (means over micro-batches, as
  verl reduces them); the first micro-batch of an on-policy step equals the pure mismatch.
  These patches must be applied inside the Ray worker processes (``install_verl_hooks()`` from the
  worker-side activation, e.g. the vLLM general plugin), not only in the driver.

A WARNING through the ``npu_flashrl`` logger is emitted when ``token_mult_prob_error`` exceeds
``NPU_FLASHRL_MISMATCH_WARN`` (default 1.05; actor-side warnings are rate-limited to one per minute).

No patch wanted? Call :func:`add_mismatch_metrics` yourself with the batch and verl's metrics dict.
"""
from __future__ import annotations

import contextvars
import math
import os
import time
from typing import Any, Dict, Mapping, MutableMapping, Optional, Union

import torch

from npu_flashrl import lines, patches
from npu_flashrl._logging import get_logger
from npu_flashrl.metrics import mismatch_metrics
from npu_flashrl.patches import PatchNotApplicable, register
from npu_flashrl.adapters.verl.sync_mode import PATCH_SYNC_END  # noqa: F401  (declares the patch)

logger = get_logger(__name__)

VERL_PIN = lines.SYNC_PIN  # the verl commit of the sync-mode line (one home: npu_flashrl.lines.verl)
PREFIX = "npu_flashrl/"
ACTOR_PREFIX = "npu_flashrl/actor/"
WARN_ENV = "NPU_FLASHRL_MISMATCH_WARN"
DEFAULT_WARN_THRESHOLD = 1.05
ACTOR_WARN_INTERVAL_S = 60.0

_HELPER = "verl.trainer.ppo.rollout_corr_helper"
PATCH_DRIVER = "verl_rollout_corr_metrics"
PATCH_ACTOR = "verl_actor_rollout_corr_metrics"

__all__ = [
    "RolloutModeError",
    "TisConfigError",
    "check_tis",
    "overrides_to_config",
    "add_mismatch_metrics",
    "check_rollout_mode",
    "tis_overrides",
    "install_verl_hooks",
    "warn_threshold",
    "PATCH_DRIVER",
    "PATCH_ACTOR",
    "PATCH_SYNC_END",
]


# ----------------------------------------------------------------------------------------- warnings

def warn_threshold() -> float:
    """token_mult_prob_error above which we warn: env NPU_FLASHRL_MISMATCH_WARN, default 1.05."""
    raw = os.environ.get(WARN_ENV)
    if raw is None or raw.strip() == "":
        return DEFAULT_WARN_THRESHOLD
    try:
        value = float(raw)
    except ValueError:
        logger.warning("%s=%r is not a number; using %.2f", WARN_ENV, raw, DEFAULT_WARN_THRESHOLD)
        return DEFAULT_WARN_THRESHOLD
    if not (value > 0 and math.isfinite(value)):  # inf would switch the warning off without a word
        logger.warning("%s=%r must be a finite number > 0; using %.2f", WARN_ENV, raw, DEFAULT_WARN_THRESHOLD)
        return DEFAULT_WARN_THRESHOLD
    return value


_last_warn: Dict[str, float] = {}


def _maybe_warn(metrics: Mapping[str, float], prefix: str, where: str,
                threshold: Optional[float] = None, min_interval_s: float = 0.0) -> None:
    value = metrics.get(prefix + "token_mult_prob_error")
    if value is None or not math.isfinite(value):
        return
    limit = warn_threshold() if threshold is None else threshold
    if value <= limit:
        return
    now = time.monotonic()
    if min_interval_s > 0 and now - _last_warn.get(where, -math.inf) < min_interval_s:
        return
    _last_warn[where] = now
    logger.warning(
        "rollout/trainer mismatch: token_mult_prob_error=%.4f > %.4f (%s; k3 KL=%.3g over %d tokens). "
        "1.00-1.05 is the healthy band for an INT8 rollout; check the profile/quantized weights, enable "
        "FLASHRL_LMHEAD_FP32=1 on both sides, and keep TIS on (algorithm.rollout_correction.rollout_is). "
        "Threshold: env %s.", value, limit, where, metrics.get(prefix + "kl_k3", float("nan")),
        int(metrics.get(prefix + "valid_tokens", 0)), WARN_ENV)


# ---------------------------------------------------------------------------------- plain callback

def _get(container: Any, key: str):
    try:
        return container[key]
    except (KeyError, TypeError, IndexError):
        return None


def _tensors_from(batch_or_tensors: Any):
    """(logp_train, logp_rollout, mask) from a DataProto, a TensorDict/dict, or a 3-tuple."""
    if isinstance(batch_or_tensors, (tuple, list)):
        if len(batch_or_tensors) != 3:
            raise ValueError("expected (logp_train, logp_rollout, mask)")
        return tuple(batch_or_tensors)
    data = getattr(batch_or_tensors, "batch", batch_or_tensors)  # DataProto -> its TensorDict
    train = _get(data, "old_log_probs")
    rollout = _get(data, "rollout_log_probs")
    if train is None or rollout is None:
        missing = [k for k, v in (("old_log_probs", train), ("rollout_log_probs", rollout)) if v is None]
        raise KeyError(f"batch has no {', '.join(missing)}; rollout log-probs need "
                       "actor_rollout_ref.rollout.calculate_log_probs=True and old_log_probs must be "
                       "computed (decoupled mode) before this call")
    mask = _get(data, "response_mask")
    if mask is None:
        attn, responses = _get(data, "attention_mask"), _get(data, "responses")
        if attn is None or responses is None:
            raise KeyError("batch has neither response_mask nor attention_mask + responses")
        mask = attn[:, -responses.shape[-1]:]
    return train, rollout, mask


def add_mismatch_metrics(batch_or_tensors: Any, metrics: Optional[MutableMapping[str, Any]] = None, *,
                         tis_threshold: float = 2.0, prefix: str = PREFIX,
                         warn_above: Optional[float] = None) -> Dict[str, float]:
    """Compute :func:`npu_flashrl.metrics.mismatch_metrics` and add them to verl's ``metrics`` dict.

    ``batch_or_tensors``: a verl ``DataProto`` (or its ``.batch`` TensorDict / a dict) holding
    ``old_log_probs``, ``rollout_log_probs`` and ``response_mask`` (or ``attention_mask`` + ``responses``),
    or a tuple ``(logp_train, logp_rollout, mask)``. Returns the new entries. Warns when
    token_mult_prob_error > ``warn_above`` (default: env NPU_FLASHRL_MISMATCH_WARN or 1.05).

    Use it without any patch, e.g. in a ``RayPPOTrainer`` subclass right after ``old_log_probs`` were
    computed (decoupled mode)::

        from npu_flashrl.adapters.verl import add_mismatch_metrics
        add_mismatch_metrics(batch, metrics)   # metrics: the step's dict passed to the logger
    """
    train, rollout, mask = _tensors_from(batch_or_tensors)
    ours = mismatch_metrics(train, rollout, mask, tis_threshold=tis_threshold, prefix=prefix)
    _maybe_warn(ours, prefix, "add_mismatch_metrics", warn_above)
    if metrics is not None:
        metrics.update(ours)
    return ours


# ------------------------------------------------------------------------------ registered patches

def _threshold_value(value: Any, default: float = 2.0) -> float:
    """The TIS upper bound of a ``rollout_is_threshold``: a number, or verl 0.9's IcePop
    ``"lower_upper"`` string (its upper bound); ``default`` for anything else."""
    if isinstance(value, str) and "_" in value:
        value = value.rpartition("_")[2]
    try:
        return float(value) if value is not None and float(value) > 0 else default
    except (TypeError, ValueError):
        return default


def _threshold_of(cfg: Any, default: float = 2.0) -> float:
    value = None
    if cfg is not None:
        try:
            value = cfg.get("rollout_is_threshold", None)
        except Exception:  # noqa: BLE001 - a config object without .get
            value = getattr(cfg, "rollout_is_threshold", None)
    return _threshold_value(value, default)


_in_driver_hook: contextvars.ContextVar[bool] = contextvars.ContextVar("npu_flashrl_in_driver_hook",
                                                                       default=False)


def _safe_metrics(train, rollout, mask, threshold, prefix) -> Dict[str, float]:
    """Our metrics never break a training step: any failure is logged and yields nothing."""
    try:
        return mismatch_metrics(train, rollout, mask, tis_threshold=threshold, prefix=prefix)
    except Exception as exc:  # noqa: BLE001
        logger.warning("npu_flashrl mismatch metrics skipped: %s: %s", type(exc).__name__, exc)
        return {}


def _make_driver_wrapper(original):
    def compute_rollout_correction_and_add_to_batch(batch, rollout_corr_config, *args, **kwargs):
        try:
            train, rollout, mask = _tensors_from(batch)
            mask = mask.clone()  # verl replaces response_mask with the rejection-sampled one
        except Exception as exc:  # noqa: BLE001
            logger.warning("npu_flashrl mismatch metrics skipped: %s", exc)
            train = None
        token = _in_driver_hook.set(True)
        try:
            batch, verl_metrics = original(batch, rollout_corr_config, *args, **kwargs)
        finally:
            _in_driver_hook.reset(token)
        if train is not None:
            ours = _safe_metrics(train, rollout, mask, _threshold_of(rollout_corr_config), PREFIX)
            _maybe_warn(ours, PREFIX, "verl driver, old_log_probs vs rollout_log_probs")
            verl_metrics = dict(verl_metrics)
            verl_metrics.update(ours)
        return batch, verl_metrics

    compute_rollout_correction_and_add_to_batch.__doc__ = original.__doc__
    compute_rollout_correction_and_add_to_batch.__wrapped__ = original
    return compute_rollout_correction_and_add_to_batch


def _make_actor_metrics_wrapper(original):
    def compute_rollout_corr_metrics_from_logprobs(log_prob, rollout_log_prob, response_mask, *args, **kwargs):
        out = original(log_prob, rollout_log_prob, response_mask, *args, **kwargs)
        ours = _safe_metrics(log_prob, rollout_log_prob, response_mask, 2.0, ACTOR_PREFIX)
        _maybe_warn(ours, ACTOR_PREFIX, "verl actor, current policy vs rollout",
                    min_interval_s=ACTOR_WARN_INTERVAL_S)
        out = dict(out)
        out.update(ours)
        return out

    compute_rollout_corr_metrics_from_logprobs.__doc__ = original.__doc__
    compute_rollout_corr_metrics_from_logprobs.__wrapped__ = original
    return compute_rollout_corr_metrics_from_logprobs


def _make_actor_loss_wrapper(original):
    def compute_rollout_correction_and_rejection_mask(old_log_prob, rollout_log_prob, response_mask,
                                                      *args, **kwargs):
        weights, new_mask, verl_metrics = original(old_log_prob, rollout_log_prob, response_mask,
                                                   *args, **kwargs)
        if _in_driver_hook.get():  # the driver wrapper reports these under npu_flashrl/
            return weights, new_mask, verl_metrics
        threshold = _threshold_value(kwargs.get("rollout_is_threshold", args[1] if len(args) > 1 else None))
        ours = _safe_metrics(old_log_prob, rollout_log_prob, response_mask, threshold, ACTOR_PREFIX)
        _maybe_warn(ours, ACTOR_PREFIX, "verl actor policy loss, current policy vs rollout",
                    min_interval_s=ACTOR_WARN_INTERVAL_S)
        verl_metrics = dict(verl_metrics)
        verl_metrics.update(ours)
        return weights, new_mask, verl_metrics

    compute_rollout_correction_and_rejection_mask.__doc__ = original.__doc__
    compute_rollout_correction_and_rejection_mask.__wrapped__ = original
    return compute_rollout_correction_and_rejection_mask


# Modules that bind the driver function at import (``from rollout_corr_helper import ...`` at
# module level) instead of at call time: verl 0.9's v1 trainer (``trainer.use_v1=true``, its
# default), which imports transfer_queue and is imported in the TaskRunner only.
_DRIVER_IMPORTERS = ("verl.trainer.ppo.v1.trainer_base",)
_DRIVER_FN = "compute_rollout_correction_and_add_to_batch"


def _rebind_driver(module) -> None:
    """Point ``module``'s own copy of the driver function at our wrapper (the helper's attribute),
    unless it already is ours or is something else than verl's original."""
    import importlib

    ours = getattr(importlib.import_module(_HELPER), _DRIVER_FN)
    current = getattr(module, _DRIVER_FN, None)
    if current is not None and current is not ours and current is patches.original(ours):
        setattr(module, _DRIVER_FN, ours)
        logger.debug("npu_flashrl: %s.%s -> mismatch-metrics wrapper", module.__name__, _DRIVER_FN)


@register(PATCH_DRIVER, f"{_HELPER}:{_DRIVER_FN}", "verl 0.6.1 .. 0.9.1",
          doc="npu_flashrl/* mismatch metrics once per step in the driver (decoupled mode; "
              "verl 0.9's v1 trainer included)")
def _apply_driver_patch() -> None:
    patches.replace(f"{_HELPER}:{_DRIVER_FN}", _make_driver_wrapper)
    for name in _DRIVER_IMPORTERS:
        patches.when_imported(name, _rebind_driver)


@register(PATCH_ACTOR, f"{_HELPER}:compute_rollout_corr_metrics_from_logprobs", "verl 0.6.1 .. 0.9.1",
          doc="npu_flashrl/actor/* mismatch metrics in the actor update (bypass mode included)")
def _apply_actor_patch() -> None:
    # resolve both before replacing either, so a missing target leaves nothing half-applied
    patches.resolve(f"{_HELPER}:compute_rollout_correction_and_rejection_mask")
    patches.resolve(f"{_HELPER}:compute_rollout_corr_metrics_from_logprobs")
    patches.replace(f"{_HELPER}:compute_rollout_corr_metrics_from_logprobs", _make_actor_metrics_wrapper)
    patches.replace(f"{_HELPER}:compute_rollout_correction_and_rejection_mask", _make_actor_loss_wrapper)


def install_verl_hooks(driver: bool = True, actor: bool = True) -> Dict[str, bool]:
    """Apply the metrics patches (idempotent). Call in the driver AND in verl's Ray worker processes."""
    names = ([PATCH_DRIVER] if driver else []) + ([PATCH_ACTOR] if actor else [])
    return patches.apply_patches(names)


# config checks and override strings live in .config_check (re-exported here)
from npu_flashrl.adapters.verl.config_check import (  # noqa: E402
    RolloutModeError, TisConfigError, check_rollout_mode, check_tis, overrides_to_config, tis_overrides)
