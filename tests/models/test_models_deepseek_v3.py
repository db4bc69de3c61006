"""DeepSeek-V3 (vLLM's DeepseekV3ForCausalLM: MLA attention, a first dense layer, MoE layers with
shared experts, sigmoid routing with a correction bias and grouped top-k) through the INT8
rollout on the current line (vLLM / vllm-ascend 0.23; the MLA layers are built as vllm-ascend
builds them on the NPU: `sim.mla_harness`).

What is quantized follows vllm-ascend and ModelSlim (`adapters/vllm_ascend/mla.py`): the MLA
projections `fused_qkv_a_proj` (q_a_proj + kv_a_proj_with_mqa), `q_b_proj`, `o_proj`, the dense and
shared-expert MLPs and the routed experts are W8A8_DYNAMIC; `kv_b_proj` stays 16-bit (vllm-ascend's
MLA asserts it) and the router `mlp.gate` + `e_score_correction_bias` stay high precision. After
each in-place sync, every tensor a forward reads must equal a fresh INT8 load's, including the
absorbed per-head matrices `W_UK_T` / `W_UV` that vllm-ascend's `AscendMLAImpl` derives from
kv_b_proj in post-processing (stale ones would decode with the old attention weights).

Stand-ins (no NPU): torch_npu and vllm-ascend's compiled MoE ops (reference kernels; the INT8
shared experts' `npu_quant_matmul` int32 output and `_C_ascend.npu_dequant_swiglu_quant` with
swiglu_mode=1 included, `kernels/dequant_swiglu_v2.py`); `AscendMLAImpl.forward` (torch_npu MLA
kernels, paged latent KV cache), replaced by the same absorbed attention in plain torch reading the
same tensors (`sim.mla_harness`); the second NPU stream of the shared experts (the in-order CPU
stream); scipy where absent (imported, unused, by vllm-ascend's sparse-attention module). The MoE
layers run vllm-ascend 0.23's own fused-MoE forward (routing with the correction bias and grouped
top-k, routed experts, INT8 shared experts), so "logits" here are the whole model's, plus every
layer's MLA attention and MLP outputs on fixed inputs.
"""
import os

import pytest
import torch

from npu_flashrl import kernels
from npu_flashrl.sim.tiny_models import build_tiny_deepseek_v3, trainer_weights

from models_checks import three_syncs

LAYERS, EXPERTS = 3, 8
IDS = torch.randint(0, 512, (1, 9), generator=torch.Generator().manual_seed(0))


@pytest.fixture(scope="module")
def deepseek(va, tmp_path_factory):
    from npu_flashrl.sim import mla_harness

    mla_harness.enable_ascend_mla()
    root = str(tmp_path_factory.mktemp("deepseek_v3"))
    dirs = [os.path.join(root, f"w{s}") for s in range(4)]
    return dirs, [build_tiny_deepseek_v3(d, seed=s, tokenizer=False) for s, d in enumerate(dirs)]


@torch.no_grad()
def layer_outputs(v, ids):
    """The whole model's logits (MoE layers included), and on fixed inputs each layer's MLA
    attention and MLP (dense, then the MoE layers with their shared experts), lm_head on the final
    norm of the embeddings."""
    m = v.model
    x = m.model.embed_tokens(ids[0])
    positions = torch.arange(ids.shape[1])
    outs = [v.logits(ids).float()]
    with v.forward_context(ids.shape[1]):
        for i in range(LAYERS):
            layer = m.model.layers[i]
            outs.append(layer.self_attn(positions, layer.input_layernorm(x), None).float())
            outs.append(layer.mlp(x).float())
        outs.append(m.lm_head.quant_method.apply(m.lm_head, m.model.norm(x)).float())
    return torch.cat([o.reshape(-1) for o in outs])


def check(hf):
    def run(model, k):
        w = dict(trainer_weights(hf[k]))
        for i in range(LAYERS):
            attn = model.get_submodule(f"model.layers.{i}.self_attn")
            p = f"model.layers.{i}.self_attn"
            # fused_qkv_a_proj: per-channel INT8 of q_a_proj and kv_a_proj_with_mqa, [in, out]
            qs = [kernels.quantize_weight_per_channel(w[f"{p}.{n}.weight"], torch.bfloat16)[0]
                  for n in ("q_a_proj", "kv_a_proj_with_mqa")]
            assert torch.equal(attn.fused_qkv_a_proj.weight.data, torch.cat(qs).t()), f"{p}.fused_qkv_a_proj"
            q_b = kernels.quantize_weight_per_channel(w[f"{p}.q_b_proj.weight"], torch.bfloat16)[0]
            assert torch.equal(attn.q_b_proj.weight.data, q_b.t())
            assert attn.o_proj.weight.dtype == torch.int8
            # kv_b_proj 16-bit, and the absorbed matrices derived from it
            kv_b = w[f"{p}.kv_b_proj.weight"]
            assert attn.kv_b_proj.weight.dtype == torch.bfloat16
            assert torch.equal(attn.kv_b_proj.weight.data, kv_b)
            impl = attn.mla_attn.mla_attn.impl
            per_head = kv_b.view(4, 32 + 32, 32)  # [heads, nope + v, kv_lora]
            assert torch.equal(impl.W_UK_T, per_head[:, :32, :].contiguous()), f"{p} W_UK_T"
            assert torch.equal(impl.W_UV, per_head[:, 32:, :].transpose(1, 2).contiguous()), f"{p} W_UV"
            mlp = model.get_submodule(f"model.layers.{i}.mlp")
            if i == 0:  # the first dense layer
                assert mlp.gate_up_proj.weight.dtype == torch.int8
                continue
            assert mlp.gate.weight.dtype == torch.bfloat16
            assert torch.equal(mlp.gate.weight.data, w[f"model.layers.{i}.mlp.gate.weight"])
            bias = mlp.gate.e_score_correction_bias
            assert bias.dtype == torch.float32
            assert torch.equal(bias.data, w[f"model.layers.{i}.mlp.gate.e_score_correction_bias"].float())
            assert mlp.shared_experts.gate_up_proj.weight.dtype == torch.int8
            assert mlp.shared_experts.down_proj.weight.dtype == torch.int8
            assert mlp.experts.w13_weight.dtype == torch.int8 and mlp.experts.w13_weight.shape[0] == EXPERTS
    return run


def fused_groups():
    out = {}
    for i in range(LAYERS):
        p = f"model.layers.{i}"
        out[f"{p}.self_attn.fused_qkv_a_proj"] = [f"{p}.self_attn.q_a_proj.weight",
                                                  f"{p}.self_attn.kv_a_proj_with_mqa.weight"]
        if i == 0:
            out[f"{p}.mlp.gate_up_proj"] = [f"{p}.mlp.gate_proj.weight", f"{p}.mlp.up_proj.weight"]
        else:
            out[f"{p}.mlp.experts"] = [f"{p}.mlp.experts.{e}.{n}.weight" for e in range(EXPERTS)
                                       for n in ("gate_proj", "up_proj", "down_proj")]
    return out


def test_deepseek_v3_cold_load_and_three_syncs_equal_fresh_int8_loads(va, deepseek):
    """Cold INT8 load, then 3 syncs (fp32 masters, bf16, bf16 after a NaN refused by name) in
    random buckets splitting fused_qkv_a_proj, gate/up and the experts of a layer: every tensor
    (int8, scales, W_UK_T / W_UV, router and correction bias) bit-identical to a fresh INT8 load,
    pointers unchanged (W_UK_T / W_UV too), the CPU-runnable outputs equal."""
    dirs, models = deepseek
    out = three_syncs(va, dirs, lambda k: trainer_weights(models[k]), IDS, fused_groups(),
                      nan_name="model.layers.1.self_attn.kv_a_proj_with_mqa.weight",
                      check=check(models), logits=layer_outputs,
                      exact=("e_score_correction_bias",), max_bytes=64 << 10)
    assert all(n >= 1 for n in out["split_fused_layers"])


def test_deepseek_v3_int8_wire_equals_a_fresh_load(va, deepseek):
    """The INT8 wire's receiving end (trainer stream through `quant.wire.int8_wire`, random
    buckets): the wire's name rule (`quant.projections`, one home) knows every projection the
    rollout quantizes: o_proj, MLA's q_a / kv_a / q_b, the dense MLP, the routed experts and the
    shared experts (`mlp.shared_experts.*`) all travel as int8 + scale (before, MLA's and the
    shared experts' went as bf16 and were quantized on arrival). The state equals a fresh INT8
    load, bit for bit."""
    from models_checks import wire_syncs

    dirs, models = deepseek
    counts = wire_syncs(va, dirs, lambda k: trainer_weights(models[k]), IDS, logits=layer_outputs,
                        max_bytes=64 << 10)
    # int8 on the wire, per layer (3): o_proj, q_a_proj, kv_a_proj_with_mqa, q_b_proj; layer 0's
    # gate/up/down; the 2 MoE layers' shared experts (3 each) and 8 experts x 3
    assert counts["int8"] == 3 * 4 + 3 + 2 * 3 + 2 * EXPERTS * 3
    assert counts["quantized_on_arrival"] == 0  # kv_b_proj stays 16-bit, not a quantized layer


def test_engine_build_says_what_of_deepseek_v3_is_not_covered(va, deepseek, caplog):
    """The INT8 loader's attach (engine build) logs, for an architecture covered only in part,
    which cells are not (`npu_flashrl.architectures`), instead of a later failure."""
    import logging

    from helpers import build

    dirs, _ = deepseek
    with caplog.at_level(logging.WARNING, logger="npu_flashrl.architectures"):
        with build(va, dirs[0]):
            pass
    msgs = [r.getMessage() for r in caplog.records if r.name == "npu_flashrl.architectures"]
    assert len(msgs) == 1 and msgs[0].startswith(
        "INT8 rollout engine build: architecture DeepseekV3ForCausalLM is covered in part (")
    assert "forward on CPU" not in msgs[0] and "MoE:" not in msgs[0]  # both covered now
    assert "The MoE layers run the current line's vllm-ascend forward on emulated kernels" in msgs[0]
    assert "kv_b_proj 16-bit" in msgs[0]


def test_cpu_mla_stand_in_computes_transformers_deepseek_v3_attention(va, deepseek, tmp_path):
    """The stand-in for vllm-ascend's NPU MLA kernels (`sim.mla_harness`: absorbed attention
    through W_UK_T / W_UV, on vllm-ascend's own MLA layer and vLLM's rotary embedding) gives what
    transformers' DeepseekV3Attention gives on the same fp32 weights: the CPU outputs the sync
    test compares are MLA's, not an approximation of it."""
    import torch

    from helpers import build

    hf = build_tiny_deepseek_v3(str(tmp_path / "fp32"), seed=7, tokenizer=False)
    hf.config._attn_implementation = "sdpa"  # causal without a mask
    hf = hf.float()
    ids = IDS[0]
    positions = torch.arange(ids.shape[0])
    with build(va, str(tmp_path / "fp32"), fn=None, ascend=False, dtype=torch.float32) as v:
        layer = v.model.model.layers[0]
        with v.forward_context(ids.shape[0]), torch.no_grad():
            got = layer.self_attn(positions, layer.input_layernorm(v.model.model.embed_tokens(ids)), None)
    with torch.no_grad():
        x = hf.model.embed_tokens(ids)[None]
        ref = hf.model.layers[0]
        want = ref.self_attn(hidden_states=ref.input_layernorm(x), attention_mask=None,
                             position_embeddings=hf.model.rotary_emb(x, positions[None]))[0][0]
    err = ((got - want).norm() / want.norm()).item()
    assert err < 1e-4, f"relative error {err:.2e}"  # fp32 rounding (measured 2.5e-5)


def test_int8_moe_forward_follows_transformers_deepseek_v3(va, deepseek, tmp_path):
    """The INT8 rollout's MoE layers run on the CPU as vllm-ascend 0.23 runs them (routing with
    the correction bias and grouped top-k, W8A8_DYNAMIC routed experts, INT8 shared experts
    through the int32 npu_quant_matmul and swiglu_mode=1): each MoE layer's output and the whole
    model's logits stay near transformers' DeepseekV3 on the same weights in fp32. The bounds
    leave room for INT8 error only: the same run with the shared experts' swiglu_mode=1 reading
    gate / up interleaved (the pages' odd/even split) lands an order of magnitude outside both."""
    from helpers import build

    d = str(tmp_path / "m")
    hf = build_tiny_deepseek_v3(d, seed=5, tokenizer=False)
    hf.config._attn_implementation = "sdpa"
    hf = hf.float()
    x = torch.randn(9, hf.config.hidden_size, generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        want_layers = [hf.model.layers[i].mlp(x[None])[0] for i in (1, 2)]
        want_logits = hf(IDS).logits.float()
    with build(va, d) as v:
        with v.forward_context(x.shape[0]), torch.no_grad():
            got_layers = [v.model.model.layers[i].mlp(x.bfloat16()).float() for i in (1, 2)]
        got_logits = v.logits(IDS)
        shared = v.model.model.layers[1].mlp.shared_experts
        assert shared.gate_up_proj.weight.dtype == torch.int8  # the INT8 shared-experts path ran
    errs = [((g - w).norm() / w.norm()).item() for g, w in zip(got_layers, want_layers)]
    logit_err = ((got_logits - want_logits).norm() / want_logits.norm()).item()
    assert all(e < 0.05 for e in errs), errs
    assert logit_err < 0.1, logit_err
