"""vllm-ascend v0.10.1rc1 and 0.11.0: where the W8A8 methods live and which tensors they derive.

Both lines keep the methods in `quantization/w8a8{,_dynamic}.py` and the config in
`quantization/quant_config.py`; what a layout module answers:
- `method_classes()`: the (static, dynamic) W8A8 linear method classes the reload targets;
- `commit_extras(layer)` / `refresh_static(layer)`: the tensors upstream derives from the weight
  scale / bias during post-processing, rewritten after an in-place reload;
- the patches (targets + the line-neutral bodies in `hooks`), named in `PATCHES`.
"""
from __future__ import annotations

from npu_flashrl import compat, patches
from npu_flashrl.adapters.vllm_ascend import derived, hooks

NAME = "011"
DYNAMIC_PWAL = "vllm_ascend.quantization.w8a8_dynamic:AscendW8A8DynamicLinearMethod.process_weights_after_loading"
STATIC_PWAL = "vllm_ascend.quantization.w8a8:AscendW8A8LinearMethod.process_weights_after_loading"
MOE_PWAL = "vllm_ascend.quantization.w8a8_dynamic:AscendW8A8DynamicFusedMoEMethod.process_weights_after_loading"
OVERRIDE_TARGET = "vllm_ascend.quantization.quant_config:AscendQuantConfig.override_quantization_method"
_VERSIONS = "vllm-ascend 0.10.1rc1, 0.11.0"


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
    return compat.quant_config_class()


def is_processed(layer) -> bool:
    """The layer holds post-processed tensors (these lines have no layerwise reload that would
    put it back into the checkpoint layout)."""
    return bool(getattr(layer, "_npu_flashrl_processed", False))


commit_extras = derived.commit_extras
commit_moe_extras = derived.commit_moe_extras
refresh_static = derived.refresh_static
static_quant_bias = derived.static_quant_bias
fold_checkpoint_bias = derived.fold_checkpoint_bias


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


@patches.register("ascend_w8a8_dynamic_moe_process_once", MOE_PWAL, _VERSIONS,
                  "fused-MoE post-processing runs once per layer (a second run re-transposes the experts)")
def _apply_moe_once():
    compat.import_quantization()
    patches.replace(MOE_PWAL, lambda orig: hooks.process_once(orig))


hooks.declare_shared_patches(quant_config_class, OVERRIDE_TARGET, "vllm 0.10.1, 0.11.0", _VERSIONS)

PATCHES = ("ascend_w8a8_dynamic_process_once", "ascend_w8a8_static_process_once",
           "ascend_w8a8_dynamic_moe_process_once",
           "ascend_quant_description", "ascend_claims_compressed_tensors",
           "model_loader_int8_load_weights")
