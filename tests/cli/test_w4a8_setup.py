"""`npu-flashrl setup` and `verify` with a W4A8 entry (`fn: w4a8_profile_free`, `group_size`):
the checkpoint is checked from its safetensors headers as the engine will build it. A bare bf16
checkpoint whose projection input dims the group size does not divide, a ModelSlim W4A8
checkpoint whose tensors or group size do not match its description (or the entry's), and a
compressed-tensors checkpoint are refused naming the layer / file; a sound one is written and
verified OK. The checkpoints: the tiny Qwen2 (input dims 128 and 352) and the test's
ModelSlim-format writer (tests/support/modelslim_writer.py; ModelSlim itself is compiled and
needs a calibration run). No engine is built here (that path:
tests/adapters/vllm_ascend/test_w4a8_group_size.py)."""
import json
import os
import shutil

import pytest

from npu_flashrl import commands, verify
from npu_flashrl.errors import CliError

FN = "w4a8_profile_free"


@pytest.fixture(scope="module")
def ckpts(tmp_path_factory):
    """(bf16 dir, W8A8 compressed-tensors dir, ModelSlim W4A8 dir of group 32)."""
    from modelslim_writer import write_modelslim_w4a8

    from npu_flashrl.sim.checkpoints import tiny_checkpoint_pair

    root = tmp_path_factory.mktemp("w4a8_setup")
    bf16, w8a8 = tiny_checkpoint_pair(str(root))
    ms = str(root / "modelslim_w4a8")
    write_modelslim_w4a8(bf16, ms, group_size=32)
    return bf16, w8a8, ms


def setup(tmp_path, model, *columns):
    return commands.setup(FN, model, output=str(tmp_path / "cfg.yaml"), columns=columns)


def rows(path):
    return [r for r in verify.config_rows(str(path)) if r["check"].startswith("configs[0]")]


def test_setup_writes_a_w4a8_entry_for_a_bf16_checkpoint_and_verify_passes_it(ckpts, tmp_path):
    cfg = setup(tmp_path, ckpts[0], "group_size=32")
    assert cfg.entries[0].fn == FN and cfg.entries[0].group_size == 32
    with open(cfg.path) as f:
        assert "group_size: 32" in f.read()
    assert [r["status"] for r in rows(cfg.path)] == [verify.OK]


def test_a_group_size_that_does_not_divide_a_bf16_projection_is_refused_naming_it(ckpts, tmp_path):
    with pytest.raises(CliError, match=r"model\.layers\.0\.mlp\.down_proj: input dim 352 is not a "
                                       r"multiple of group_size 64"):
        setup(tmp_path, ckpts[0], "group_size=64")
    # the default 256 divides neither 128 nor 352: every one of the 14 projections
    with pytest.raises(CliError, match=r"down_proj: input dim 352 is not a multiple of group_size "
                                       r"256 .*\(\+13 more\)"):
        setup(tmp_path, ckpts[0])
    assert not os.path.exists(tmp_path / "cfg.yaml")
    path = tmp_path / "by_hand.yaml"
    path.write_text(f"configs:\n  - fn: {FN}\n    model: {ckpts[0]}\n    group_size: 64\n")
    (row,) = rows(path)
    assert row["status"] == verify.FAIL and "down_proj: input dim 352" in row["detail"]


def test_setup_refuses_group_size_0_naming_why(ckpts, tmp_path):
    """0 is per-channel, W4A8 fused-MoE experts of a ModelSlim checkpoint only: a bf16 checkpoint
    is refused naming the key and why."""
    with pytest.raises(CliError, match=r"group_size = 0 \(per-channel\) needs a ModelSlim W4A8 "
                                       r"checkpoint whose W4A8_DYNAMIC layers are all fused-MoE experts"):
        setup(tmp_path, ckpts[0], "group_size=0")


def test_a_modelslim_w4a8_checkpoint_is_checked_against_its_description(ckpts, tmp_path):
    from safetensors.torch import load_file, save_file

    ms = ckpts[2]
    assert setup(tmp_path, ms).entries[0].group_size is None  # the checkpoint's own 32
    assert setup(tmp_path, ms, "group_size=32").entries[0].group_size == 32
    with pytest.raises(CliError, match=r"group_size 32, and the FlashRL config entry says group_size 16"):
        setup(tmp_path, ms, "group_size=16")
    # one layer's second-level scale of another group size than the description's
    bad = str(tmp_path / "bad_ms")
    shutil.copytree(ms, bad)
    tensors = load_file(os.path.join(bad, "model.safetensors"))
    name = "model.layers.1.mlp.up_proj.weight_scale_second"
    tensors[name] = tensors[name][:, ::2].contiguous()
    save_file(tensors, os.path.join(bad, "model.safetensors"))
    with pytest.raises(CliError, match=rf"{name}: shape \[352, 2\], expected \[352, 4\] for weight "
                                       r"\[352, 128\] and group_size 32"):
        setup(tmp_path, bad)
    # a projection the description types W4A8_DYNAMIC without its tensors
    del tensors["model.layers.0.self_attn.o_proj.weight_offset_second"]
    save_file(tensors, os.path.join(bad, "model.safetensors"))
    path = tmp_path / "ms.yaml"
    path.write_text(f"configs:\n  - fn: {FN}\n    model: {bad}\n")
    (row,) = rows(path)
    assert row["status"] == verify.FAIL
    assert ("model.layers.0.self_attn.o_proj: typed W4A8_DYNAMIC in quant_model_description.json, "
            "but the checkpoint has no model.layers.0.self_attn.o_proj.weight_offset_second") in row["detail"]


def test_modelslims_packed_layout_and_a_compressed_tensors_checkpoint_are_refused(ckpts, tmp_path):
    packed = str(tmp_path / "packed")
    shutil.copytree(ckpts[2], packed)
    desc_path = os.path.join(packed, "quant_model_description.json")
    with open(desc_path) as f:
        desc = json.load(f)
    desc["version"] = "1.0.0"
    with open(desc_path, "w") as f:
        json.dump(desc, f)
    with pytest.raises(CliError, match=r"version '1\.0\.0' is ModelSlim's packed W4A8 layout"):
        setup(tmp_path, packed)
    with pytest.raises(CliError, match=r"quantization_config .*builds W8A8 layers, which fn "
                                       r"w4a8_profile_free does not serve"):
        setup(tmp_path, ckpts[1])


def test_a_mixed_modelslim_checkpoint_is_written_and_verify_says_which_layers_are_int8(ckpts, tmp_path, caplog):
    """ModelSlim's mixed W4A8 MoE layout (W8A8_DYNAMIC attention, W4A8_DYNAMIC MLP here, on the
    tiny Qwen2): `setup` writes the entry and logs which quantizer rewrites which layers, `verify`
    passes it saying the same; a static W8A8 projection in it is refused naming it."""
    import logging

    from modelslim_writer import write_modelslim_w4a8

    mixed = str(tmp_path / "mixed")
    write_modelslim_w4a8(ckpts[0], mixed, group_size=32, quantize=lambda n: ".mlp." in n,
                         w8a8_dynamic=lambda n: True)
    with caplog.at_level(logging.INFO, logger="npu_flashrl"):
        cfg = setup(tmp_path, mixed)
    said = "ModelSlim mixed W4A8 checkpoint: 8 W8A8_DYNAMIC projection(s) re-quantized INT8"
    assert any(said in r.getMessage() for r in caplog.records)
    (row,) = rows(cfg.path)
    assert row["status"] == verify.OK and said in row["detail"] and "6 W4A8_DYNAMIC" in row["detail"]
    path = os.path.join(mixed, "quant_model_description.json")
    with open(path) as f:
        desc = json.load(f)
    desc["model.layers.1.self_attn.v_proj.weight"] = "W8A8"
    with open(path, "w") as f:
        json.dump(desc, f)
    with pytest.raises(CliError, match=r"model\.layers\.1\.self_attn\.v_proj is typed W8A8 .*serves "
                                       r"W4A8_DYNAMIC and W8A8_DYNAMIC layers only"):
        setup(tmp_path / "x", mixed)
