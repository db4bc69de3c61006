"""npu_flashrl.quant: the quantizer registry and the profile quantizer's device handling.

Pure math over npu_flashrl.kernels, no upstream code. The second device is a stand-in: CPU CI has
no NPU, so `meta` plays the device the trainer's weights live on (a profile loads to the CPU).
"""
import pytest
import torch

from npu_flashrl import config, quant
from npu_flashrl.quant import registry


def _profile(out=4, inn=3):
    return {"model.layers.0.mlp.down_proj.weight": {
                "output_scale": torch.full((out, 1), 127.0), "input_scale": torch.ones(1, inn),
                "type": torch.int8},
            "model.layers.0.input_layernorm.weight": {
                "output_scale": 1.0, "input_scale": torch.full((inn,), 2.0), "type": torch.bfloat16}}


def test_profile_tensors_move_to_the_weight_device_once_and_stay():
    """On an NPU the CPU profile scales met device weights at the first sync.
    The quantizer must hand the kernel operands on the weight's device (the kernel refuses a
    mix, see test_kernels), cache the moved entry per device, and leave the CPU profile alone."""
    prof = _profile()
    qz = quant.ProfileQuantizer(prof, torch.bfloat16)
    name = "model.layers.0.mlp.down_proj.weight"
    w = torch.ones(4, 3, dtype=torch.bfloat16, device="meta")
    q, scale = qz.quantize(name, w, transposed=True)
    assert q.device.type == "meta" and q.dtype == torch.int8 and tuple(q.shape) == (4, 3)
    assert scale is None
    moved = qz._on_device[(name, torch.device("meta"))]
    assert moved["output_scale"].device.type == "meta" and moved["input_scale"].device.type == "meta"
    q2, _ = qz.quantize(name, w)
    assert qz._on_device[(name, torch.device("meta"))]["output_scale"] is moved["output_scale"]
    assert prof[name]["output_scale"].device.type == "cpu"  # the profile itself is not changed
    # layernorm smoothing too
    ln = "model.layers.0.input_layernorm.weight"
    out = qz.transform(ln, torch.ones(3, dtype=torch.bfloat16, device="meta"))
    assert out.device.type == "meta" and out.dtype == torch.bfloat16
    # and on the CPU the values are FlashRL's: round(w * 127 * 1)
    qc, _ = qz.quantize(name, torch.full((4, 3), 0.5, dtype=torch.bfloat16))
    assert (qc == 64).all()  # 63.5 rounds half to even -> 64


def test_registry_refuses_a_duplicate_name_and_feeds_the_config():
    with pytest.raises(ValueError, match="'int8' is already registered"):
        registry.register_quantizer("int8")(type("Other", (quant.OnlineQuantizer,), {}))
    assert registry.QUANTIZERS["int8"] is quant.ProfileQuantizer
    assert config.SUPPORTED_FNS == registry.names() + ("bf16",)
    assert set(registry.names()) == {"int8", "int8_profile_free", "w4a8_profile_free"}


def test_make_quantizer_int8_needs_a_profile():
    with pytest.raises(ValueError, match="fn 'int8' needs a FlashRL int8 profile"):
        quant.make_quantizer("int8", torch.bfloat16, None)
    with pytest.raises(ValueError, match="unknown INT8 function 'fp4'"):
        quant.make_quantizer("fp4", torch.bfloat16)
    assert isinstance(quant.make_quantizer("int8_profile_free", torch.float16), quant.PerChannelQuantizer)
