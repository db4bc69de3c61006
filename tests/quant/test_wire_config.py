"""`wire: int8` in the FlashRL config (no upstream code needed): accepted for int8_profile_free,
refused by name for FlashRL's int8 profile, bf16, unknown values and hybrid configs that mix
wires; the trainer-side stream (npu_flashrl.quant.wire) quantizes projections only, with the
rollout's kernel, and passes a non-finite weight through for the receiver to refuse."""
import pytest
import torch

from npu_flashrl import kernels
from npu_flashrl.config import ConfigError, parse_config, wire_of
from npu_flashrl.quant.wire import int8_wire, is_projection

pytestmark = pytest.mark.every_line


def test_wire_int8_profile_free_accepted_and_written_back():
    cfg = parse_config({"configs": [{"fn": "int8_profile_free", "wire": "int8"}]})
    assert wire_of(cfg) == "int8" and cfg.entries[0].to_dict()["wire"] == "int8"
    assert wire_of(parse_config({"configs": [{"fn": "int8_profile_free"}]})) == "float"


@pytest.mark.parametrize("entries,needle", [
    ([{"fn": "int8", "wire": "int8"}], "int8 profile"),
    ([{"fn": "bf16", "wire": "int8"}], "bf16 rollout"),
    ([{"fn": "int8_profile_free", "wire": "fp8"}], "wire: expected one of float, int8"),
    ([{"fn": "int8_profile_free", "wire": "int8"}, {"fn": "int8_profile_free"}], "disagree on `wire`"),
])
def test_wire_refused_by_name(entries, needle):
    with pytest.raises(ConfigError, match=needle):
        parse_config({"configs": entries}, source="/tmp/flashrl.yaml")


def test_int8_wire_stream():
    g = torch.Generator().manual_seed(0)
    w = torch.randn(48, 64, generator=g)
    bad = w.clone()
    bad[3, 5] = float("nan")
    stream = [("model.layers.0.self_attn.q_proj.weight", w),
              ("model.layers.0.mlp.experts.7.down_proj.weight", w),
              ("model.layers.0.mlp.gate.weight", w),            # MoE router: not a projection
              ("lm_head.weight", w),
              ("model.layers.1.mlp.up_proj.weight", bad)]
    items = list(int8_wire(stream, torch.bfloat16))
    names = [n for n, _ in items]
    assert names.index("model.layers.0.self_attn.q_proj.weight_scale") < names.index("model.layers.0.self_attn.q_proj.weight")
    out = dict(items)
    q, s = kernels.quantize_weight_per_channel(w, torch.bfloat16)
    for p in ("model.layers.0.self_attn.q_proj", "model.layers.0.mlp.experts.7.down_proj"):
        assert torch.equal(out[p + ".weight"], q) and out[p + ".weight"].dtype == torch.int8
        assert torch.equal(out[p + ".weight_scale"], s.unsqueeze(1))
    assert out["model.layers.0.mlp.gate.weight"] is w and out["lm_head.weight"] is w
    assert out["model.layers.1.mlp.up_proj.weight"] is bad  # the receiver refuses it by name
    assert not is_projection("model.layers.0.mlp.shared_expert_gate.weight")
