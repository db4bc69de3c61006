"""vllm-ascend 0.11.0 with vLLM 0.11.0 and verl 0.6.1 (sync mode; verl 0.6.1 has the 51d2104
config schema). The quantization layout of v0.10.1rc1 (`QuantConfigLine`); what differs: NZ is
switched by `utils._ENABLE_NZ`, MoE layers include SharedFusedMoE and build their comm methods
(MC2's dispatcher asks HCCL for a name), and vllm-ascend caches "is MoE" per process."""
from __future__ import annotations

from npu_flashrl.lines.base import _Q, SimFacts
from npu_flashrl.lines.v0_10_1rc1 import SIM_011, QuantConfigLine

_MOE = "vllm_ascend.ops.common_fused_moe"

LINE = QuantConfigLine(
    vllm_ascend="0.11.0", vllm="0.11.0", verl="0.6.1", verl_mode="sync", label="0.11",
    # 0.13.0 keeps these files and adds compressed_tensors/: not taken for 0.11.0
    tree_has=("quant_config.py", "utils.py", "w8a8_dynamic.py"),
    tree_lacks=("quantizer.py", "methods/registry.py", "compressed_tensors/compressed_tensors.py"),
    sim=SimFacts(
        **SIM_011,
        nz="utils_flag",
        # `utils.register_ascend_customop`, REGISTERED_ASCEND_OPS
        moe_layers={"FusedMoE": f"{_MOE}:AscendFusedMoE", "SharedFusedMoE": f"{_MOE}:AscendSharedFusedMoE"},
        # ops/moe/moe_comm_method.py builds TokenDispatcherWithMC2 for every layer (its all-to-all
        # dispatcher needs no HCCL name)
        hccl_token_dispatchers=("vllm_ascend.ops.moe.moe_comm_method:TokenDispatcherWithMC2",),
        per_model_caches=("_IS_MOE_MODEL",),
    ),
    quant_method_map=f"{_Q}.utils:ASCEND_QUANTIZATION_METHOD_MAP",
)
