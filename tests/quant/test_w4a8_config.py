"""`fn: w4a8_profile_free` with `group_size` in the FlashRL-compatible config: parsed and
validated (positive; 0 refused naming why; only for an fn with weight groups), written back, and
carried to what the engine reads: the engine's `EngineChoice`, the in-memory quant description
of a bare bf16 checkpoint (projections typed W4A8_DYNAMIC, `group_size` at the top level) and the
quantizer. No upstream code runs here (the engine-level path: tests/adapters/vllm_ascend/
test_w4a8_group_size.py); the engine args are a plain namespace standing in for vLLM's
EngineArgs, as the engine patch sees them."""
import json
import types

import pytest

from npu_flashrl import config as fc


def entry(**kw):
    return fc.RolloutConfig.from_dict({"fn": "w4a8_profile_free", **kw}, "cfg.yaml: configs[0]")


def test_group_size_is_read_written_back_and_defaults_to_256():
    e = entry(group_size=64)
    assert e.group_size == 64 and "group_size" not in e.extra
    assert e.to_dict() == {"fn": "w4a8_profile_free", "group_size": 64}
    assert fc.parse_config({"configs": [e.to_dict()]}).entries[0].group_size == 64
    assert fc.group_size_of(e) == 64
    assert fc.group_size_of(entry()) == 256  # vllm-ascend's description default
    assert fc.group_size_of(fc.RolloutConfig.default("int8_profile_free")) is None
    assert fc.unknown_key_problems(e) == []


def test_group_size_0_is_per_channel_for_moe_experts_and_refused_for_a_bf16_description():
    """`group_size: 0` (vllm-ascend's per-channel W4A8 fused-MoE mode) parses and reaches the
    quantizer; a bare bf16 checkpoint's description cannot take it (its linear layers would
    divide by it): asking for that description names the key and why."""
    from npu_flashrl.quant import WeightSyncError
    from npu_flashrl.quant.registry import QUANTIZERS

    e = entry(group_size=0)
    assert e.group_size == 0 and e.to_dict()["group_size"] == 0
    assert fc.parse_config({"configs": [e.to_dict()]}).entries[0].group_size == 0
    assert fc.group_size_of(e) == 0
    cls = QUANTIZERS["w4a8_profile_free"]
    assert cls(group_size=0).group_size == 0
    with pytest.raises(WeightSyncError, match=r"group_size = 0 \(per-channel\) needs a ModelSlim W4A8 "
                                              r"checkpoint.*weight_scale_second as \[out, in // group_size\]"):
        cls.description_keys(0)


@pytest.mark.parametrize("value, match", [
    (-32, r"configs\[0\]\.group_size = -32: expected a positive integer"),
    ("128", r"configs\[0\]\.group_size: expected a positive integer .*got '128'"),
    (True, r"configs\[0\]\.group_size: expected a positive integer .*got True"),
    (12.5, r"configs\[0\]\.group_size: expected a positive integer"),
])
def test_a_bad_group_size_is_refused_naming_the_key(value, match):
    with pytest.raises(fc.ConfigError, match=match):
        entry(group_size=value)


def test_group_size_on_an_fn_without_groups_is_refused():
    with pytest.raises(fc.ConfigError, match=r"configs\[0\]\.group_size: fn 'int8_profile_free' has "
                                             r"no weight groups; the key applies to fn "
                                             r"w4a8_profile_free only"):
        fc.RolloutConfig.from_dict({"fn": "int8_profile_free", "group_size": 64}, "configs[0]")


def test_the_engine_choice_and_the_quantizer_carry_the_entrys_group_size():
    from npu_flashrl.adapters import vllm_engine
    from npu_flashrl.adapters.engine_choice import engine_choice
    from npu_flashrl.quant import make_quantizer

    args = types.SimpleNamespace(model="/m", additional_config={"user": 1})
    vllm_engine._record_choice(args, entry(group_size=64), rank=0)
    choice = engine_choice(args)
    assert choice.fn == "w4a8_profile_free" and choice.group_size == 64
    assert args.additional_config["user"] == 1
    # vLLM hashes additional_config with json.dumps and pickles it: both must carry the field
    assert json.loads(json.dumps(args.additional_config))["npu_flashrl"][-1] == 64
    assert make_quantizer("w4a8_profile_free", None, None, group_size=64).group_size == 64
    assert make_quantizer("w4a8_profile_free", None).group_size is None  # the layers' own
    with pytest.raises(ValueError, match="fn 'int8_profile_free' has no weight groups"):
        make_quantizer("int8_profile_free", None, None, group_size=64)


def test_a_bare_bf16_checkpoint_is_described_w4a8_with_the_group_size(tmp_path):
    """The description the redirect builds for the engine's choice (`hooks.description_kind`)."""
    from npu_flashrl.adapters.engine_choice import EngineChoice
    from npu_flashrl.adapters.vllm_ascend.description import describe_checkpoint
    from npu_flashrl.adapters.vllm_ascend.hooks import description_kind

    (tmp_path / "config.json").write_text(json.dumps(
        {"architectures": ["Qwen2ForCausalLM"], "num_hidden_layers": 1}))
    desc = describe_checkpoint(str(tmp_path), **description_kind(EngineChoice("w4a8_profile_free",
                                                                               group_size=64)))
    assert desc["group_size"] == 64
    assert desc["model.layers.0.mlp.down_proj.weight"] == "W4A8_DYNAMIC"
    assert desc["lm_head.weight"] == "FLOAT"
    assert dict(desc).get("model.layers.0.self_attn.q_proj.weight") == "W4A8_DYNAMIC"  # listed
    default = describe_checkpoint(str(tmp_path), **description_kind(EngineChoice("w4a8_profile_free")))
    assert default["group_size"] == 256
    int8 = describe_checkpoint(str(tmp_path), **description_kind(EngineChoice("int8_profile_free")))
    assert "group_size" not in int8 and int8["model.layers.0.mlp.down_proj.weight"] == "W8A8_DYNAMIC"


def test_in_dim_problems_name_each_projection_the_group_size_does_not_divide():
    from npu_flashrl.quant.w4a8 import in_dim_problems

    shapes = {"model.layers.0.self_attn.q_proj.weight": (128, 128),
              "model.layers.0.mlp.down_proj.weight": (128, 352),
              "model.layers.0.input_layernorm.weight": (128,)}
    assert in_dim_problems(shapes, 32) == []
    problems = in_dim_problems(shapes, 64, "ckpt")
    assert problems == ["ckpt: model.layers.0.mlp.down_proj: input dim 352 is not a multiple of "
                        "group_size 64 (W4A8 groups input channels; pick a group size that divides "
                        "every projection's input dim)"]


def test_the_w4a8_quantizer_writes_a_mixed_checkpoints_w8a8_dynamic_layers_as_int8_profile_free():
    """In a ModelSlim mixed W4A8 MoE checkpoint, fn w4a8_profile_free serves the W8A8_DYNAMIC
    layers too (`also_serves`), with the per-channel INT8 rule of int8_profile_free, bit for bit;
    its own type stays W4A8_DYNAMIC (what a bf16 checkpoint's description gets)."""
    import torch

    from npu_flashrl.quant.registry import make_quantizer

    w4 = make_quantizer("w4a8_profile_free", torch.bfloat16, group_size=32)
    i8 = make_quantizer("int8_profile_free", torch.bfloat16)
    assert w4.serves == ("W4A8_DYNAMIC",) and w4.also_serves == ("W8A8_DYNAMIC",)
    assert w4.description_type == "W4A8_DYNAMIC"
    w = torch.randn(48, 64, generator=torch.Generator().manual_seed(0)).bfloat16()
    for transposed in (False, True):
        (q4, s4), (q8, s8) = w4.quantize("x.weight", w, transposed), i8.quantize("x.weight", w, transposed)
        assert q4.dtype == torch.int8 and torch.equal(q4, q8) and torch.equal(s4, s8)
