"""vllm-ascend 0.23.0 (with vLLM 0.23): where the W8A8 schemes live and which tensors they derive.

What changed against `layout_011` (read from the v0.23.0 sources):
- the schemes moved to `quantization/methods/w8a8_{dynamic,static}.py` (a registry,
  `get_scheme_class`); `method_adapters.AscendLinearMethod(scheme)` wraps them for vLLM, so
  `layer.quant_method.quant_method` is still the scheme;
- the "ascend" config is `modelslim_config.AscendModelSlimConfig`; `get_config_filenames()` is
  `[]` and the description is read in `maybe_update_config`, which returns early only for a
  truthy description, and `apply_vllm_mapper` rebuilds it as a plain dict. `describe_checkpoint`
  therefore lists every checkpoint weight explicitly (no rule-only, empty-looking description);
- `override_quantization_method(hf_quant_cfg, user_quant, hf_config=...)` (hooks.override
  passes extra arguments through);
- NZ is decided by `utils.maybe_trans_nz` from `get_ascend_config().weight_nz_mode`
  (compat.nz_enabled); the schemes hold no version or NZ checks;
- static W8A8 from compressed-tensors (`layer.ascend_quant_method == "compressed-tensors"`)
  adds the float `bias` after scaling and derives a float `deq_scale`; ModelSlim's static W8A8
  still adds the int32 `quant_bias` to the accumulator;
- vLLM's own layerwise reload (`model_loader/reload/layerwise.py`) puts a layer back into its
  checkpoint layout ([out, in] int8, [out, 1] scales) and calls post-processing again: the
  run-once guard must let that call through, so "processed" is read from the layer itself.
"""
from __future__ import annotations

import importlib

import torch

from npu_flashrl import compat, patches
from npu_flashrl.adapters.vllm_ascend import derived, hooks

NAME = "023"
_M = "vllm_ascend.quantization"
DYNAMIC_PWAL = f"{_M}.methods.w8a8_dynamic:AscendW8A8DynamicLinearMethod.process_weights_after_loading"
STATIC_PWAL = f"{_M}.methods.w8a8_static:AscendW8A8LinearMethod.process_weights_after_loading"
MOE_PWAL = f"{_M}.methods.w8a8_dynamic:AscendW8A8DynamicFusedMoEMethod.process_weights_after_loading"
OVERRIDE_TARGET = f"{_M}.modelslim_config:AscendModelSlimConfig.override_quantization_method"
COMPRESSED_TENSORS = "compressed-tensors"  # vllm_ascend.utils.COMPRESSED_TENSORS_METHOD
_VERSIONS = "vllm-ascend 0.23.0"

commit_extras = derived.commit_extras


@torch.no_grad()
def commit_moe_extras(layer) -> None:
    """The fp32 w13 scale, and with `enable_fused_mc2` the int64 bit patterns of both scales
    (`fused_w1_scale` / `fused_w2_scale`), derived with vllm-ascend's own converter."""
    derived.commit_moe_extras(layer)
    for which, name in (("w13", "fused_w1_scale"), ("w2", "fused_w2_scale")):
        fused = getattr(layer, name, None)
        if isinstance(fused, torch.Tensor):
            convert = importlib.import_module(DYNAMIC_PWAL.split(":")[0]).scale_from_float_to_int64
            fused.copy_(convert(getattr(layer, f"{which}_weight_scale").data).view(fused.shape))


def method_classes():
    """(static, dynamic) W8A8 linear scheme classes."""
    _, static_cls, dynamic_cls = compat.quant_method_classes()
    return static_cls, dynamic_cls


def linear_wrapper_class():
    """vllm-ascend's LinearMethodBase adapter (`method_adapters.AscendLinearMethod`);
    `layer.quant_method.quant_method` is the scheme."""
    return compat.quant_method_classes()[0]


def unsupported_reason(inner) -> str:
    """Why the online reload cannot serve a vllm-ascend linear scheme other than W8A8 /
    W8A8_DYNAMIC (0.23 has no torchair graph mode)."""
    return (f"{type(inner).__name__} is not a W8A8 scheme npu_flashrl can reload (supported: "
            "AscendW8A8LinearMethod, AscendW8A8DynamicLinearMethod); float weights pushed into "
            "it would be truncated")


def quant_config_class():
    return compat.quant_config_class()


def is_processed(layer) -> bool:
    """The layer holds post-processed tensors: marked by the guard and not put back into the
    checkpoint layout since (vLLM's layerwise reload restores [out, 1] scales)."""
    scale = getattr(layer, "weight_scale", None)
    dims = 1  # linear: [out]; fused MoE: [E, 2I] (restored: [E, 2I, 1])
    if scale is None:
        scale, dims = getattr(layer, "w13_weight_scale", None), 2
    return bool(getattr(layer, "_npu_flashrl_processed", False)) and \
        isinstance(scale, torch.Tensor) and scale.dim() == dims and not scale.is_meta


def _from_compressed_tensors(layer) -> bool:
    return getattr(layer, "ascend_quant_method", "") == COMPRESSED_TENSORS


@torch.no_grad()
def refresh_static(layer) -> None:
    """Static W8A8 after a new weight scale / bias: the derived deq_scale, and for a ModelSlim
    layer the int32 quant_bias (the compressed-tensors variant adds the float bias itself)."""
    if _from_compressed_tensors(layer):
        deq = layer.input_scale.data * layer.weight_scale.data  # as its post-processing does
        layer.deq_scale.data.copy_(deq.to(layer.deq_scale.dtype))
        return
    derived.refresh_static(layer)


def _fold_checkpoint_bias(layer) -> None:
    if not _from_compressed_tensors(layer):
        derived.fold_checkpoint_bias(layer)


def _process_once(original, after=None):
    """hooks.process_once, except that a layer vLLM's layerwise reload put back into the
    checkpoint layout is processed again (otherwise the reload copies [out, in] data into the
    [in, out] storage and fails on the size)."""
    once = hooks.process_once(original, after=after)

    def process_weights_after_loading(self, layer):
        if not is_processed(layer):
            layer._npu_flashrl_processed = False
        return once(self, layer)
    return process_weights_after_loading


def _import_quantization():
    compat.import_quantization()
    importlib.import_module(DYNAMIC_PWAL.split(":")[0])
    importlib.import_module(STATIC_PWAL.split(":")[0])


# --------------------------------------------------------------------------- patches

@patches.register("ascend_w8a8_dynamic_process_once", DYNAMIC_PWAL, _VERSIONS,
                  "post-processing runs once per layer (again after vLLM's layerwise restore)")
def _apply_dynamic_once():
    _import_quantization()
    patches.replace(DYNAMIC_PWAL, _process_once)


@patches.register("ascend_w8a8_static_process_once", STATIC_PWAL, _VERSIONS,
                  "post-processing runs once per layer; ModelSlim float bias folded into quant_bias")
def _apply_static_once():
    _import_quantization()
    patches.replace(STATIC_PWAL, lambda orig: _process_once(orig, after=_fold_checkpoint_bias))


@patches.register("ascend_w8a8_dynamic_moe_process_once", MOE_PWAL, _VERSIONS,
                  "fused-MoE post-processing runs once per layer (again after vLLM's layerwise restore)")
def _apply_moe_once():
    _import_quantization()
    patches.replace(MOE_PWAL, _process_once)


hooks.declare_shared_patches(quant_config_class, OVERRIDE_TARGET, "vllm 0.23.0", _VERSIONS)

PATCHES = ("ascend_w8a8_dynamic_process_once", "ascend_w8a8_static_process_once",
           "ascend_w8a8_dynamic_moe_process_once",
           "ascend_quant_description", "ascend_claims_compressed_tensors",
           "model_loader_int8_load_weights")
