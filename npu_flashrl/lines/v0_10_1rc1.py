"""vllm-ascend v0.10.1rc1 with vLLM 0.10.1 and verl 51d2104 (sync mode): the published Ascend
procedure, the production pin (no wheel: a source tree, recognised by its quantization files).

Its quantization package (kept by 0.11.0, `v0_11_0` inherits `QuantConfigLine`): the config in
`quantization/quant_config.py`, the schemes in `quantization/w8a8{,_dynamic}.py`, wrapped for vLLM
by `quant_config.AscendLinearMethod`. No layerwise reload: a layer marked processed stays so.
"""
from __future__ import annotations

import dataclasses

from npu_flashrl.lines.base import _Q, StackLine


@dataclasses.dataclass(frozen=True, eq=False, kw_only=True)
class QuantConfigLine(StackLine):
    """The `quant_config.py` + `w8a8{,_dynamic}.py` layout (v0.10.1rc1, 0.11.0)."""
    layout: str = "011"
    quant_config: str = f"{_Q}.quant_config:AscendQuantConfig"
    linear_method: str = f"{_Q}.quant_config:AscendLinearMethod"
    attention: str = "vllm.attention.layer:Attention"
    compile_mode: bool = False

    def refused_reason(self, inner):
        cls = type(inner)
        if cls.__name__.startswith("Torchair") or cls.__module__.startswith("vllm_ascend.torchair"):
            # Same [in, out] + NZ layout as the eager method, but its post-processing is not made
            # run-once here and graph capture of in-place weight updates is unverified: refuse.
            return (f"{cls.__name__} is torchair graph mode's W8A8 layer, which npu_flashrl's "
                    "online INT8 reload does not support; build the rollout engine without "
                    "torchair graph mode (additional_config torchair_graph_config.enabled=false, "
                    "the default)")
        return None


LINE = QuantConfigLine(
    vllm_ascend="0.10.1rc1", vllm="0.10.1", verl="51d2104", verl_mode="sync", label="pinned",
    nz="always",  # W8A8 weights are NZ-cast unconditionally
    tree_has=("quantizer.py", "quant_config.py", "w8a8_dynamic.py"),
    tree_lacks=("utils.py", "methods/registry.py"),
    # `utils.register_ascend_customop`: FusedMoE only. Its constructor allocates the comm methods'
    # buffers on the NPU (distributed/moe_comm_method.py): the CPU harness does not register it.
    moe_layers={"FusedMoE": "vllm_ascend.ops.common_fused_moe:AscendFusedMoE"},
    cpu_moe_forward_unsupported=(
        "vllm-ascend v0.10.1rc1's model runner dispatches every MoE batch within the MC2 "
        "token capacity with MC2 (HCCL collectives), expert parallelism or not; the CPU "
        "harness runs the all-gather dispatch of 0.11 / 0.23 only (seen besides: its "
        "built experts are not in the processed [E, H, 2I] layout; not investigated)"),
    # quantizer classes, not method classes, in this line's table
    quant_method_map=f"{_Q}.quantizer:SUPPORT_ASCEND_QUANTIZER_TYPE",
    # no per-model caches, no HCCL-named dispatchers (its fused-MoE layer builds no comm methods)
)
