"""W4A8 Qwen3-MoE on vllm-ascend's W4A8_DYNAMIC fused-MoE method, on the CPU: built from a
ModelSlim-format W4A8 checkpoint (group size 256), post-processed by vllm-ascend itself, and its
MoE blocks run their forward inside vllm-ascend's own forward context.

Real code: vLLM's Qwen3MoeForCausalLM and loaders, vllm-ascend's AscendModelSlimConfig,
AscendFusedMoE, `AscendW4A8DynamicFusedMoEMethod` (create_weights, weight loading,
`process_weights_after_loading`: transpose, `process_scale`, `npu_quantize` packing, scale_bias;
`apply`: routing, the all-gather dispatch, the A8W4 grouped matmuls, swiglu, dynamic quant).
Stand-ins (`npu_flashrl.sim.cpu_vllm`): torch_npu (the emulation: `kernels.int4_moe` for the
quint4x2 packing and the A8W4 grouped matmul, `kernels.moe_reference` for the rest of the MoE
path), the HCCL name of vllm-ascend's mc2 group (`_mc2_without_hccl`, for the W4A8 scheme as for
W8A8), the MC2 / all-to-all dispatchers (never selected: one device), vLLM's CPU platform
accepting "ascend", plain causal attention. The checkpoint is written by the tests' ModelSlim-format
writer with npu_flashrl's staged quantizer (ModelSlim's own is compiled).
"""
import pytest
import torch

from npu_flashrl.sim import cpu_vllm

from w4a8_moe_models import EXPERTS, GROUP, HIDDEN, LAYERS, MOE_I, build_pair, dequantized_experts, \
    moe_block_reference

pytestmark = pytest.mark.every_line

# Relative error (L2 over the block output) of the W4A8 MoE block against the float64 block of
# the SAME int4 experts (dequantized) and the same bf16 router: what remains is the A8 part, the
# per-token int8 of x before gate_up and of the swiglu output before down (each <= 0.5/127 per
# element, ~1% of a matmul's output norm over a K-long dot product, the two in quadrature ~1.5%),
# the bf16 gate_up output the swiglu reads,
# the fp16 rounding of the fused scales and the bf16 outputs. A wrong or missing scale_bias moves
# the output by 8 * sum_k(w * scale) per channel, far beyond it (the negative check below).
A8_RTOL = 0.04


@pytest.fixture(scope="module")
def w4a8_moe(tmp_path_factory):
    from transformers import AutoModelForCausalLM

    from npu_flashrl import lines
    from npu_flashrl.sim import ascend_harness

    cpu_vllm.prepare_process()
    if lines.current().method_class("W4A8_DYNAMIC", "moe") is None:
        pytest.skip(f"vllm-ascend {lines.current().vllm_ascend} has no W4A8_DYNAMIC fused-MoE method")
    unsupported = ascend_harness.cpu_moe_forward_unsupported()
    if unsupported:
        pytest.skip(unsupported)
    bf16, ms = build_pair(str(tmp_path_factory.mktemp("w4a8_moe")), seed=0)
    hf = AutoModelForCausalLM.from_pretrained(bf16, dtype=torch.bfloat16)
    with cpu_vllm.CpuVllm(ms, quantization="ascend") as v:
        yield v, hf


def test_experts_hold_vllm_ascends_processed_w4a8_layout(w4a8_moe):
    v, _ = w4a8_moe
    for layer in v.model.model.layers:
        ex = layer.mlp.experts
        assert type(ex.quant_method.quant_method).__name__ == "AscendW4A8DynamicFusedMoEMethod"
        assert ex.quant_method.quant_method.group_size == GROUP
        assert ex.w13_weight.dtype == torch.int32 and tuple(ex.w13_weight.shape) == (EXPERTS, HIDDEN, 2 * MOE_I // 8)
        assert ex.w2_weight.dtype == torch.int32 and tuple(ex.w2_weight.shape) == (EXPERTS, MOE_I, HIDDEN // 8)
        assert ex.w13_weight_scale.dtype == torch.int64
        assert tuple(ex.w13_weight_scale.shape) == (EXPERTS, HIDDEN // GROUP, 2 * MOE_I)
        assert tuple(ex.w2_weight_scale.shape) == (EXPERTS, MOE_I // GROUP, HIDDEN)
        assert tuple(ex.w13_scale_bias.shape) == (EXPERTS, 2 * MOE_I)
        assert tuple(ex.w2_scale_bias.shape) == (EXPERTS, HIDDEN)
        assert not hasattr(ex, "w13_weight_scale_second")  # released by post-processing
        assert layer.mlp.gate.weight.dtype == torch.bfloat16  # the router stays float


def _block(v, layer_idx, x):
    with torch.no_grad(), v.forward_context(x.shape[0]):
        return v.model.model.layers[layer_idx].mlp(x.clone())


@pytest.mark.parametrize("layer_idx", range(LAYERS))
def test_w4a8_moe_block_is_its_int4_experts_up_to_the_int8_activations(w4a8_moe, layer_idx):
    v, hf = w4a8_moe
    x = torch.randn(24, HIDDEN, generator=torch.Generator().manual_seed(7 + layer_idx)).bfloat16()
    out = _block(v, layer_idx, x)
    gate_up, down = dequantized_experts(hf, layer_idx)
    router = hf.model.layers[layer_idx].mlp.gate.weight.detach()
    ref = moe_block_reference(x, router, gate_up, down, hf.config.num_experts_per_tok)
    assert out.dtype == torch.bfloat16 and torch.isfinite(out).all()
    err = float((out.double() - ref).norm() / ref.norm())
    print(f"layer {layer_idx}: W4A8 MoE block rel. error vs its dequantized int4 experts {err:.4f}")
    assert err < A8_RTOL


def test_the_forward_reads_the_scale_bias(w4a8_moe):
    """The A8W4 matmul takes (x - 8) and adds the scale_bias back: a zeroed scale_bias is not
    compensated anywhere else."""
    v, hf = w4a8_moe
    ex = v.model.model.layers[0].mlp.experts
    x = torch.randn(8, HIDDEN, generator=torch.Generator().manual_seed(3)).bfloat16()
    good = _block(v, 0, x)
    saved = ex.w13_scale_bias.data.clone()
    try:
        ex.w13_scale_bias.data.zero_()
        bad = _block(v, 0, x)
    finally:
        ex.w13_scale_bias.data.copy_(saved)
    assert float((bad.double() - good.double()).norm() / good.double().norm()) > 5 * A8_RTOL
    assert torch.equal(_block(v, 0, x), good)


def test_full_model_logits_are_finite(w4a8_moe):
    v, _ = w4a8_moe
    assert torch.isfinite(v.logits(torch.tensor([[1, 2, 3, 4, 5]]))).all()
