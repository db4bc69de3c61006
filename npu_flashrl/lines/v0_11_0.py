"""vllm-ascend 0.11.0 with vLLM 0.11.0 and verl 0.6.1 (sync mode; verl 0.6.1 has the 51d2104
config schema). The quantization layout of v0.10.1rc1 (`QuantConfigLine`); what differs: NZ is
switched by `utils._ENABLE_NZ`, MoE layers include SharedFusedMoE and build their comm methods
(MC2's dispatcher asks HCCL for a name), and vllm-ascend caches "is MoE" per process."""
from __future__ import annotations

from npu_flashrl.lines.base import _Q, SimFacts
from npu_flashrl.lines.v0_10_1rc1 import SIM_011, QuantConfigLine

_MOE = "vllm_ascend.ops.common_fused_moe"

# verl 0.6.1's sync-mode `vLLMRollout.update_weights` is `model.load_weights(weights)` and nothing
# after it: no `process_weights_after_loading`, so MLA's absorbed matrices, which vllm-ascend 0.11
# derives from kv_b_proj only when it post-processes (and re-allocates each time it does), keep the
# cold load's values after every sync
_MLA_STALE = ("verl 0.6.1's sync-mode update_weights calls model.load_weights and never "
              "process_weights_after_loading, so vllm-ascend's MLA keeps W_UK_T / W_UV (derived from "
              "kv_b_proj at load) at the cold load's values after every sync: the rollout would "
              "generate from stale attention weights (a bf16 rollout here has the same stale "
              "matrices: verl's own). Use the current line (verl 0.9.1 server mode, vLLM / "
              "vllm-ascend 0.23, which post-processes after every sync)")

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
    refused_architectures={"DeepseekV2ForCausalLM": _MLA_STALE, "DeepseekV3ForCausalLM": _MLA_STALE},
    w4a8_moe_cast="nz",  # w4a8_dynamic.py: npu_format_cast(FRACTAL_NZ), then pack_to_int32
)
