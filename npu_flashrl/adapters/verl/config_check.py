"""verl config checks and override strings for an INT8 rollout: rollout mode (sync at 51d2104,
server mode on verl 0.7+), TIS (``algorithm.rollout_correction``) per verl line, Hydra override
parsing. Re-exported by :mod:`npu_flashrl.adapters.verl`. What differs per verl line (keys, rules,
overrides) is in :mod:`npu_flashrl.lines.verl`; this module names no line."""
from __future__ import annotations

import os
from typing import Any, List, Mapping, Optional

from npu_flashrl._logging import get_logger
from npu_flashrl.errors import NpuFlashrlError
from npu_flashrl.lines import verl as verl_lines
from npu_flashrl.lines.verl import is_server_line
from npu_flashrl.values import is_null, is_true

logger = get_logger(__name__)


class RolloutModeError(NpuFlashrlError, ValueError):
    """The verl config cannot work with a FlashRL/npu_flashrl INT8 rollout."""


class TisConfigError(NpuFlashrlError, ValueError):
    """An ``algorithm.rollout_correction`` combination that silently does no TIS on the verl line
    (51d2104 or 0.9, :func:`check_tis`)."""


# --------------------------------------------------------------------------------- config checking

_MISSING = verl_lines.MISSING
_select = verl_lines.select
overrides_to_config = verl_lines.overrides_to_config  # the one reading of Hydra overrides


def _flashrl_config_set(environ: Mapping[str, str]) -> bool:
    return bool((environ.get("FLASHRL_CONFIG") or "").strip())


def _line(verl: Optional[str]) -> verl_lines.VerlLine:
    from npu_flashrl import lines
    return verl_lines.for_line(lines.verl_line(verl))


def check_tis(config: Any, verl: Optional[str] = None) -> None:
    """Refuse the ``algorithm.rollout_correction`` combinations that do no TIS on the verl line
    ``verl`` (``"51d2104"`` or ``"0.9"``, see :func:`npu_flashrl.lines.verl_line`; None: the
    installed verl's). Raises :class:`TisConfigError` naming the key and the fix. The rules per
    line, read from each line's source, are in :mod:`npu_flashrl.lines.verl`.

    What works on both lines: decoupled mode (``bypass_mode=False``, at 51d2104 also
    ``use_policy_gradient=False``, ``rollout_is=token|sequence``): the driver computes truncated
    ``rollout_is_weights`` and the actors' policy loss (``core_algos.compute_policy_loss_vanilla``
    through ``get_policy_loss_fn``) multiplies them in.
    """
    line = _line(verl)
    problems = line.tis_problems(lambda key, default: _select(config, key, default), _MISSING)
    if problems:
        raise TisConfigError("; ".join(problems) + f". Fix: {line.FIX}")


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
    server-mode one (`verl_lines.Server09.rollout_mode_problem`). Returns the warning messages (also
    logged). ``environ`` defaults to ``os.environ``.
    """
    env = os.environ if environ is None else environ
    flashrl = _flashrl_config_set(env)
    if quantized is None:
        quantized = flashrl
    line = _line(verl)
    if flashrl:  # 51d2104: rollout.mode=sync; verl 0.7+: server mode only (adapters.verl.server_mode)
        problem = line.rollout_mode_problem(lambda key: _select(config, key, None), env)
        if problem is not None:
            raise RolloutModeError(problem)
        from npu_flashrl.config import int8_rollout_dtype_problem

        problem = int8_rollout_dtype_problem(_select(config, "actor_rollout_ref.rollout.dtype", None))
        if problem is not None and quantized:
            raise RolloutModeError(problem + ". Fix: actor_rollout_ref.rollout.dtype=bfloat16")
        if is_server_line(line.name):
            from npu_flashrl.adapters.verl import checkpoint_engine

            try:  # checkpoint engines (one-step-off / fully-async): what cannot feed an INT8 rollout
                checkpoint_engine.check_config(lambda key: _select(config, key, None),
                                               checkpoint_engine.config_from(env))
            except checkpoint_engine.CheckpointEngineError as exc:
                raise RolloutModeError(str(exc)) from None
    check_tis(config, line.name)
    warnings: List[str] = []
    if quantized:
        rollout_is = _select(config, "algorithm.rollout_correction.rollout_is", None)
        calc_on = is_true(_select(config, "actor_rollout_ref.rollout.calculate_log_probs", None))
        if is_null(rollout_is):
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


def tis_overrides(level: Optional[str] = "token", threshold: float = 2.0, *,
                  calculate_log_probs: bool = True, sync_mode: Optional[bool] = None,
                  batch_normalize: Optional[bool] = None, rs: Optional[str] = None,
                  rs_threshold: Optional[float] = None, rs_threshold_lower: Optional[float] = None,
                  token_veto_threshold: Optional[float] = None,
                  bypass_mode: bool = False, use_policy_gradient: bool = False,
                  verl: Optional[str] = None) -> List[str]:
    """Hydra overrides turning on truncated IS for an INT8 rollout, in the key names of the verl
    line ``verl`` (``"51d2104"``: the pin and 0.6.x; ``"0.9"``: verl 0.7.1 .. 0.9.x; None: the
    installed verl's, the pin's without verl; see :func:`npu_flashrl.lines.verl_line`).

    Always decoupled mode, the combination that multiplies the truncated IS weights into the loss
    on both lines (see :func:`check_tis`; asking for another one raises :class:`TisConfigError`):
    ``bypass_mode=False`` is written out, at 51d2104 also ``use_policy_gradient=False``. The recipes'
    ``algorithm.rollout_correction.*`` overrides are these (tests/adapters/verl/own_process/test_sync_mode_pinned_tis.py and
    tests/adapters/verl/test_verl_server_tis.py run them through verl's own loss code).

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
    line = _line(verl)
    if level not in ("token", "sequence", None):
        raise ValueError(f"level must be 'token', 'sequence' or None, got {level!r}")
    if not (isinstance(threshold, (int, float)) and threshold > 0):
        raise ValueError(f"threshold must be a positive number, got {threshold!r}")
    if sync_mode is None:
        sync_mode = line.SYNC_MODE_DEFAULT
    out = line.overrides(level, threshold, batch_normalize=batch_normalize, rs=rs,
                         rs_threshold=rs_threshold, rs_threshold_lower=rs_threshold_lower,
                         token_veto_threshold=token_veto_threshold, bypass_mode=bypass_mode,
                         use_policy_gradient=use_policy_gradient, sync_mode=sync_mode)
    check_tis({"algorithm": {"rollout_correction": line.tis_settings(level, bypass_mode,
                                                                     use_policy_gradient)}}, line.name)
    if calculate_log_probs:
        out.append("actor_rollout_ref.rollout.calculate_log_probs=True")
    if sync_mode:
        out.append("actor_rollout_ref.rollout.mode=sync")
    return out
