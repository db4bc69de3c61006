"""One home per name rule: the projections the INT8 rollout quantizes (`quant.projections`) are
what the quant description, MLA, the INT8 wire's sender and the FlashRL profile read; the wire's
names (`WIRES`) are the config's. Pure name rules: nothing upstream is imported."""
import pytest

from npu_flashrl.quant import projections, wire


@pytest.mark.parametrize("name", [
    "model.layers.0.self_attn.q_proj.weight",
    "model.layers.3.mlp.down_proj.weight",
    "model.layers.1.mlp.experts.7.gate_proj.weight",
    "model.layers.1.mlp.shared_expert.up_proj.weight",     # Qwen2-MoE
    "model.layers.1.mlp.shared_experts.up_proj.weight",    # DeepSeek-V3
    "model.layers.0.self_attn.q_a_proj.weight",            # MLA
    "model.layers.0.self_attn.kv_a_proj_with_mqa.weight",
    "model.layers.0.self_attn.q_b_proj.weight",
])
def test_the_wire_sends_every_projection_the_rollout_quantizes_as_int8(name):
    assert wire.is_projection(name)


@pytest.mark.parametrize("name", [
    "model.layers.0.self_attn.kv_b_proj.weight",  # MLA's kv_b_proj stays 16-bit
    "model.layers.0.mlp.gate.weight",             # the MoE router
    "model.layers.0.self_attn.q_proj.bias",
    "lm_head.weight", "model.embed_tokens.weight", "model.norm.weight",
])
def test_the_wire_sends_the_rest_as_it_is(name):
    assert not wire.is_projection(name)


def test_every_reader_takes_the_one_list():
    from npu_flashrl import config
    from npu_flashrl.adapters.vllm_ascend import description, mla

    assert description.PROJECTIONS is projections.DENSE
    assert mla.MLA_PROJECTIONS is projections.MLA
    assert config.WIRES is wire.WIRES
    assert projections.is_dense_projection("model.layers.0.mlp.up_proj.weight")
    assert not projections.is_dense_projection("model.layers.0.self_attn.q_a_proj.weight")
