"""vllm-ascend v0.10.1rc1 and 0.11.0: where the W8A8 methods live and which tensors they derive.

Both lines keep the methods in `quantization/w8a8{,_dynamic}.py` and the config in
`quantization/quant_config.py`; what a layout module answers:
- `method_classes()`: the (static, dynamic) W8A8 linear method classes the reload targets;
- `commit_extras(layer)` / `refresh_static(layer)`: the tensors upstream derives from the weight
  scale / bias during post-processing, rewritten after an in-place reload;
- the patches (targets + the line-neutral bodies in `hooks`), named in `PATCHES`.
"""
from __future__ import annotations

import importlib

import torch

from npu_flashrl import compat, kernels, patches
from npu_flashrl._logging import get_logger
from npu_flashrl.adapters.vllm_ascend import hooks

logger = get_logger("vllm_ascend")

NAME = "011"
DYNAMIC_PWAL = "vllm_ascend.quantization.w8a8_dynamic:AscendW8A8DynamicLinearMethod.process_weights_after_loading"
STATIC_PWAL = "vllm_ascend.quantization.w8a8:AscendW8A8LinearMethod.process_weights_after_loading"
OVERRIDE_TARGET = "vllm_ascend.quantization.quant_config:AscendQuantConfig.override_quantization_method"
_VERSIONS = "vllm-ascend " + ", ".join(compat.SUPPORTED_VLLM_ASCEND)


def method_classes():
    """(static, dynamic) W8A8 linear method classes."""
    _, static_cls, dynamic_cls = compat.quant_method_classes()
    return static_cls, dynamic_cls


def linear_wrapper_class():
    """vllm-ascend's LinearMethodBase adapter; `layer.quant_method.quant_method` is the scheme."""
    return compat.quant_method_classes()[0]


def unsupported_reason(inner) -> str:
    """Why the online reload cannot serve a vllm-ascend linear scheme other than W8A8/W8A8_DYNAMIC."""
    cls = type(inner)
    if cls.__name__.startswith("Torchair") or cls.__module__.startswith("vllm_ascend.torchair"):
        # Same [in, out] + NZ layout as the eager method, but its post-processing is not made
        # run-once here and graph capture of in-place weight updates is unverified: refuse.
        return (f"{cls.__name__} is torchair graph mode's W8A8 layer, which npu_flashrl's online "
                "INT8 reload does not support; build the rollout engine without torchair graph "
                "mode (additional_config torchair_graph_config.enabled=false, the default)")
    return (f"{cls.__name__} is not a W8A8 scheme npu_flashrl can reload (supported: "
            "AscendW8A8LinearMethod, AscendW8A8DynamicLinearMethod); float weights pushed into "
            "it would be truncated")


def quant_config_class():
    compat.import_quantization()
    return importlib.import_module("vllm_ascend.quantization.quant_config").AscendQuantConfig


@torch.no_grad()
def commit_extras(layer) -> None:
    """After a new weight_scale was written: the copies vllm-ascend derives from it."""
    fp32 = getattr(layer, "weight_scale_fp32", None)
    if isinstance(fp32, torch.Tensor):
        # vllm-ascend derives it from the param-dtype scale; keep that relation.
        fp32.copy_(layer.weight_scale.data.to(torch.float32))
    layer.weight_offset.data.zero_()


@torch.no_grad()
def refresh_static(layer) -> None:
    """Static W8A8: deq_scale = input_scale * weight_scale, and the float bias folded into
    quant_bias (vllm-ascend adds quant_bias to the int32 accumulator and ignores `bias`)."""
    deq = (layer.input_scale.data.float() * layer.weight_scale.data.float()).flatten()
    if layer.deq_scale.dtype == torch.int64:
        deq_store = deq.view(torch.int32).to(torch.int64) & 0xFFFFFFFF
    else:
        deq_store = deq.to(layer.deq_scale.dtype)
    layer.deq_scale.data.copy_(deq_store)
    layer.quant_bias.data.copy_(static_quant_bias(layer, deq))


def static_quant_bias(layer, deq: torch.Tensor) -> torch.Tensor:
    """int32 bias for AscendW8A8LinearMethod: out = (x_q @ W_q + quant_bias) * deq_scale with
    x_q = round(x / input_scale + input_offset), so
    quant_bias = round(bias / deq_scale) - input_offset * sum_k W_q[:, k]."""
    w = layer.weight.data  # processed [in, out]
    wsum = w.to(torch.int64).sum(dim=0)
    offset = int(layer.input_offset.data.flatten()[0].item())
    bias = getattr(layer, "bias", None)
    fb = torch.zeros_like(deq) if bias is None else torch.round(bias.data.float() / deq)
    return (fb.to(torch.int64) - offset * wsum).to(torch.int32)


@torch.no_grad()
def fold_checkpoint_bias(layer) -> None:
    bias = getattr(layer, "bias", None)
    if bias is None or not bool(bias.data.abs().sum() > 0):
        return
    if bool(layer.quant_bias.data.abs().sum() > 0):
        return  # the exporter (ModelSlim) already folded the bias into quant_bias
    deq = kernels.reference.decode_deq_scale(layer.deq_scale.data).flatten()
    layer.quant_bias.data.copy_(static_quant_bias(layer, deq))
    logger.debug("npu_flashrl: folded float bias into quant_bias of %s",
                 getattr(layer, "prefix", type(layer).__name__))


# --------------------------------------------------------------------------- patches

@patches.register("ascend_w8a8_dynamic_process_once", DYNAMIC_PWAL, _VERSIONS,
                  "post-processing runs once per layer and marks its [in,out] layout")
def _apply_dynamic_once():
    compat.import_quantization()
    patches.replace(DYNAMIC_PWAL, lambda orig: hooks.process_once(orig))


@patches.register("ascend_w8a8_static_process_once", STATIC_PWAL, _VERSIONS,
                  "post-processing runs once per layer; float bias folded into quant_bias")
def _apply_static_once():
    compat.import_quantization()
    patches.replace(STATIC_PWAL, lambda orig: hooks.process_once(orig, after=fold_checkpoint_bias))


@patches.register("ascend_quant_description", compat.GET_QUANT_CONFIG_TARGET, "vllm 0.10.1, 0.11.0",
                  "bf16 and compressed-tensors w8a8 checkpoints load on vllm-ascend W8A8_DYNAMIC")
def _apply_redirect():
    compat.check_vllm_ascend()
    compat.import_quantization()
    patches.replace(compat.GET_QUANT_CONFIG_TARGET, lambda orig: hooks.redirect(orig, quant_config_class))


@patches.register("ascend_claims_compressed_tensors", OVERRIDE_TARGET, _VERSIONS,
                  "compressed-tensors w8a8 checkpoints go to 'ascend' on any platform that runs it")
def _apply_override():
    compat.import_quantization()
    patches.replace(OVERRIDE_TARGET, hooks.override)


@patches.register("model_loader_int8_load_weights", compat.INITIALIZE_MODEL_TARGET, "vllm 0.10.1, 0.11.0",
                  "models built while active get the INT8 online-quantizing load_weights")
def _apply_attach():
    patches.replace(compat.INITIALIZE_MODEL_TARGET, hooks.attach_on_init)


PATCHES = ("ascend_w8a8_dynamic_process_once", "ascend_w8a8_static_process_once",
           "ascend_quant_description", "ascend_claims_compressed_tensors",
           "model_loader_int8_load_weights")
