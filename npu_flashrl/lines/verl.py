"""The verl side of a stack line: which verl config line a job runs, and how the installed verl
drives its rollout (decided without importing verl: its rollout package imports Ray and vLLM).

verl config lines are named by the release whose `algorithm.rollout_correction` schema they have:
"51d2104" (the pin; verl 0.6.x has the same schema: sync-mode rollout, `use_policy_gradient`)
and "0.9" (verl 0.7.1 .. 0.9.x: server-mode rollout, `use_policy_gradient` replaced by
`loss_type`, `rollout_rs_threshold_lower` / `rollout_token_veto_threshold` gone).

The rules of each config line, as npu_flashrl's config checks (adapters/verl/config_check.py, the
recipes' `npu-flashrl preflight`, `npu-flashrl verify --verl-overrides`) apply them: one class
per line (`VerlLine`) holding its TIS keys (``algorithm.rollout_correction``), the combinations
that silently do no TIS there, the overrides that turn decoupled-mode TIS on, and what the rollout
mode must be; `for_line(verl_line())` picks it. The checks themselves name no line.

* ``"51d2104"``: verl 51d2104 (the pin) and 0.6.x, sync (SPMD) rollout (``adapters/verl/sync_mode.py``).
  Read from its source (``ray_trainer.py``, ``rollout_corr_helper.py``,
  ``dp_actor.py``/``megatron_actor.py``, ``core_algos.py``).
* ``"0.9"``: verl 0.7.1 .. 0.9.x, server-mode rollout (``adapters/verl/server_mode.py``). Read from verl 0.9.1:
  ``trainer/config/algorithm/rollout_correction.yaml`` and ``trainer/config/algorithm.py``
  (``RolloutCorrectionConfig``: 0.7 replaced ``use_policy_gradient`` with ``loss_type`` and dropped
  ``rollout_rs_threshold_lower`` / ``rollout_token_veto_threshold``), ``trainer/ppo/ray_trainer.py``
  (``fit``: bypass mode calls ``apply_bypass_mode`` and skips
  ``compute_rollout_correction_and_add_to_batch``), ``trainer/ppo/rollout_corr_helper.py``,
  ``trainer/ppo/core_algos.py`` (every registered policy loss but ``bypass_mode`` multiplies
  ``rollout_is_weights`` in; ``bypass_mode`` ignores them and dispatches on ``loss_type``) and
  ``workers/engine_workers.py`` / ``workers/utils/losses.py`` (the workers' ``ppo_loss`` uses the
  actor config built at init: ``partial(ppo_loss, config=actor_config)``).

What works on both lines: decoupled mode (``bypass_mode=False``, at 51d2104 also
``use_policy_gradient=False``, ``rollout_is=token|sequence``): the driver computes truncated
``rollout_is_weights = min(exp(old - rollout), threshold)`` and the actors' policy loss multiplies
them in. This is what `overrides` writes on each line.
"""
from __future__ import annotations

import importlib.util
import os
from typing import Any, Callable, Dict, List, Mapping, Optional, Tuple

from npu_flashrl.values import is_null, is_true

SYNC, SERVER = "51d2104", "0.9"
SYNC_PIN = "51d2104ecb61563c41123a8f0bce2f06b18387dc"  # the verl commit the sync-mode line pins
VERL_LINES = (SYNC, SERVER)


def _aliases() -> Dict[str, str]:
    """Accepted spellings of the verl config lines, from the one table of stack lines
    (`detect.LINES`): each line's label ("pinned", "0.11", "current"), its verl release and that
    release's minor ("0.9.1", "0.9") name the config line of the verl that line runs."""
    from npu_flashrl.lines.detect import LINES

    out = {SYNC: SYNC, SERVER: SERVER}
    for ln in LINES:
        config_line = SERVER if ln.verl_mode == "server" else SYNC
        for name in (ln.label, ln.verl, ".".join(ln.verl.split(".")[:2])):
            out[name] = config_line
    return out


VERL_ALIASES = _aliases()
# What the server-mode line's verl (0.9.1) registers in CheckpointEngineRegistry
# (verl/checkpoint_engine/*.py, `@CheckpointEngineRegistry.register(...)`): the names
# `actor_rollout_ref.rollout.checkpoint_engine.backend` takes. On Ascend `nccl` is verl's
# HCCLCheckpointEngine (it registers that name); there is no `hccl` backend name.
CHECKPOINT_ENGINES = ("naive", "nccl", "nixl", "delta_sharded", "kimi_ckpt_engine", "mooncake")
# verl's trainer entry points: the plain PPO trainer and the server-mode line's experimental ones
# (a rollout pool of its own), each with the YAML merged over ppo_trainer (relative to verl/).
ENTRY_MAIN = "verl.trainer.main_ppo"
ENTRY_EXPERIMENTAL = {
    "verl.experimental.one_step_off_policy.main_ppo":
        ("experimental", "one_step_off_policy", "config", "one_step_off_ppo_trainer.yaml"),
    "verl.experimental.fully_async_policy.fully_async_main":
        ("experimental", "fully_async_policy", "config", "fully_async_ppo_trainer.yaml"),
}
# the dtypes verl hands to vLLM as `rollout.dtype` (vLLM's ModelConfig takes these float types;
# an integer type such as int8 is not a model dtype: INT8 rollouts come from FLASHRL_CONFIG)
ROLLOUT_DTYPES = ("auto", "bfloat16", "bf16", "float16", "fp16", "half", "float32", "fp32", "float")
# the verl releases each config line's rules were read from, for messages
RELEASES = {SYNC: "verl 51d2104", SERVER: "verl 0.9.1"}
# the file verl's server-mode (bucketed IPC) sync lives in
_SERVER_SYNC_FILE = ("workers", "rollout", "vllm_rollout", "bucketed_weight_transfer.py")


def verl_server_mode() -> bool:
    """Does the installed verl run its rollout as a vLLM server fed by bucketed IPC syncs
    (the "0.9" config line), rather than in-process (sync mode, the "51d2104" line)? Decided by
    the file verl's server-mode sync lives in."""
    spec = importlib.util.find_spec("verl")
    if spec is None or not spec.submodule_search_locations:
        return False
    return any(os.path.isfile(os.path.join(d, *_SERVER_SYNC_FILE))
               for d in spec.submodule_search_locations)


def verl_line(name: Optional[str] = None, server_mode=None) -> str:
    """The verl config line: `name` normalised ("0.9.1", "current" -> "0.9"; "0.6.1", "pinned"
    -> "51d2104"), or when None the installed verl's line (the pin's when verl is absent, e.g. a
    recipe generated on a machine without verl; `server_mode`: how to ask, default
    `verl_server_mode`). ValueError names the accepted values."""
    if name is None:
        return SERVER if (server_mode or verl_server_mode)() else SYNC
    try:
        return VERL_ALIASES[str(name).strip().lower()]
    except KeyError:
        raise ValueError(f"verl line {name!r} is not known; use one of {', '.join(VERL_LINES)} "
                         f"(aliases: {', '.join(sorted(VERL_ALIASES))})") from None


def is_server_line(name: str) -> bool:
    """Whether verl config line `name` (normalised by `verl_line`) is the server-mode one."""
    return verl_line(name) == SERVER


# ------------------------------------------------------------------------------ the rules per line
RC = "algorithm.rollout_correction."
WORKER_LOSS = "actor_rollout_ref.actor.policy_loss."

Select = Callable[[str, Any], Any]  # select(dotted_key, default)


def hydra_value(v: Any) -> str:
    if v is None:
        return "null"
    if isinstance(v, bool):
        return "True" if v else "False"
    return str(v)


MISSING = object()


def select(config: Any, dotted: str, default: Any = MISSING) -> Any:
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


def overrides_to_config(overrides) -> Dict[str, Any]:
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
        except (yaml.YAMLError, RecursionError):  # a value nested thousands deep stays a string
            value = raw
        node[parts[-1]] = value
    return out


def _lmhead_fp32(environ: Mapping[str, str], given: Optional[bool]) -> bool:
    if given is not None:
        return given
    from npu_flashrl.config import lmhead_fp32_requested

    return lmhead_fp32_requested(environ)


def _optional(pairs) -> List[str]:
    """`RC<key>=<value>` for the options set (None: not written, verl's default stays)."""
    return [f"{RC}{k}={hydra_value(v)}" for k, v in pairs if v is not None]


def _float(value: Optional[float]) -> Optional[float]:
    return None if value is None else float(value)


class VerlLine:
    """One verl line (see the module doc). Subclasses fill the tables and the rules."""

    name = ""
    KEYS: Tuple[str, ...] = ()  # algorithm.rollout_correction's fields on this line
    FIX = ""  # the combination that works, named in a TisConfigError
    SYNC_MODE_DEFAULT = False  # tis_overrides writes actor_rollout_ref.rollout.mode=sync

    def tis_problems(self, select: Select, missing: Any) -> List[str]:
        """Why this config does no TIS (or does not start) on this line; empty when it works.
        ``select(key, default)`` reads a dotted key, returning ``missing`` when it is absent."""
        raise NotImplementedError

    def rollout_mode_problem(self, select: Callable[[str], Any], environ: Mapping[str, str],
                             lmhead_fp32: Optional[bool] = None) -> Optional[str]:
        """Why this rollout cannot run a FlashRL config (FLASHRL_CONFIG set), or None.
        ``lmhead_fp32``: FLASHRL_LMHEAD_FP32 already read (None: read it from ``environ``)."""
        raise NotImplementedError

    def tis_settings(self, level: Optional[str], bypass_mode: bool,
                     use_policy_gradient: bool) -> Dict[str, Any]:
        """The ``algorithm.rollout_correction`` group `overrides` writes, for `tis_problems`."""
        raise NotImplementedError

    def overrides(self, level: Optional[str], threshold: float, *, batch_normalize, rs,
                  rs_threshold, rs_threshold_lower, token_veto_threshold, bypass_mode: bool,
                  use_policy_gradient: bool, sync_mode: bool) -> List[str]:
        """The ``algorithm.rollout_correction.*`` overrides of decoupled-mode TIS on this line;
        ValueError for an option the line does not have."""
        raise NotImplementedError


class Sync51d2104(VerlLine):
    """verl 51d2104 / 0.6.x: sync (SPMD) rollout, ``use_policy_gradient`` in the TIS schema.

    * ``bypass_mode=True`` with ``rollout_is`` set: the trainer only sets ``old_log_probs =
      rollout_log_probs`` (``apply_rollout_correction``) and skips
      ``compute_rollout_correction_and_add_to_batch``, so no ``rollout_is_weights`` reach the loss.
    * ``use_policy_gradient=True``: the switch to the ``rollout_correction`` loss is written into the
      DRIVER's copy of ``actor.policy_loss`` (and only in bypass mode); the Ray workers built their
      actor config at init, so they keep the PPO-clip loss without IS weights (verl #4912, PR #4930).
    """

    name = "51d2104"
    KEYS = ("rollout_is", "rollout_is_threshold", "rollout_is_batch_normalize", "rollout_rs",
            "rollout_rs_threshold", "rollout_rs_threshold_lower", "rollout_token_veto_threshold",
            "bypass_mode", "use_policy_gradient")
    RS_MODES = ("token", "sequence", "geometric")
    FIX = (f"{RC}bypass_mode=False {RC}use_policy_gradient=False (decoupled mode: truncated IS "
           "weights multiplied into the PPO loss; npu_flashrl.adapters.verl.tis_overrides writes them)")
    SYNC_MODE_DEFAULT = True  # FLASHRL_CONFIG needs rollout.mode=sync on this line

    def tis_problems(self, select: Select, missing: Any) -> List[str]:
        level = select(RC + "rollout_is", None)
        level = None if is_null(level) else str(level)
        problems = []
        if is_true(select(RC + "use_policy_gradient", False)):
            problems.append(
                f"{RC}use_policy_gradient=True: at verl 51d2104 the switch to the policy-gradient loss "
                "is made on the driver's copy of actor.policy_loss only and never reaches the Ray workers, "
                "which keep PPO-clip without IS weights (verl issue #4912)")
        if is_true(select(RC + "bypass_mode", False)) and level is not None:
            problems.append(
                f"{RC}bypass_mode=True with rollout_is={level}: at verl 51d2104 bypass mode computes no "
                "IS weights (ray_trainer.py skips compute_rollout_correction_and_add_to_batch), so the TIS "
                "threshold, level and batch normalisation do nothing")
        return problems

    def rollout_mode_problem(self, select, environ, lmhead_fp32=None) -> Optional[str]:
        mode = select("actor_rollout_ref.rollout.mode")
        if mode is not None and str(mode).strip().lower() == "sync":
            return None
        shown = "unset (verl 51d2104 default: async)" if mode is None else repr(str(mode))
        return (f"FLASHRL_CONFIG is set but actor_rollout_ref.rollout.mode is {shown}: verl's async "
                "rollout never builds vllm.LLM, so the INT8 rollout (and its weight reload) would silently "
                "not be used. Fix: add the override actor_rollout_ref.rollout.mode=sync")

    def tis_settings(self, level, bypass_mode, use_policy_gradient):
        return {"rollout_is": level, "bypass_mode": bool(bypass_mode),
                "use_policy_gradient": bool(use_policy_gradient)}

    def overrides(self, level, threshold, *, batch_normalize, rs, rs_threshold, rs_threshold_lower,
                  token_veto_threshold, bypass_mode, use_policy_gradient, sync_mode):
        if rs not in (None, *self.RS_MODES):
            raise ValueError(f"rs must be None, 'token', 'sequence' or 'geometric', got {rs!r}")
        out = [f"{RC}rollout_is={hydra_value(level)}",
               f"{RC}rollout_is_threshold={float(threshold)!r}",
               f"{RC}bypass_mode={hydra_value(bool(bypass_mode))}",
               f"{RC}use_policy_gradient={hydra_value(bool(use_policy_gradient))}"]
        return out + _optional((("rollout_is_batch_normalize", batch_normalize), ("rollout_rs", rs),
                                ("rollout_rs_threshold", _float(rs_threshold)),
                                ("rollout_rs_threshold_lower", _float(rs_threshold_lower)),
                                ("rollout_token_veto_threshold", _float(token_veto_threshold))))


class Server09(VerlLine):
    """verl 0.7.1 .. 0.9.x: server-mode rollout, ``loss_type`` in the TIS schema.

    * Bypass mode with ``loss_type=ppo_clip`` (verl's default): the weights are computed for
      metrics only (``compute_policy_loss_bypass_mode`` hands ``rollout_is_weights=None`` to
      PPO-clip), so the TIS level and threshold do nothing.
    * Bypass mode with ``loss_type=reinforce``: verl's bypass loss multiplies the weights in, but
      ``apply_bypass_mode`` switches ``loss_mode`` on the DRIVER's copy of ``actor.policy_loss``
      only; the workers keep the loss their config had at start (PPO-clip, no weights in the
      batch). It works only if the workers start with it:
      ``actor_rollout_ref.actor.policy_loss.loss_mode=bypass_mode`` and
      ``+actor_rollout_ref.actor.policy_loss.rollout_correction.{loss_type=reinforce,rollout_is=...}``.
    """

    name = "0.9"
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
    SYNC_MODE_DEFAULT = False  # no sync mode at verl 0.7+

    def tis_problems(self, select: Select, missing: Any) -> List[str]:
        out = []
        for key, instead in self.REMOVED.items():
            if select(RC + key, missing) is not missing:
                out.append(f"{RC}{key} does not exist at verl 0.7+ (verl refuses the key at start); "
                           f"it was replaced by {instead}")
        level = select(RC + "rollout_is", None)
        bypass = is_true(select(RC + "bypass_mode", False))
        loss_type = str(select(RC + "loss_type", None) or "ppo_clip")
        worker_mode = str(select(WORKER_LOSS + "loss_mode", None) or "vanilla")
        if bypass and loss_type not in self.LOSS_TYPES:
            out.append(f"{RC}loss_type={loss_type}: verl's bypass loss takes {' or '.join(self.LOSS_TYPES)}")
        elif bypass and not is_null(level) and loss_type == "ppo_clip":
            out.append(
                f"{RC}bypass_mode=True with loss_type=ppo_clip and rollout_is={level}: verl's bypass "
                "loss computes the IS weights for metrics only (compute_policy_loss_bypass_mode passes "
                "rollout_is_weights=None to PPO-clip), so the TIS level and threshold do nothing")
        elif bypass and not is_null(level):  # reinforce: only if the workers start with that loss
            w_type = select(WORKER_LOSS + "rollout_correction.loss_type", None)
            w_level = select(WORKER_LOSS + "rollout_correction.rollout_is", None)
            if worker_mode != "bypass_mode" or str(w_type) != "reinforce" or is_null(w_level):
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

    def rollout_mode_problem(self, select, environ, lmhead_fp32=None) -> Optional[str]:
        """verl's own quantized rollout next to FLASHRL_CONFIG is refused before any Ray actor
        starts, naming the key to drop; so is FLASHRL_LMHEAD_FP32=1 with verl's fused kernels
        (they bypass lm_head / output_layer), on the FSDP and the Megatron engine alike. A Megatron
        actor is accepted: its engine-side checks run where verl builds it
        (adapters/megatron/engine_patches.py). Server mode is the only mode there: nothing to demand
        of `rollout.mode` (verl itself refuses `sync`)."""
        if _lmhead_fp32(environ, lmhead_fp32) and is_true(select("actor_rollout_ref.model.use_fused_kernels")):
            # verl 0.9's apply_monkey_patch swaps the model's forward for a fused linear+log-prob
            # one after the model is built: lm_head never runs, the fp32 head would do nothing
            return ("FLASHRL_LMHEAD_FP32=1 with actor_rollout_ref.model.use_fused_kernels=True: verl's "
                    "fused kernels (FSDP and Megatron engines) compute the log-probs from lm_head's / "
                    "output_layer's weight without calling it, so the fp32 lm-head would not apply. Fix: actor_rollout_ref.model.use_fused_kernels="
                    "False (verl's default) or FLASHRL_LMHEAD_FP32=0")
        quant = select("actor_rollout_ref.rollout.quantization")
        clash = []
        if not is_null(quant):
            clash.append(f"actor_rollout_ref.rollout.quantization={quant}")
        if is_true(select("actor_rollout_ref.rollout.qat.enable")):
            clash.append("actor_rollout_ref.rollout.qat.enable=true")
        if clash:
            return (f"FLASHRL_CONFIG is set together with {' and '.join(clash)}: verl would quantize "
                    "the rollout itself and npu_flashrl's INT8 W8A8_DYNAMIC rollout cannot apply as well. "
                    f"Fix: drop {' and '.join(c.split('=')[0] for c in clash)} to run npu_flashrl's INT8 "
                    "rollout, or unset FLASHRL_CONFIG to use verl's own")
        return None

    def tis_settings(self, level, bypass_mode, use_policy_gradient):
        rc = {"rollout_is": level, "bypass_mode": bool(bypass_mode)}
        if use_policy_gradient:
            rc["use_policy_gradient"] = True  # refused by tis_problems, naming the replacement
        return rc

    def overrides(self, level, threshold, *, batch_normalize, rs, rs_threshold, rs_threshold_lower,
                  token_veto_threshold, bypass_mode, use_policy_gradient, sync_mode):
        gone = [f"{name} ({RC}{key}; use {self.REMOVED[key]})"
                for name, key, v in (("rs_threshold_lower", "rollout_rs_threshold_lower", rs_threshold_lower),
                                     ("token_veto_threshold", "rollout_token_veto_threshold",
                                      token_veto_threshold))
                if v is not None]
        if gone:
            raise ValueError(f"verl 0.9 has no {', '.join(gone)}")
        if sync_mode:
            raise ValueError("sync_mode=True: verl 0.7+ runs its rollout as a server only (no "
                             "actor_rollout_ref.rollout.mode=sync); leave sync_mode unset")
        if rs is not None:
            bad = [m for m in str(rs).split(",") if m.strip() not in self.RS_MODES]
            if bad:
                raise ValueError(f"rs={rs!r}: verl 0.9's {RC}rollout_rs takes a comma-separated list of "
                                 f"{', '.join(self.RS_MODES)}; not {', '.join(bad)}")
        out = [f"{RC}rollout_is={hydra_value(level)}",
               f"{RC}rollout_is_threshold={float(threshold)!r}",
               f"{RC}bypass_mode=False"]
        return out + _optional((("rollout_is_batch_normalize", batch_normalize), ("rollout_rs", rs),
                                ("rollout_rs_threshold", _float(rs_threshold))))


LINES: Dict[str, VerlLine] = {line.name: line for line in (Sync51d2104(), Server09())}


def for_line(name: str) -> VerlLine:
    """The line `lines.verl_line()` named ("51d2104" or "0.9")."""
    try:
        return LINES[name]
    except KeyError:
        raise ValueError(f"unknown verl line {name!r}; known: {', '.join(LINES)}") from None


def server_versions() -> str:
    """The verl releases the server-mode rules were read from (for patch listings)."""
    return "verl 0.7.1 .. 0.9.1"


def sync_versions() -> str:
    """The verl releases the sync-mode rules were read from (for patch listings)."""
    return "verl 51d2104 / 0.6.1"
