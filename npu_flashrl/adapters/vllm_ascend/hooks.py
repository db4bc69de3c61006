"""The bodies of the vllm-ascend patches every line shares, line-neutral: the installed line
(`npu_flashrl.lines`, `StackLine.patches`) wraps its own targets with them; the run-once guard is
the line's own (`StackLine.process_once`).

All of them act on the policy rollout only, the engine whose config carries an INT8
`EngineChoice` (`adapters.engine_choice`); every other engine in the process (a reward or
teacher model, a user's own) is built and loaded exactly as vLLM / vllm-ascend would:
- `override`: a compressed-tensors checkpoint goes to vllm-ascend's "ascend" method only while
  the policy engine's config is built, and only because that engine asked for "ascend";
- `redirect`: bf16 / compressed-tensors checkpoints get an in-memory quant description (same);
- `attach_on_init`: the policy's INT8 model gets the quantizing `load_weights`, and its layers
  are marked as the policy's;
- `StackLine.process_once` (the line's run-once guard) acts on layers marked `POLICY_ATTR` only.
"""
from __future__ import annotations

import functools
import os
from typing import Callable, Optional, Tuple

import torch

from npu_flashrl._logging import get_logger
from npu_flashrl.adapters import engine_choice
from npu_flashrl.adapters.vllm_ascend.description import checkpoint_is_quantized, describe_checkpoint
from npu_flashrl.adapters.vllm_ascend.reload import attach
from npu_flashrl.errors import UnquantizedRolloutError
from npu_flashrl.lines.base import POLICY_ATTR  # set on every module of the policy rollout's model
from npu_flashrl.quant import make_quantizer
from npu_flashrl.quant.registry import quantizer_class

logger = get_logger(__name__)



def redirect(original, quant_config_class: Callable[[], type]):
    def get_quant_config(model_config, load_config):
        if model_config.quantization == "ascend" and engine_choice.policy_in_build():
            desc = describe_checkpoint(model_config.model, **description_kind(
                engine_choice.choice_in_build()))
            if desc is not None:
                logger.info("npu_flashrl: %s -> vllm-ascend %s layers (%s description)",
                            model_config.model, desc.rule_quantized, desc.source)
                return quant_config_class()(desc)
        return original(model_config, load_config)
    return get_quant_config


def description_kind(choice) -> dict:
    """What a bare bf16 checkpoint's in-memory description says for the engine's choice: the
    quant type its quantizer serves, with that quantizer's top-level keys (W4A8: `group_size`;
    asked for a bare bf16 checkpoint only: W4A8's per-channel `group_size` 0 refuses one)."""
    cls = quantizer_class(choice.fn)
    return {"quant_type": cls.description_type,
            "top_level": functools.partial(cls.description_keys, getattr(choice, "group_size", None))}


def override(original):
    def override_quantization_method(cls, hf_quant_cfg, user_quant, *args, **kwargs):
        # extra arguments: the newest vLLM line (lines.v0_23_0) also passes hf_config=
        chosen = original(hf_quant_cfg, user_quant, *args, **kwargs)
        # Only the policy engine, whose args npu_flashrl set to "ascend" (vllm_engine.apply_entry):
        # any other engine keeps vllm-ascend's own compressed-tensors method (policy only).
        if chosen is None and user_quant == "ascend" and engine_choice.policy_in_build() \
                and isinstance(hf_quant_cfg, dict) \
                and hf_quant_cfg.get("quant_method") == "compressed-tensors":
            from vllm.platforms import current_platform

            if "ascend" in (getattr(current_platform, "supported_quantization", None) or []):
                return "ascend"  # e.g. the CPU rehearsal, where torch.npu is not available
        return chosen
    override_quantization_method.__npu_flashrl_original__ = original
    return classmethod(override_quantization_method)


def online_choice(vllm_config) -> Tuple[Optional[str], Optional[dict]]:
    """(fn, profile) of the INT8 policy model built under `vllm_config`, from the engine's own
    `EngineChoice` (written where the engine args were built and pickled by vLLM to every process
    it starts, e.g. the mp workers of server-mode verl); (None, None) for any other engine."""
    choice = engine_choice.engine_choice(vllm_config)
    if choice is None or not choice.quantized:
        return None, None
    profile = None
    if choice.profile:
        from npu_flashrl.profile import load_profile

        profile = load_profile(choice.profile)
    return choice.fn, profile


def choice_options(vllm_config) -> dict:
    """The entry's quantizer options the engine's choice carries (`group_size`), those set only."""
    choice = engine_choice.engine_choice(vllm_config)
    size = getattr(choice, "group_size", None)
    return {} if size is None else {"group_size": size}


def _mark_policy(model) -> None:
    for module in model.modules():
        setattr(module, POLICY_ATTR, True)


def attach_on_init(original):
    def initialize_model(*args, **kwargs):
        model = original(*args, **kwargs)
        vllm_config = kwargs.get("vllm_config") or (args[0] if args else None)
        model_config = getattr(vllm_config, "model_config", None)
        fn, profile = online_choice(vllm_config)
        from npu_flashrl.adapters import vllm_engine

        vllm_engine.refuse_if_patches_failed(vllm_engine.current_config(), "the model build")
        if fn is None:
            return model  # not the INT8 policy rollout: vLLM's own model and loader
        if getattr(model_config, "quantization", None) != "ascend":  # no silent bf16 rollout
            raise UnquantizedRolloutError(
                f"npu_flashrl: the engine was configured for INT8 ({fn}) but "
                f"{type(model).__name__} was built with quantization="
                f"{getattr(model_config, 'quantization', None)!r}: it would run unquantized. "
                "Something replaced the engine's quantization after npu_flashrl set it; "
                "unset FLASHRL_CONFIG or remove the other quantization setting")
        # The quantizing loader: a float tensor pushed into vllm-ascend's int8 parameters would
        # otherwise be truncated silently.
        _mark_policy(model)  # before vLLM's post-processing of the loaded weights
        dtype = getattr(model_config, "dtype", torch.bfloat16)
        model_dir = getattr(model_config, "model", None)
        prequantized = bool(model_dir) and os.path.isdir(model_dir) and checkpoint_is_quantized(model_dir)
        loader = attach(model, make_quantizer(fn, dtype, profile, **choice_options(vllm_config)), prequantized)
        if not loader.targets and not loader.experts:  # (a W4A8 per-channel model: experts only)
            raise UnquantizedRolloutError(
                f"npu_flashrl: FLASHRL_CONFIG asks for a quantized rollout ({fn}) but "
                f"{type(model).__name__} has no vllm-ascend quantized linear or fused-MoE layers: "
                "the rollout would run unquantized. "
                "Check the checkpoint's quant description (every projection FLOAT?)")
        return model
    return initialize_model
