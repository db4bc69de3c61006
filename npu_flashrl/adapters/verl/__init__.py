"""verl integration: mismatch metrics in verl's metrics, rollout-mode and TIS checks, TIS override
strings; the end of every weight sync into the rollout is in :mod:`.sync_51d2104` (verl 0.7+ server
mode: :mod:`.server_091`; TIS keys of verl 0.7+: :mod:`.tis_091`).

Written against verl commit 51d2104ecb61563c41123a8f0bce2f06b18387dc (the pin); verl 0.6.1 on PyPI has
the same ``algorithm.rollout_correction`` schema and the same ``rollout_corr_helper`` functions.

Where the metrics hook attaches (and why)
-----------------------------------------
verl computes its own rollout-vs-trainer metrics in ``verl/trainer/ppo/rollout_corr_helper.py``, and
every caller imports those functions *at call time* (``from verl.trainer.ppo.rollout_corr_helper
import ...`` inside the function body), so replacing the module attributes is enough:

* ``verl_rollout_corr_metrics`` wraps ``compute_rollout_correction_and_add_to_batch``: the driver
  (``RayPPOTrainer.fit``) calls it once per step in *decoupled* mode (``bypass_mode=false``) when the
  batch has ``rollout_log_probs`` (``actor_rollout_ref.rollout.calculate_log_probs=True``); the
  ``algorithm.rollout_correction`` group is in verl's default config, so it runs whether or not TIS is
  on. There ``old_log_probs`` are the trainer's log-probs of the rollout policy's weights: exactly the
  INT8-vs-trainer mismatch. Our metrics go in under ``npu_flashrl/`` (computed on the response mask
  *before* verl's rejection sampling changes it), next to verl's ``rollout_corr/*``.
* ``verl_actor_rollout_corr_metrics`` wraps ``compute_rollout_corr_metrics_from_logprobs`` (called by
  ``dp_actor``/``megatron_actor`` ``update_policy`` per micro-batch with the *current* policy's
  log-probs) and ``compute_rollout_correction_and_rejection_mask`` when it is called from the policy
  loss (``bypass_mode=true, use_policy_gradient=true``, the published Ascend INT8 recipe, which at
  51d2104 does no TIS: :func:`check_tis` refuses it). In bypass mode no separate trainer forward
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
from typing import Any, Dict, List, Mapping, MutableMapping, Optional, Sequence, Union

import torch

from npu_flashrl import patches
from npu_flashrl._logging import get_logger
from npu_flashrl.metrics import mismatch_metrics
from npu_flashrl.patches import PatchNotApplicable, register
from npu_flashrl.adapters.verl.sync_51d2104 import PATCH_SYNC_END  # noqa: F401  (declares the patch)

logger = get_logger("adapters.verl")

VERL_PIN = "51d2104ecb61563c41123a8f0bce2f06b18387dc"
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


class RolloutModeError(ValueError):
    """The verl config cannot work with a FlashRL/npu_flashrl INT8 rollout."""


class TisConfigError(ValueError):
    """An ``algorithm.rollout_correction`` combination that silently does no TIS on the verl line
    (51d2104 or 0.9, :func:`check_tis`)."""


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
    if not value > 0:
        logger.warning("%s=%r must be > 0; using %.2f", WARN_ENV, raw, DEFAULT_WARN_THRESHOLD)
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

def _threshold_of(cfg: Any, default: float = 2.0) -> float:
    value = None
    if cfg is not None:
        try:
            value = cfg.get("rollout_is_threshold", None)
        except Exception:  # noqa: BLE001 - a config object without .get
            value = getattr(cfg, "rollout_is_threshold", None)
    try:
        return float(value) if value is not None and float(value) > 0 else default
    except (TypeError, ValueError):
        return default


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
        threshold = kwargs.get("rollout_is_threshold", args[1] if len(args) > 1 else 2.0)
        threshold = float(threshold) if threshold else 2.0
        ours = _safe_metrics(old_log_prob, rollout_log_prob, response_mask, threshold, ACTOR_PREFIX)
        _maybe_warn(ours, ACTOR_PREFIX, "verl actor policy loss, current policy vs rollout",
                    min_interval_s=ACTOR_WARN_INTERVAL_S)
        verl_metrics = dict(verl_metrics)
        verl_metrics.update(ours)
        return weights, new_mask, verl_metrics

    compute_rollout_correction_and_rejection_mask.__doc__ = original.__doc__
    compute_rollout_correction_and_rejection_mask.__wrapped__ = original
    return compute_rollout_correction_and_rejection_mask


@register(PATCH_DRIVER, f"{_HELPER}:compute_rollout_correction_and_add_to_batch", "verl 0.6.1 .. 51d2104",
          doc="npu_flashrl/* mismatch metrics once per step in the driver (decoupled mode)")
def _apply_driver_patch() -> None:
    patches.replace(f"{_HELPER}:compute_rollout_correction_and_add_to_batch", _make_driver_wrapper)


@register(PATCH_ACTOR, f"{_HELPER}:compute_rollout_corr_metrics_from_logprobs", "verl 0.6.1 .. 51d2104",
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


# --------------------------------------------------------------------------------- config checking

_MISSING = object()
_KEY_RC = "algorithm.rollout_correction."


def _select(config: Any, dotted: str, default: Any = _MISSING) -> Any:
    """Read ``a.b.c`` from an OmegaConf DictConfig, a dict, or an attribute object."""
    node = config
    for part in dotted.split("."):
        if node is None:
            return default
        if isinstance(node, Mapping) or hasattr(node, "keys"):
            try:
                if part not in node:
                    return default
                node = node[part]
                continue
            except Exception:  # noqa: BLE001 - e.g. omegaconf MissingMandatoryValue
                return default
        if hasattr(node, part):
            node = getattr(node, part)
        else:
            return default
    return node


def _flashrl_config_set(environ: Mapping[str, str]) -> bool:
    return bool((environ.get("FLASHRL_CONFIG") or "").strip())


def _truthy(value: Any) -> bool:
    return value is True or str(value).strip().lower() == "true"


def _tis_level(config: Any) -> Optional[str]:
    level = _select(config, "algorithm.rollout_correction.rollout_is", None)
    if level is None or str(level).strip().lower() in ("", "null", "none"):
        return None
    return str(level)


def check_tis(config: Any, verl: Optional[str] = None) -> None:
    """Refuse the ``algorithm.rollout_correction`` combinations that do no TIS on the verl line
    ``verl`` (``"51d2104"`` or ``"0.9"``, see :func:`npu_flashrl.compat.verl_line`; None: the
    installed verl's). Raises :class:`TisConfigError` naming the key and the fix.

    verl 0.7 .. 0.9: see :mod:`.tis_091` (``use_policy_gradient`` is gone, bypass mode dispatches on
    ``loss_type``). verl 51d2104 / 0.6.x, read from its source (``ray_trainer.py``,
    ``rollout_corr_helper.py``, ``dp_actor.py``/``megatron_actor.py``, ``core_algos.py``):

    * ``bypass_mode=True`` with ``rollout_is`` set: the trainer only sets ``old_log_probs =
      rollout_log_probs`` (``apply_rollout_correction``) and skips
      ``compute_rollout_correction_and_add_to_batch``, so no ``rollout_is_weights`` reach the loss.
    * ``use_policy_gradient=True``: the switch to the ``rollout_correction`` loss is written into the
      DRIVER's copy of ``actor.policy_loss`` (and only in bypass mode); the Ray workers built their
      actor config at init, so they keep the PPO-clip loss without IS weights (verl #4912, PR #4930).

    What works on both lines: decoupled mode (``bypass_mode=False``, at 51d2104 also
    ``use_policy_gradient=False``, ``rollout_is=token|sequence``): the driver computes truncated
    ``rollout_is_weights`` and the actors' policy loss (``core_algos.compute_policy_loss_vanilla``
    through ``get_policy_loss_fn``) multiplies them in.
    """
    from npu_flashrl import compat

    if compat.verl_line(verl) == "0.9":
        from npu_flashrl.adapters.verl import tis_091

        problems = tis_091.problems(lambda key, default: _select(config, key, default), _MISSING)
        if problems:
            raise TisConfigError("; ".join(problems) + f". Fix: {tis_091.FIX}")
        return
    level = _tis_level(config)
    bypass = _truthy(_select(config, _KEY_RC + "bypass_mode", False))
    pg = _truthy(_select(config, _KEY_RC + "use_policy_gradient", False))
    problems = []
    if pg:
        problems.append(
            f"{_KEY_RC}use_policy_gradient=True: at verl 51d2104 the switch to the policy-gradient loss "
            "is made on the driver's copy of actor.policy_loss only and never reaches the Ray workers, "
            "which keep PPO-clip without IS weights (verl issue #4912)")
    if bypass and level is not None:
        problems.append(
            f"{_KEY_RC}bypass_mode=True with rollout_is={level}: at verl 51d2104 bypass mode computes no "
            "IS weights (ray_trainer.py skips compute_rollout_correction_and_add_to_batch), so the TIS "
            "threshold, level and batch normalisation do nothing")
    if problems:
        raise TisConfigError(
            "; ".join(problems) + f". Fix: {_KEY_RC}bypass_mode=False {_KEY_RC}use_policy_gradient=False "
            "(decoupled mode: truncated IS weights multiplied into the PPO loss; "
            "npu_flashrl.adapters.verl.tis_overrides writes them)")


def overrides_to_config(overrides: Sequence[str]) -> Dict[str, Any]:
    """A nested dict from Hydra override strings (``a.b=v``, ``+a.b=v``; ``~a.b`` deletes), values read
    as YAML (``True``, ``null``, ``2.0``). Later overrides win, as in Hydra."""
    import yaml

    out: Dict[str, Any] = {}
    for ov in overrides:
        key, sep, raw = ov.partition("=")
        delete = key.startswith("~")
        key = key.lstrip("+~")
        if not key or (not sep and not delete):
            continue
        parts = key.split(".")
        node = out
        for part in parts[:-1]:
            child = node.get(part)
            if not isinstance(child, dict):
                child = node[part] = {}
            node = child
        if delete:
            node.pop(parts[-1], None)
            continue
        try:
            value = yaml.safe_load(raw) if raw.strip() else None
        except yaml.YAMLError:
            value = raw
        node[parts[-1]] = value
    return out


def check_rollout_mode(config: Any, *, quantized: Optional[bool] = None,
                       environ: Optional[Mapping[str, str]] = None,
                       verl: Optional[str] = None) -> List[str]:
    """Check a verl config (OmegaConf or dict) for an INT8 (FlashRL-style) rollout.

    * ``FLASHRL_CONFIG`` set and ``actor_rollout_ref.rollout.mode != "sync"`` -> :class:`RolloutModeError`:
      verl's async rollout (the default at verl 51d2104; a missing key counts as that default) never
      calls ``vllm.LLM.__init__``, so the INT8 load path would silently not run.
      Fix: ``actor_rollout_ref.rollout.mode=sync``.
    * quantized rollout (``quantized`` or, when None, ``FLASHRL_CONFIG`` set) with
      ``algorithm.rollout_correction.rollout_is`` null -> WARNING: TIS is off.
    * quantized rollout and ``actor_rollout_ref.rollout.calculate_log_probs`` not true -> WARNING: verl
      has no rollout log-probs, so TIS/metrics silently do nothing.
    * any config: a rollout-correction combination that does no TIS on the verl line ->
      :class:`TisConfigError` (see :func:`check_tis`).

    On verl 0.7+ (``verl`` line "0.9"; None: the installed verl's) the rollout-mode check is the
    server-mode one (:func:`.server_091.check_verl_config`). Returns the warning messages (also
    logged). ``environ`` defaults to ``os.environ``.
    """
    env = os.environ if environ is None else environ
    flashrl = _flashrl_config_set(env)
    if quantized is None:
        quantized = flashrl
    from npu_flashrl import compat

    line = compat.verl_line(verl)
    if flashrl and line == "0.9":  # verl 0.7+: server mode only (adapters.verl.server_091)
        from npu_flashrl.adapters.verl import server_091

        try:
            server_091.check_verl_config(lambda key: _select(config, key, None))
        except server_091.ServerModeError as exc:
            raise RolloutModeError(str(exc)) from None
    elif flashrl:
        mode = _select(config, "actor_rollout_ref.rollout.mode", None)
        if mode is None or str(mode).strip().lower() != "sync":
            shown = "unset (verl 51d2104 default: async)" if mode is None else repr(str(mode))
            raise RolloutModeError(
                f"FLASHRL_CONFIG is set but actor_rollout_ref.rollout.mode is {shown}: verl's async "
                "rollout never builds vllm.LLM, so the INT8 rollout (and its weight reload) would silently "
                "not be used. Fix: add the override actor_rollout_ref.rollout.mode=sync")
    check_tis(config, line)
    warnings: List[str] = []
    if quantized:
        rollout_is = _select(config, "algorithm.rollout_correction.rollout_is", None)
        calc = _select(config, "actor_rollout_ref.rollout.calculate_log_probs", None)
        calc_on = calc is True or str(calc).strip().lower() == "true"
        if rollout_is is None or str(rollout_is).strip().lower() in ("", "null", "none"):
            msg = ("quantized rollout with algorithm.rollout_correction.rollout_is=null: truncated importance "
                   "sampling (TIS) is OFF, so the INT8-vs-trainer mismatch is not corrected. Enable it with "
                   "algorithm.rollout_correction.rollout_is=token (or sequence) and "
                   "actor_rollout_ref.rollout.calculate_log_probs=True (see npu_flashrl.adapters.verl.tis_overrides)")
            warnings.append(msg)
        elif not calc_on:
            msg = (f"algorithm.rollout_correction.rollout_is={rollout_is} but "
                   "actor_rollout_ref.rollout.calculate_log_probs is not True: verl gets no rollout log-probs "
                   "and silently skips TIS. Fix: actor_rollout_ref.rollout.calculate_log_probs=True")
            warnings.append(msg)
    for msg in warnings:
        logger.warning(msg)
    return warnings


# ------------------------------------------------------------------------------ override strings


def _hydra_value(v: Any) -> str:
    if v is None:
        return "null"
    if isinstance(v, bool):
        return "True" if v else "False"
    return str(v)


def tis_overrides(level: Optional[str] = "token", threshold: float = 2.0, *,
                  calculate_log_probs: bool = True, sync_mode: Optional[bool] = None,
                  batch_normalize: Optional[bool] = None, rs: Optional[str] = None,
                  rs_threshold: Optional[float] = None, rs_threshold_lower: Optional[float] = None,
                  token_veto_threshold: Optional[float] = None,
                  bypass_mode: bool = False, use_policy_gradient: bool = False,
                  verl: Optional[str] = None) -> List[str]:
    """Hydra overrides turning on truncated IS for an INT8 rollout, in the key names of the verl
    line ``verl`` (``"51d2104"``: the pin and 0.6.x; ``"0.9"``: verl 0.7.1 .. 0.9.x; None: the
    installed verl's, the pin's without verl; see :func:`npu_flashrl.compat.verl_line`).

    Always decoupled mode, the combination that multiplies the truncated IS weights into the loss
    on both lines (see :func:`check_tis`; asking for another one raises :class:`TisConfigError`):
    ``bypass_mode=False`` is written out, at 51d2104 also ``use_policy_gradient=False``. The recipes'
    ``algorithm.rollout_correction.*`` overrides are these (tests/test_verl_51d2104_tis.py and
    tests/test_verl091_tis.py run them through verl's own loss code).

    ``level``: "token" | "sequence" | None (None writes ``rollout_is=null``, TIS off). Options left at
    None are not written (verl's default stays). ``rs``: at 51d2104 "token" | "sequence" |
    "geometric", at 0.9 a comma-separated list of verl 0.9's modes ("token_k1", "seq_mean_k3", ...).
    ``rs_threshold_lower`` and ``token_veto_threshold`` exist at 51d2104 only. ``sync_mode`` adds
    ``actor_rollout_ref.rollout.mode=sync`` (None: True at 51d2104, where FLASHRL_CONFIG needs it;
    verl 0.9 has no sync mode, so True is refused there). Example: ``tis_overrides(verl="51d2104")``
    -> ``['algorithm.rollout_correction.rollout_is=token', 'algorithm.rollout_correction.rollout_is_threshold=2.0',
    'algorithm.rollout_correction.bypass_mode=False', 'algorithm.rollout_correction.use_policy_gradient=False',
    'actor_rollout_ref.rollout.calculate_log_probs=True', 'actor_rollout_ref.rollout.mode=sync']``;
    ``tis_overrides(verl="0.9")`` -> the first three and ``calculate_log_probs=True``.
    """
    from npu_flashrl import compat

    line = compat.verl_line(verl)
    if level not in ("token", "sequence", None):
        raise ValueError(f"level must be 'token', 'sequence' or None, got {level!r}")
    if not (isinstance(threshold, (int, float)) and threshold > 0):
        raise ValueError(f"threshold must be a positive number, got {threshold!r}")
    if sync_mode is None:
        sync_mode = line == "51d2104"
    if line == "0.9":
        from npu_flashrl.adapters.verl import tis_091

        gone = [f"{name} (algorithm.rollout_correction.{key}; use {tis_091.REMOVED[key]})"
                for name, key, v in (("rs_threshold_lower", "rollout_rs_threshold_lower", rs_threshold_lower),
                                     ("token_veto_threshold", "rollout_token_veto_threshold",
                                      token_veto_threshold))
                if v is not None]
        if gone:
            raise ValueError(f"verl 0.9 has no {', '.join(gone)}")
        if sync_mode:
            raise ValueError("sync_mode=True: verl 0.7+ runs its rollout as a server only (no "
                             "actor_rollout_ref.rollout.mode=sync); leave sync_mode unset")
        rc = {"rollout_is": level, "bypass_mode": bool(bypass_mode)}
        if use_policy_gradient:
            rc["use_policy_gradient"] = True
        check_tis({"algorithm": {"rollout_correction": rc}}, line)
        out = tis_091.overrides(level, threshold, batch_normalize, rs, rs_threshold, _hydra_value)
    else:
        if rs not in (None, "token", "sequence", "geometric"):
            raise ValueError(f"rs must be None, 'token', 'sequence' or 'geometric', got {rs!r}")
        check_tis({"algorithm": {"rollout_correction": {
            "rollout_is": level, "bypass_mode": bool(bypass_mode),
            "use_policy_gradient": bool(use_policy_gradient)}}}, line)
        out = [f"{_KEY_RC}rollout_is={_hydra_value(level)}",
               f"{_KEY_RC}rollout_is_threshold={float(threshold)!r}",
               f"{_KEY_RC}bypass_mode={_hydra_value(bool(bypass_mode))}",
               f"{_KEY_RC}use_policy_gradient={_hydra_value(bool(use_policy_gradient))}"]
        optional = (("rollout_is_batch_normalize", batch_normalize), ("rollout_rs", rs),
                    ("rollout_rs_threshold", None if rs_threshold is None else float(rs_threshold)),
                    ("rollout_rs_threshold_lower", None if rs_threshold_lower is None else float(rs_threshold_lower)),
                    ("rollout_token_veto_threshold",
                     None if token_veto_threshold is None else float(token_veto_threshold)))
        out += [f"{_KEY_RC}{k}={_hydra_value(v)}" for k, v in optional if v is not None]
    if calculate_log_probs:
        out.append("actor_rollout_ref.rollout.calculate_log_probs=True")
    if sync_mode:
        out.append("actor_rollout_ref.rollout.mode=sync")
    return out
