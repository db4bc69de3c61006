"""server-mode verl's Megatron / MindSpeed engine (current line): the trainer-side checks and the FP32
lm-head, on the engine classes (server-mode verl has no ``workers/megatron_workers.py``).

Read from server-mode verl ``verl/workers/engine/megatron/transformer_impl.py``: ``MegatronEngine.__init__``
calls ``_init_device_mesh`` (megatron-core's ``initialize_model_parallel``); on NPU the registered
engine is ``MindspeedEngineWithLMHead`` (``workers/engine/mindspeed/transformer_impl.py``), whose
``_init_device_mesh`` first runs MindSpeed's ``repatch(override_transformer_config)``, which
re-applies MindSpeed's patches to Megatron modules. ``initialize()`` then builds the model
(``_build_megatron_module``: the bridge's ``get_model`` + weight load), applies verl's fused forward
when ``use_fused_kernels`` (``_maybe_enable_fused_kernels`` -> ``patch_fused_forward``, which feeds
``output_layer.weight`` to a fused linear-cross-entropy and never calls ``output_layer``). The
rollout gets ``get_per_tensor_param()``: HF names, full tensors (mbridge ``export_weights`` or
Megatron-Bridge ``export_hf_weights``), through the same bucketed sync as FSDP.

Patches (applied without importing verl's engine module: they wait for its import):

* ``megatron_engine_checks`` on ``MegatronEngine.__init__`` (every subclass: the LM-head, value-head
  and MindSpeed engines), before verl's ``_init_device_mesh`` and so before ``repatch``: the strict
  MindSpeed check (``ensure_mindspeed_before_megatron``: missing on NPU, imported after Megatron,
  broken), ``FLASHRL_LMHEAD_FP32=1`` with ``use_fused_kernels=True`` refused
  (``FusedKernelsConflict``), an INT8 rollout of an architecture the INT8 reload does not handle
  refused (``UnsupportedArchitectureError``, named), a WARNING for Megatron-Bridge (verified on CPU
  with mbridge only).
* ``megatron_engine_lmhead_fp32`` on ``MegatronEngine._build_megatron_module``: with
  ``FLASHRL_LMHEAD_FP32=1``, every model chunk's ``output_layer`` gets the fp32 instance forward
  (``enable_fp32_output_layer``) right after the model is built. That is after ``repatch`` and
  on the instance, so MindSpeed's class-level re-patching neither removes it nor is bypassed by
  it (the instance forward calls the class forward, MindSpeed's if it patched it).
"""
from __future__ import annotations

import os
from typing import Any, Optional

from npu_flashrl import lines, patches
from npu_flashrl.adapters.megatron._common import logger, when_imported
from npu_flashrl.adapters.megatron.import_guard import ensure_mindspeed_before_megatron
from npu_flashrl.adapters.megatron.output_layer import FusedKernelsConflict, enable_fp32_output_layer
from npu_flashrl.adapters.megatron.stream import (DENSE_ARCHITECTURES, UnsupportedArchitectureError,
                                                  architecture)
from npu_flashrl.config import lmhead_fp32_requested
from npu_flashrl.patches import register

ENGINE_MODULE = "verl.workers.engine.megatron.transformer_impl"
PATCH_ENGINE_CHECKS = "megatron_engine_checks"
PATCH_ENGINE_LMHEAD = "megatron_engine_lmhead_fp32"
ENGINE_PATCHES = (PATCH_ENGINE_CHECKS, PATCH_ENGINE_LMHEAD)
# what the current line's INT8 reload takes from server-mode verl's engine (tests/adapters/verl/test_verl_server.py,
# tests/adapters/megatron/test_megatron_engine.py)
INT8_ARCHITECTURES = DENSE_ARCHITECTURES + ("Qwen3MoeForCausalLM",)
VERIFIED_BRIDGE = "mbridge (vanilla_mbridge=True)"


def _engine_device() -> Optional[str]:
    try:
        from verl.utils.device import is_npu_available
    except Exception:  # noqa: BLE001
        return None
    return "npu" if is_npu_available else "cpu"


def _flag(value: Any) -> bool:
    return value is True or str(value).strip().lower() == "true"


def _int8_requested(environ) -> bool:
    path = (environ.get("FLASHRL_CONFIG") or "").strip()
    if not path:
        return False
    try:
        from npu_flashrl.config import is_quantized, load_config

        return any(is_quantized(e) for e in load_config(path).entries)
    except Exception:  # noqa: BLE001 - an unreadable config is reported by activation; be strict
        return True


def check_engine(model_config: Any, engine_config: Any, environ=None) -> None:
    """The set-up checks of one Megatron engine (module doc); raises on a refused combination."""
    env = os.environ if environ is None else environ
    if lmhead_fp32_requested(env) and _flag(getattr(engine_config, "use_fused_kernels", False)):
        raise FusedKernelsConflict(
            "FLASHRL_LMHEAD_FP32=1 with use_fused_kernels=True on verl's Megatron engine: "
            "_maybe_enable_fused_kernels installs verl's fused forward (verl/models/mcore/"
            "model_forward_fused.py), which computes log-probs from output_layer.weight and never "
            "calls output_layer, so npu_flashrl's fp32 lm-head would not apply. Set "
            "actor_rollout_ref.model.use_fused_kernels=False (verl's default) or FLASHRL_LMHEAD_FP32=0")
    hf_config = getattr(model_config, "hf_config", None)
    if hf_config is not None and _int8_requested(env):
        archs = list(getattr(hf_config, "architectures", None) or [])
        if not archs or not all(a in INT8_ARCHITECTURES for a in archs):
            raise UnsupportedArchitectureError(
                f"INT8 rollout does not support {architecture(hf_config)} with verl's Megatron "
                f"engine: npu_flashrl's online INT8 weight reload handles "
                f"{', '.join(INT8_ARCHITECTURES)}. Use a bf16 rollout for this model "
                "(FLASHRL_CONFIG=bf16, or unset FLASHRL_CONFIG)")
    if getattr(engine_config, "use_mbridge", True) and not _flag(
            getattr(engine_config, "vanilla_mbridge", False)):
        logger.warning(
            "npu_flashrl: verl's Megatron engine exports through Megatron-Bridge "
            "(export_hf_weights, vanilla_mbridge=False); npu_flashrl verified the INT8 sync on CPU "
            "with %s only. The INT8 reload still checks every tensor's name, shape and "
            "completeness per sync", VERIFIED_BRIDGE)


def _wrap_init(original):
    def __init__(self, model_config, engine_config, *args, **kwargs):
        ensure_mindspeed_before_megatron(_engine_device())
        check_engine(model_config, engine_config)
        return original(self, model_config, engine_config, *args, **kwargs)

    __init__.__wrapped__ = original
    return __init__


def _unwrap(chunk):
    # DDP / Float16Module wrappers keep the GPT model in .module
    seen = 0
    while hasattr(chunk, "module") and seen < 8 and not hasattr(chunk, "output_layer"):
        chunk, seen = chunk.module, seen + 1
    return chunk


def enable_on_chunks(chunks) -> int:
    """fp32 output_layer on every model chunk that has one (the last PP stage); how many."""
    return sum(bool(enable_fp32_output_layer(_unwrap(c))) for c in chunks)


def _wrap_build(original):
    def _build_megatron_module(self, *args, **kwargs):
        module = original(self, *args, **kwargs)
        if lmhead_fp32_requested() and not getattr(self, "is_value_model", False):
            n = enable_on_chunks(module)
            logger.debug("FP32 output_layer on %d of %d Megatron model chunks", n, len(module))
        return module

    _build_megatron_module.__wrapped__ = original
    return _build_megatron_module


@register(PATCH_ENGINE_CHECKS, f"{ENGINE_MODULE}:MegatronEngine.__init__", lines.versions("verl", verl_mode="server"),
          doc="server-mode verl Megatron/MindSpeed engine: MindSpeed before Megatron (error on NPU "
              "without it), FLASHRL_LMHEAD_FP32 + use_fused_kernels and INT8 of unsupported "
              "architectures refused by name")
def _apply_checks() -> None:
    when_imported(ENGINE_MODULE, lambda _m: patches.replace(
        f"{ENGINE_MODULE}:MegatronEngine.__init__", _wrap_init))


@register(PATCH_ENGINE_LMHEAD, f"{ENGINE_MODULE}:MegatronEngine._build_megatron_module",
          lines.versions("verl", verl_mode="server"),
          doc="FLASHRL_LMHEAD_FP32 on server-mode verl's Megatron engine: fp32 output_layer on every "
              "model chunk once built (after MindSpeed's repatch)")
def _apply_lmhead() -> None:
    when_imported(ENGINE_MODULE, lambda _m: patches.replace(
        f"{ENGINE_MODULE}:MegatronEngine._build_megatron_module", _wrap_build))
