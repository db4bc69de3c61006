"""vllm-ascend's W4A8_DYNAMIC linear apply drops the bias vLLM's layer hands it (0.23.0, 0.11.0 and
v0.10.1rc1 alike; vllm-ascend PR #11371, open): the named patch `ascend_w4a8_dynamic_linear_bias`
adds it on the policy rollout's layers, and leaves every other model's layers as upstream runs them.

Real code: vLLM's Qwen2 model (its q/k/v carry a bias) and loaders, vllm-ascend's
`AscendModelSlimConfig` and `AscendW4A8DynamicLinearMethod` (its `apply`, post-processing),
npu_flashrl's activation and patches. Stand-ins (named): torch_npu (the emulation:
`kernels.int4` for `npu_weight_quant_batchmatmul` and the int4 pack), vLLM's CPU platform accepting
"ascend", plain causal attention (npu_flashrl.sim.cpu_vllm); the checkpoint is written by the
test's ModelSlim-format writer.
"""
import pytest
import torch

from npu_flashrl.sim import cpu_vllm

pytestmark = pytest.mark.every_line
GROUP = 32


@pytest.fixture(scope="module")
def modelslim(va, tmp_path_factory):
    from modelslim_writer import require_w4a8_linear, w4a8_checkpoint

    require_w4a8_linear()
    return w4a8_checkpoint(str(tmp_path_factory.mktemp("w4a8_bias")), GROUP)[1]


def _qkv(model):
    return next(m for n, m in model.named_modules() if n.endswith("self_attn.qkv_proj"))


def _applies(layer):
    """(what the layer's W4A8 method computes now, what upstream's own apply computes) on one input."""
    from npu_flashrl import patches
    from npu_flashrl.adapters.vllm_ascend.schemes.base import inner_method

    inner = inner_method(layer)
    assert type(inner).__name__ == "AscendW4A8DynamicLinearMethod"
    x = torch.randn(3, int(layer.input_size), generator=torch.Generator().manual_seed(0)).to(layer.bias.dtype)
    upstream = patches.original(type(inner).apply)
    return inner.apply(layer, x, layer.bias), upstream(inner, layer, x, layer.bias)


def test_the_policy_rollouts_w4a8_layers_add_their_bias(modelslim):
    from npu_flashrl import patches

    with cpu_vllm.CpuVllm(modelslim, quantization="ascend", choice=cpu_vllm.int8("w4a8_profile_free")) as v:
        assert any(p["name"] == "ascend_w4a8_dynamic_linear_bias" and p["applied"] for p in patches.status())
        layer = _qkv(v.model)
        assert layer.bias is not None and layer.bias.abs().max() > 0
        now, upstream = _applies(layer)
        # upstream's output lacks the bias; the patched one is upstream's plus the bias, nothing else
        torch.testing.assert_close(now, upstream + layer.bias.to(now.dtype), rtol=0, atol=0)
        assert not torch.allclose(now, upstream)


def test_other_models_w4a8_layers_keep_upstreams_apply(modelslim):
    with cpu_vllm.CpuVllm(modelslim, quantization="ascend") as v:
        now, upstream = _applies(_qkv(v.model))
        assert torch.equal(now, upstream)
