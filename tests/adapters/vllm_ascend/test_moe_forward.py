"""INT8 Qwen3-MoE forward on vllm-ascend's W8A8_DYNAMIC fused-MoE method, on the CPU.

The REAL vLLM Qwen3MoeForCausalLM with vllm-ascend's AscendFusedMoE layers and
AscendW8A8DynamicFusedMoEMethod (and its W8A8_DYNAMIC linear layers) runs its forward inside
vllm-ascend's own forward context, against the transformers bf16 model built from the same
tiny random checkpoint (2 layers, 8 experts, top-2; the router `mlp.gate` stays bf16).

Stand-ins (all from `npu_flashrl.sim.cpu_vllm`, none touches the MoE arithmetic):
- torch_npu / torchair: the emulation (`kernels.emulation`); the ops the MoE path calls are the
  reference kernels of `kernels.moe_reference` (tests/kernels/test_emulation_moe.py checks each by
  hand), vllm-ascend's compiled `_C_ascend` MoE ops get the same kernels, the NPU stream is one
  in-order stream;
- vLLM's CPU platform accepting "ascend"; gloo for HCCL: the mc2 group has no HCCL
  communicator, the MC2 / all-to-all token dispatchers vllm-ascend builds with each layer are
  refusing stand-ins (never selected: one device, no expert parallelism -> all-gather);
  vllm-ascend's device-neutral custom ops (F.linear, TP all-reduce) registered for the CPU;
  vllm-ascend's per-process "is MoE" cache cleared and vLLM's EP group added when the process
  built a dense model first (one model per worker on an NPU, several per test process here);
- plain causal attention for vLLM's attention backends.
- The experts are written into the processed W8A8 parameters here (per-output-channel INT8 of
  the bf16 experts, `kernels.quantize_weight_per_channel`), so this checks the forward path on
  its own, whatever the expert loader does.
"""
import os
import tempfile

import pytest
import torch

from npu_flashrl import kernels
from npu_flashrl.sim import cpu_vllm

pytestmark = pytest.mark.every_line  # line-specific upstream code: runs on every stack line

E, TOP_K, HIDDEN, MOE_I = 8, 2, 128, 96

# Relative error (L2 over the block output) of the INT8 MoE block against the bf16 block on the
# same input and the same (bf16) routing. Each expert is two chained INT8 matmuls with per-channel
# int8 weights and per-token int8 activations (x before gate_up, the swiglu output before down):
# four operands each round to <= 0.5/127 relative per element, ~1% of the output norm per matmul
# over a K-long random-sign dot product (LINEAR_RTOL's reasoning in test_vllm_ascend_reload.py),
# the two matmuls' errors add in quadrature (~1.5%), plus the bf16 scales and bf16 outputs of
# both sides. 4% leaves that margin and is far below a wrong expert (see the negative check).
MOE_RTOL = 0.04
# Full-model logits against the bf16 model: two decoder layers of INT8 attention projections and
# INT8 MoE blocks (~1-1.5% each on the hidden states), compounded through the residual stream and
# the bf16 lm_head; a token whose top-2 experts nearly tie may also route differently. 8% of the
# logits' norm is still far below a model with one broken layer (relative error ~100%).
LOGITS_RTOL = 0.08


def _config():
    from transformers import Qwen3MoeConfig

    return Qwen3MoeConfig(
        vocab_size=512, hidden_size=HIDDEN, intermediate_size=352, moe_intermediate_size=MOE_I,
        num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, head_dim=48,
        num_experts=E, num_experts_per_tok=TOP_K, decoder_sparse_step=1, norm_topk_prob=True,
        max_position_embeddings=512, rms_norm_eps=1e-6, rope_theta=10000.0,
        tie_word_embeddings=False, mlp_only_layers=[], hidden_act="silu")


def _init_(model, seed: int) -> None:
    """Random weights with a realistic spread: every weight row (of a linear layer or an
    expert's projection, 2-D or transformers 5's fused 3-D experts) gets its own log-normal
    scale, so per-channel quantization sees different rows; the router gets a larger spread so
    tokens pick clearly different experts."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if p.dim() >= 2:
                rows = torch.empty(p.shape[:-1] + (1,)).log_normal_(0.0, 0.5, generator=g)
                std = 0.3 if name.endswith("mlp.gate.weight") else 0.05
                p.copy_(torch.randn(p.shape, generator=g) * std * rows)
            else:  # norms
                p.copy_(1.0 + 0.1 * torch.randn(p.shape, generator=g))


@pytest.fixture(scope="module")
def hf_moe():
    """(checkpoint dir, transformers bf16 Qwen3-MoE) built offline."""
    from transformers import Qwen3MoeForCausalLM

    torch.manual_seed(0)
    cfg = _config()
    model = Qwen3MoeForCausalLM(cfg)
    _init_(model, seed=0)
    model = model.to(torch.bfloat16).eval()
    d = os.path.join(tempfile.mkdtemp(prefix="npu_flashrl_moe_"), "qwen3moe")
    model.save_pretrained(d, safe_serialization=True)
    return d, model


def hf_experts(block):
    """(gate_up [E, 2I, H], down [E, H, I]) of a transformers Qwen3MoeSparseMoeBlock: fused
    3-D parameters in transformers 5, an nn.ModuleList of Qwen3MoeMLP in transformers 4."""
    ex = block.experts
    if hasattr(ex, "gate_up_proj"):
        return ex.gate_up_proj.detach(), ex.down_proj.detach()
    gate_up = torch.stack([torch.cat([m.gate_proj.weight, m.up_proj.weight]) for m in ex])
    down = torch.stack([m.down_proj.weight for m in ex])
    return gate_up.detach(), down.detach()


def hf_block_out(block, x):
    out = block(x.unsqueeze(0))
    out = out[0] if isinstance(out, tuple) else out  # transformers 4 also returns router logits
    return out.reshape(x.shape)


def write_int8_experts(experts, gate_up, down) -> None:
    """Per-output-channel INT8 of each expert into the processed W8A8_DYNAMIC parameters:
    w13_weight [E, H, 2I] / w2_weight [E, I, H] int8 ([in, out] per expert), their scales
    [E, 2I] / [E, H] in the layer's dtype, w13_weight_scale_fp32 (what gate_up's matmul reads),
    zero offsets."""
    with torch.no_grad():
        for e in range(gate_up.shape[0]):
            q13, s13 = kernels.quantize_weight_per_channel(gate_up[e])
            q2, s2 = kernels.quantize_weight_per_channel(down[e])
            experts.w13_weight.data[e].copy_(q13.t())
            experts.w2_weight.data[e].copy_(q2.t())
            experts.w13_weight_scale.data[e].copy_(s13)
            experts.w2_weight_scale.data[e].copy_(s2)
        experts.w13_weight_offset.data.zero_()
        experts.w2_weight_offset.data.zero_()
        experts.w13_weight_scale_fp32 = experts.w13_weight_scale.data.float()


@pytest.fixture(scope="module")
def vllm_moe(va, hf_moe):
    """The vLLM model on vllm-ascend's W8A8_DYNAMIC methods (online INT8 for the dense
    projections), its experts set to the INT8 of the bf16 checkpoint's experts."""
    from npu_flashrl.sim import ascend_harness

    unsupported = ascend_harness.cpu_moe_forward_unsupported()
    if unsupported:
        pytest.skip(unsupported)
    d, hf = hf_moe
    with cpu_vllm.CpuVllm(d, quantization="ascend", choice=cpu_vllm.int8()) as v:
        # what npu_flashrl's cold load put there, for test_cold_loaded_experts_forward
        v.cold_experts = [{n: t.detach().clone() for n, t in _expert_tensors(layer.mlp.experts).items()}
                          for layer in v.model.model.layers]
        for i, layer in enumerate(v.model.model.layers):
            write_int8_experts(layer.mlp.experts, *hf_experts(hf.model.layers[i].mlp))
        yield v


_EXPERT_TENSORS = ("w13_weight", "w2_weight", "w13_weight_scale", "w2_weight_scale",
                   "w13_weight_scale_fp32")


def _expert_tensors(experts) -> dict:
    return {n: getattr(experts, n) for n in _EXPERT_TENSORS}


def _rel(a, b) -> float:
    return float((a.float() - b.float()).norm() / b.float().norm())


def test_moe_layers_are_vllm_ascend_w8a8_dynamic(vllm_moe):
    from npu_flashrl.sim import ascend_harness

    ascend_cls = ascend_harness.ascend_moe_layer_classes()["FusedMoE"]
    for layer in vllm_moe.model.model.layers:
        experts = layer.mlp.experts
        assert isinstance(experts, ascend_cls), type(experts)
        assert type(experts.quant_method.quant_method).__name__ == "AscendW8A8DynamicFusedMoEMethod"
        assert experts.w13_weight.dtype == torch.int8 and experts.w2_weight.dtype == torch.int8
        assert tuple(experts.w13_weight.shape) == (E, HIDDEN, 2 * MOE_I)
        assert tuple(experts.w2_weight.shape) == (E, MOE_I, HIDDEN)
        # the router stays a float layer
        assert layer.mlp.gate.weight.dtype == torch.bfloat16


def test_forward_context_uses_allgather(vllm_moe):
    """One device, no expert parallelism: vllm-ascend's runner picks the all-gather dispatch."""
    from vllm.forward_context import get_forward_context

    with vllm_moe.forward_context(16):
        assert get_forward_context().moe_comm_type.name == "ALLGATHER"


@pytest.mark.parametrize("layer_idx", [0, 1])
def test_int8_moe_block_matches_bf16_block(vllm_moe, hf_moe, layer_idx):
    _, hf = hf_moe
    g = torch.Generator().manual_seed(100 + layer_idx)
    x = torch.randn(24, HIDDEN, generator=g).to(torch.bfloat16)
    with torch.no_grad():
        ref = hf_block_out(hf.model.layers[layer_idx].mlp, x)
        with vllm_moe.forward_context(x.shape[0]):
            out = vllm_moe.model.model.layers[layer_idx].mlp(x.clone())
    assert out.shape == ref.shape and out.dtype == torch.bfloat16
    assert torch.isfinite(out).all()
    err = _rel(out, ref)
    print(f"layer {layer_idx}: INT8 MoE block rel. error vs bf16 {err:.4f}")
    assert err < MOE_RTOL


def test_unfused_gate_up_path_matches_bf16_block(vllm_moe, hf_moe, monkeypatch):
    """vllm-ascend's other W8A8_DYNAMIC MoE MLP (ascend_fusion_config.fusion_ops_gmmswigluquant
    off, 0.23): per-token npu_grouped_matmul for gate_up, npu_swiglu, npu_dynamic_quant."""
    from npu_flashrl.sim import ascend_harness

    import torch_npu

    flag = ascend_harness.moe_gmm_swiglu_fusion_flag()
    if flag is None:
        pytest.skip("this vllm-ascend line always fuses gate_up + swiglu + quant for W8A8 MoE")
    monkeypatch.setattr(*flag, False)
    calls = []
    swiglu = torch_npu.npu_swiglu
    monkeypatch.setattr(torch_npu, "npu_swiglu", lambda *a, **k: calls.append(1) or swiglu(*a, **k))
    _, hf = hf_moe
    x = torch.randn(24, HIDDEN, generator=torch.Generator().manual_seed(100)).to(torch.bfloat16)
    with torch.no_grad():
        ref = hf_block_out(hf.model.layers[0].mlp, x)
        with vllm_moe.forward_context(x.shape[0]):
            out = vllm_moe.model.model.layers[0].mlp(x.clone())
    err = _rel(out, ref)
    print(f"unfused gate_up path: rel. error vs bf16 {err:.4f}")
    assert calls and err < MOE_RTOL


def test_wrong_expert_scale_fails_the_block_check(vllm_moe, hf_moe):
    """Negative control: the most-used expert's down-projection scales doubled (what a loader that
    kept a stale or mis-placed scale would leave) must fail the MOE_RTOL check."""
    _, hf = hf_moe
    x = torch.randn(24, HIDDEN, generator=torch.Generator().manual_seed(100)).to(torch.bfloat16)
    experts = vllm_moe.model.model.layers[0].mlp.experts
    with torch.no_grad():
        logits = torch.nn.functional.linear(x.float(), hf.model.layers[0].mlp.gate.weight.float())
        busiest = int(torch.bincount(logits.topk(TOP_K).indices.flatten(), minlength=E).argmax())
        ref = hf_block_out(hf.model.layers[0].mlp, x)
        saved = experts.w2_weight_scale.data[busiest].clone()
        try:
            experts.w2_weight_scale.data[busiest].mul_(2.0)
            with vllm_moe.forward_context(x.shape[0]):
                out = vllm_moe.model.model.layers[0].mlp(x.clone())
        finally:
            experts.w2_weight_scale.data[busiest].copy_(saved)
    err = _rel(out, ref)
    print(f"doubled w2 scale of expert {busiest}: rel. error {err:.4f}")
    assert err > 2 * MOE_RTOL


def test_full_model_logits_are_finite_and_close_to_bf16(vllm_moe, hf_moe):
    _, hf = hf_moe
    ids = torch.randint(3, 512, (2, 12), generator=torch.Generator().manual_seed(7))
    logits = vllm_moe.logits(ids)
    with torch.no_grad():
        ref = hf(ids).logits.float()
    assert logits.shape == ref.shape
    assert torch.isfinite(logits).all()
    err = _rel(logits, ref)
    top1 = float((logits.argmax(-1) == ref.argmax(-1)).float().mean())
    print(f"full-model logits rel. error vs bf16 {err:.4f}, top-1 agreement {top1:.3f}")
    assert err < LOGITS_RTOL


def test_cold_loaded_experts_forward_like_the_reference_int8(vllm_moe, hf_moe):
    """The experts npu_flashrl's cold load quantized from the bf16 checkpoint (kept aside by the
    fixture before it wrote its own) run the same forward: the block output matches the one of
    the reference-written experts (same per-channel INT8: identical up to a scale's last bf16
    bit) and so the bf16 block within MOE_RTOL."""
    _, hf = hf_moe
    x = torch.randn(24, HIDDEN, generator=torch.Generator().manual_seed(100)).to(torch.bfloat16)
    experts = vllm_moe.model.model.layers[0].mlp.experts
    live = _expert_tensors(experts)
    mine = {n: t.detach().clone() for n, t in live.items()}
    with torch.no_grad():
        with vllm_moe.forward_context(x.shape[0]):
            ref_int8 = vllm_moe.model.model.layers[0].mlp(x.clone())
        try:
            for n, t in vllm_moe.cold_experts[0].items():
                live[n].copy_(t)
            with vllm_moe.forward_context(x.shape[0]):
                out = vllm_moe.model.model.layers[0].mlp(x.clone())
        finally:
            for n, t in mine.items():
                live[n].copy_(t)
        ref = hf_block_out(hf.model.layers[0].mlp, x)
    assert torch.isfinite(out).all()
    err_int8, err = _rel(out, ref_int8), _rel(out, ref)
    print(f"cold-loaded experts: rel. error vs reference INT8 {err_int8:.5f}, vs bf16 {err:.4f}")
    assert err_int8 < 0.01 and err < MOE_RTOL
