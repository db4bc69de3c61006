"""vllm-ascend 0.23.0 with vLLM 0.23.0 and verl 0.9.1 (server mode: bucketed IPC syncs into verl's
vLLM workers). What changed against the `QuantConfigLine` layout (read from the v0.23.0 sources):

- the schemes moved to `quantization/methods/w8a8_{dynamic,static}.py` (a registry,
  `get_scheme_class`); `method_adapters.AscendLinearMethod(scheme)` wraps them for vLLM, so
  `layer.quant_method.quant_method` is still the scheme;
- the "ascend" config is `modelslim_config.AscendModelSlimConfig`; `get_config_filenames()` is
  `[]` and the description is read in `maybe_update_config`, which returns early only for a
  truthy description, and `apply_vllm_mapper` rebuilds it as a plain dict. `describe_checkpoint`
  therefore lists every checkpoint weight explicitly (no rule-only, empty-looking description);
- `override_quantization_method(hf_quant_cfg, user_quant, hf_config=...)` (hooks.override
  passes extra arguments through);
- NZ is decided by `utils.maybe_trans_nz` from `get_ascend_config().weight_nz_mode`; the schemes
  hold no version or NZ checks;
- static W8A8 from compressed-tensors (`layer.ascend_quant_method == "compressed-tensors"`)
  adds the float `bias` after scaling and derives a float `deq_scale`; ModelSlim's static W8A8
  still adds the int32 `quant_bias` to the accumulator;
- vLLM's own layerwise reload (`model_loader/reload/layerwise.py`) puts a layer back into its
  checkpoint layout ([out, in] int8, [out, 1] scales) and calls post-processing again: the
  run-once guard must let that call through, so "processed" is read from the layer itself;
- with `enable_fused_mc2` the fused-MoE scheme keeps int64 bit patterns of both expert scales.
"""
from __future__ import annotations

import dataclasses
import importlib

from npu_flashrl.lines.base import _Q, PROCESSED_ATTR, SimFacts, StackLine
from npu_flashrl.marks import marked

COMPRESSED_TENSORS = "compressed-tensors"  # vllm_ascend.utils.COMPRESSED_TENSORS_METHOD
_COMM = "vllm_ascend.ops.fused_moe.moe_comm_method"


@dataclasses.dataclass(frozen=True, eq=False, kw_only=True)
class SchemeRegistryLine(StackLine):
    """The `modelslim_config.py` + `methods/` scheme-registry layout."""
    layout: str = "023"
    quant_config: str = f"{_Q}.modelslim_config:AscendModelSlimConfig"
    linear_method: str = f"{_Q}.method_adapters:AscendLinearMethod"

    ONCE_NOTE = " (again after vLLM's layerwise restore)"

    def vllm_config_in_build(self):
        """None outside `set_current_vllm_config` (this vLLM's `get_current_vllm_config` asserts
        there: a layer built in a unit test, or by another library, has no config)."""
        from vllm.config import get_current_vllm_config_or_none

        return get_current_vllm_config_or_none()

    def is_processed(self, layer) -> bool:
        """Marked by the guard and not put back into the checkpoint layout since (vLLM's
        layerwise reload restores [out, 1] scales)."""
        import torch

        scale = getattr(layer, "weight_scale", None)
        dims = 1  # linear: [out]; fused MoE: [E, 2I] (restored: [E, 2I, 1])
        if scale is None:
            scale, dims = getattr(layer, "w13_weight_scale", None), 2
            if isinstance(scale, torch.Tensor) and scale.dtype == torch.int64:
                # W4A8_DYNAMIC fused MoE: int64 [E, H / group, 2I], per-channel [E, 2I] (restored:
                # fp32 [E, 2I, 1]; only the processed form is int64)
                dims = scale.dim()
        return marked(layer, PROCESSED_ATTR) and \
            isinstance(scale, torch.Tensor) and scale.dim() == dims and not scale.is_meta

    def layerwise_reload_active(self, model) -> bool:
        """Between `initialize_layerwise_reload` and `finalize_layerwise_reload`: some layer of
        the model still takes weights through vLLM's deferred loader (its reload info counts
        toward a total; attention layers and padded ones until the finalize resets them)."""
        try:
            infos = importlib.import_module(
                "vllm.model_executor.model_loader.reload.layerwise").LAYERWISE_INFO
        except (ImportError, AttributeError):
            return False
        for module in model.modules():
            info = infos.get(module)
            if info is not None and info.can_load():
                return True
        return False

    def commit_moe_extras(self, layer) -> None:
        """The fp32 w13 scale, and with `enable_fused_mc2` the int64 bit patterns of both scales
        (`fused_w1_scale` / `fused_w2_scale`), derived with vllm-ascend's own converter."""
        import torch

        super().commit_moe_extras(layer)
        for which, name in (("w13", "fused_w1_scale"), ("w2", "fused_w2_scale")):
            fused = getattr(layer, name, None)
            if isinstance(fused, torch.Tensor):
                # the module of the layer's own scheme class (methods/w8a8_dynamic.py)
                scheme = getattr(getattr(layer, "quant_method", None), "quant_method", None)
                convert = importlib.import_module(type(scheme).__module__).scale_from_float_to_int64
                with torch.no_grad():
                    fused.copy_(convert(getattr(layer, f"{which}_weight_scale").data).view(fused.shape))

    @staticmethod
    def _from_compressed_tensors(layer) -> bool:
        return getattr(layer, "ascend_quant_method", "") == COMPRESSED_TENSORS

    def refresh_static(self, layer) -> None:
        """For a ModelSlim layer as on every line; the compressed-tensors variant derives a float
        deq_scale and adds the float bias itself (no quant_bias)."""
        if self._from_compressed_tensors(layer):
            deq = layer.input_scale.data * layer.weight_scale.data  # as its post-processing does
            layer.deq_scale.data.copy_(deq.to(layer.deq_scale.dtype))  # .data: no autograd
            return
        super().refresh_static(layer)

    def fold_checkpoint_bias(self, layer) -> None:
        if not self._from_compressed_tensors(layer):
            super().fold_checkpoint_bias(layer)

    def process_once(self, original, after=None):
        """The base guard, except that a layer vLLM's layerwise reload put back into the
        checkpoint layout is processed again (otherwise the reload copies [out, in] data into
        the [in, out] storage and fails on the size)."""
        once = super().process_once(original, after=after)

        def process_weights_after_loading(scheme, layer):
            if not self.is_processed(layer):
                setattr(layer, PROCESSED_ATTR, False)
            return once(scheme, layer)
        return process_weights_after_loading

    def scheme_modules(self):
        return super().scheme_modules() + (self.quant_method_map.partition(":")[0].rpartition(".")[0],)

    def _method_table(self):
        """`_SCHEME_REGISTRY`, filled: the `methods` package imports every scheme module."""
        self.import_quantization()
        importlib.import_module(self.quant_method_map.partition(":")[0].rpartition(".")[0])
        return super()._method_table()


LINE = SchemeRegistryLine(
    vllm_ascend="0.23.0", vllm="0.23.0", verl="0.9.1", verl_mode="server", label="current",
    tree_has=("methods/registry.py", "modelslim_config.py", "method_adapters.py"),
    tree_lacks=("quant_config.py", "quantizer.py"),
    sim=SimFacts(
        attention="vllm.model_executor.layers.attention.attention:Attention",
        compile_mode=True,
        nz="weight_nz_mode",
        # REGISTERED_ASCEND_OPS["FusedMoE"] when vLLM is 0.23.0 (SharedFusedMoE is gone)
        moe_layers={"FusedMoE": "vllm_ascend.ops.fused_moe.fused_moe:AscendFusedMoE"},
        moe_comm_selection="forward_context",  # ascend_forward_context.select_moe_comm_method
        device_neutral_ops={
            # ops/linear.py: F.linear; AscendUnquantizedLinearMethod.apply (e.g. MoE router gates)
            "vllm::unquantized_gemm": "vllm_ascend.ops.linear:unquantized_gemm",
            # ops/register_custom_ops.py: TP all-reduce unless the comm method already reduced
            "vllm::maybe_all_reduce_tensor_model_parallel":
                "vllm_ascend.ops.register_custom_ops:_maybe_all_reduce_tensor_model_parallel_impl",
        },
        per_model_caches=("_IS_MOE_MODEL", "_IS_DRAFTER_MOE_MODEL", "_HAS_LAYER_IDX"),
        # built only with expert parallelism (`ep_size > 1`)
        hccl_token_dispatchers=(f"{_COMM}:TokenDispatcherWithMC2", f"{_COMM}:TokenDispatcherWithAll2AllV"),
        # the all-gather comm method's `use_fusion_ops`, read from additional_config
        # `ascend_fusion_config.fusion_ops_gmmswigluquant` (default True) when it is built
        moe_fusion_flag=f"{_COMM}:use_fusion_ops",
        weight_prefetch=True,  # the static scheme needs the model runner's weight-prefetch helper
    ),
    quant_method_map=f"{_Q}.methods.registry:_SCHEME_REGISTRY",  # (quant_type, layer_type) -> class
    w4a8_moe_cast="maybe_trans_nz",  # methods/w4a8.py: maybe_trans_nz, then pack_to_int32
)
