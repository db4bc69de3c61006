"""The bodies of the vllm-ascend patches, line-neutral: each layout module (`layout_011`, ...)
registers them against its own line's targets.

- `process_once`: W8A8 post-processing runs once per layer (a second run would re-transpose).
- `redirect`: bf16 / compressed-tensors checkpoints get an in-memory quant description.
- `attach_on_init`: every INT8 model vLLM builds gets the quantizing `load_weights`.
"""
from __future__ import annotations

import os
from typing import Callable, Dict, Optional

import torch

from npu_flashrl._logging import get_logger
from npu_flashrl.adapters.vllm_ascend.description import checkpoint_is_quantized, describe_checkpoint
from npu_flashrl.adapters.vllm_ascend.reload import attach
from npu_flashrl.quant import PerChannelQuantizer, make_quantizer

logger = get_logger(__name__)

# Set by `vllm_engine.apply_entry` in the process that builds the engine; read when vLLM builds
# the model only if the engine's config carries no choice of its own (`online_choice`).
_online: Dict[str, object] = {"fn": None, "profile": None}


def configure_online_quantization(fn: Optional[str], profile: Optional[dict] = None) -> None:
    """Which quantizer models built from now on get (None: leave models unquantized)."""
    _online.update(fn=fn, profile=profile)


def process_once(original, after: Optional[Callable] = None):
    def process_weights_after_loading(self, layer):
        # Upstream transposes and re-allocates on every call: a second call would corrupt the
        # layer, so run it once per layer and remember that the layout is now [in, out].
        if getattr(layer, "_npu_flashrl_processed", False):
            return
        original(self, layer)
        if after is not None:
            after(layer)
        layer._npu_flashrl_processed = True
    return process_weights_after_loading


def redirect(original, quant_config_class: Callable[[], type]):
    def get_quant_config(model_config, load_config):
        if model_config.quantization == "ascend":
            desc = describe_checkpoint(model_config.model)
            if desc is not None:
                logger.info("npu_flashrl: %s -> vllm-ascend %s layers (%s description)",
                            model_config.model, desc.rule_quantized, desc.source)
                return quant_config_class()(desc)
        return original(model_config, load_config)
    return get_quant_config


def override(original):
    def override_quantization_method(cls, hf_quant_cfg, user_quant, *args, **kwargs):
        # extra arguments: vLLM 0.23 also passes hf_config=
        chosen = original(hf_quant_cfg, user_quant, *args, **kwargs)
        if chosen is None and user_quant in (None, "ascend") and isinstance(hf_quant_cfg, dict) \
                and hf_quant_cfg.get("quant_method") == "compressed-tensors":
            from vllm.platforms import current_platform

            if "ascend" in (getattr(current_platform, "supported_quantization", None) or []):
                return "ascend"  # e.g. the CPU rehearsal, where torch.npu is not available
        return chosen
    override_quantization_method.__npu_flashrl_original__ = original
    return classmethod(override_quantization_method)


def online_choice(vllm_config):
    """(fn, profile, required) for a model built under `vllm_config`. The engine's own choice
    (`additional_config["npu_flashrl"]`, written where the engine args were built and pickled by
    vLLM to every process it starts, e.g. verl 0.9's mp workers) wins over this process's
    `configure_online_quantization` (one-process engines, tests, rehearsal)."""
    from npu_flashrl.adapters import vllm_engine

    choice = vllm_engine.engine_choice(vllm_config)
    if choice is None:
        return _online["fn"], _online["profile"], False
    if not choice.get("quantized"):
        return None, None, False
    profile = None
    if choice.get("profile"):
        from npu_flashrl.profile import load_profile

        profile = load_profile(choice["profile"])
    return choice.get("fn"), profile, True


def attach_on_init(original):
    def initialize_model(*args, **kwargs):
        model = original(*args, **kwargs)
        vllm_config = kwargs.get("vllm_config") or (args[0] if args else None)
        model_config = getattr(vllm_config, "model_config", None)
        fn, profile, required = online_choice(vllm_config)
        if getattr(model_config, "quantization", None) != "ascend":
            if required:  # no silent bf16 rollout
                raise RuntimeError(
                    f"npu_flashrl: the engine was configured for INT8 ({fn}) but "
                    f"{type(model).__name__} was built with quantization="
                    f"{getattr(model_config, 'quantization', None)!r}: it would run unquantized. "
                    "Something replaced the engine's quantization after npu_flashrl set it; "
                    "unset FLASHRL_CONFIG or remove the other quantization setting")
            if fn:
                logger.warning("npu_flashrl: INT8 function %s is configured but the model was "
                               "built with quantization=%r; it will run unquantized", fn,
                               getattr(model_config, "quantization", None))
            return model
        # Every INT8 model gets the quantizing loader: a float tensor pushed into vllm-ascend's
        # int8 parameters would otherwise be truncated silently. Without a configured function,
        # reloads use fresh per-channel scales.
        dtype = getattr(model_config, "dtype", torch.bfloat16)
        model_dir = getattr(model_config, "model", None)
        prequantized = bool(model_dir) and os.path.isdir(model_dir) and checkpoint_is_quantized(model_dir)
        loader = attach(model, make_quantizer(fn or PerChannelQuantizer.name, dtype, profile),
                        prequantized)
        if not loader.targets:
            if required:
                raise RuntimeError(
                    f"npu_flashrl: FLASHRL_CONFIG asks for INT8 ({fn}) but {type(model).__name__} "
                    "has no vllm-ascend W8A8 linear layers: the rollout would run unquantized. "
                    "Check the checkpoint's quant description (every projection FLOAT?)")
            logger.warning("npu_flashrl: %s has no vllm-ascend W8A8 linear layers; nothing to "
                           "quantize", type(model).__name__)
        return model
    return initialize_model


def declare_shared_patches(quant_config_class: Callable[[], type], override_target: str,
                           vllm_versions: str, ascend_versions: str) -> None:
    """Declare the three patches whose bodies are the same on every line (a layout module calls
    this with its own targets): the quant-description redirect, the compressed-tensors override
    and the INT8 loader attached at model build."""
    from npu_flashrl import compat, patches

    @patches.register("ascend_quant_description", compat.GET_QUANT_CONFIG_TARGET, vllm_versions,
                      "bf16 and compressed-tensors w8a8 checkpoints load on vllm-ascend W8A8_DYNAMIC")
    def _apply_redirect():
        compat.check_vllm_ascend()
        compat.import_quantization()
        patches.replace(compat.GET_QUANT_CONFIG_TARGET, lambda orig: redirect(orig, quant_config_class))

    @patches.register("ascend_claims_compressed_tensors", override_target, ascend_versions,
                      "compressed-tensors w8a8 checkpoints go to 'ascend' on any platform that runs it")
    def _apply_override():
        compat.import_quantization()
        patches.replace(override_target, override)

    @patches.register("model_loader_int8_load_weights", compat.INITIALIZE_MODEL_TARGET, vllm_versions,
                      "models built while active get the INT8 online-quantizing load_weights")
    def _apply_attach():
        patches.replace(compat.INITIALIZE_MODEL_TARGET, attach_on_init)
