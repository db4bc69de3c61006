"""vllm-ascend's own W4A8_DYNAMIC linear method (every line's: 0.23.0, 0.11.0, v0.10.1rc1) builds and
runs on the CPU harness with the
emulated int4 ops: a cold load of a ModelSlim W4A8_DYNAMIC checkpoint (group size 32) through
vLLM's loader, `AscendW4A8DynamicLinearMethod.process_weights_after_loading` (which packs with
`npu_convert_weight_to_int4pack` and folds both scale levels), and its `apply`
(`npu_weight_quant_batchmatmul` with `antiquant_group_size`).

Real code: vLLM's model and loader, vllm-ascend's `AscendModelSlimConfig` and W4A8 method.
Stand-ins (named): torch_npu (the reference kernels of `npu_flashrl.kernels.int4`, `Tensor.npu()`
the identity on the emulated machine), vLLM's CPU platform accepting "ascend", plain causal
attention (npu_flashrl.sim.cpu_vllm). The checkpoint is written by the test's ModelSlim-format
writer (tests/support/modelslim_writer.py) with npu_flashrl's staged quantizer: ModelSlim's own
quantizer is compiled and needs its calibration run, not available here."""
import pytest
import torch

from helpers import FUSED

pytestmark = pytest.mark.every_line
GROUP = 32


@pytest.fixture(scope="module")
def w4a8(va, tmp_path_factory):
    from modelslim_writer import require_w4a8_linear, w4a8_checkpoint

    require_w4a8_linear()
    return w4a8_checkpoint(str(tmp_path_factory.mktemp("w4a8")), GROUP)


def _hf(bf16):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(bf16, dtype=torch.bfloat16)


def _weights(hf, i, names):
    mods = hf.model.layers[i]
    return torch.cat([getattr(mods.self_attn if n in ("q_proj", "k_proj", "v_proj", "o_proj") else mods.mlp,
                              n).weight.detach() for n in names])


def test_modelslim_w4a8_cold_load_runs_vllm_ascends_method(w4a8):
    from npu_flashrl.kernels import int4
    from npu_flashrl.sim import cpu_vllm

    bf16, ms = w4a8
    hf = _hf(bf16)
    with cpu_vllm.CpuVllm(ms, quantization="ascend") as v:
        assert getattr(v.model, "_npu_flashrl_loader", None) is None  # not the policy: left alone
        torch.manual_seed(0)
        for i in range(hf.config.num_hidden_layers):
            for path, names in FUSED.items():
                layer = v.model.get_submodule(f"model.layers.{i}.{path}")
                assert type(layer.quant_method.quant_method).__name__ == "AscendW4A8DynamicLinearMethod"
                w = _weights(hf, i, names)
                q = int4.quantize_weight_w4a8(w, GROUP)
                # the processed state, as the reference predicts it bit for bit: the int4 weight
                # packed as [in, out / 8] int32, the first-level scale (held as the model dtype,
                # then fp32) and the antiquant scale [in / group, out] = scale * scale_second
                assert layer.weight.dtype == torch.int32
                assert torch.equal(layer.weight.data, int4.pack_int4(q.q.t().contiguous()))
                scale = q.scale.bfloat16().float()
                assert torch.equal(layer.weight_scale.data, scale)
                assert torch.equal(layer.weight_scale_second.data, scale * q.scale_second.bfloat16().t())
                # the forward: int4 grouped error, far from garbage, not the bf16 layer either
                x = torch.randn(5, w.shape[1]).to(torch.bfloat16)
                ref = x.float() @ w.float().t()
                with torch.no_grad():
                    out, _ = layer(x)
                if layer.bias is not None:
                    out = out - layer.bias.detach()
                err = float((out.float() - ref).norm() / ref.norm())
                assert 0.02 < err < 0.25, f"layer {i} {path}: relative error {err:.4f}"
        assert torch.isfinite(v.logits(torch.tensor([[1, 2, 3, 4, 5]]))).all()
