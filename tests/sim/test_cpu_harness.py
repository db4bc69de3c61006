"""The CPU harness: a REAL vLLM Qwen2ForCausalLM built on the CPU from a tiny offline checkpoint
(q/k/v bias, GQA 4/2 heads, intermediate != hidden, untied lm_head) holds exactly the
transformers model's weights and gives the same logits within bf16 tolerance."""
import pytest
import torch

pytest.importorskip("vllm")

from npu_flashrl.sim.tiny_models import TINY_QWEN2, build_tiny_qwen2  # noqa: E402

pytestmark = pytest.mark.every_line  # line-specific upstream code: runs on every stack line

# Both models run in bf16 (vLLM here with plain causal attention): each matmul/norm rounds to
# bf16 (eps 2^-8 = 0.4%), and the two implementations round in different places (fused qkv /
# gate_up, fp32 attention on the vLLM side, RoPE and RMSNorm internals). Over 2 layers that
# gives ~1% relative difference of the logits (measured 0.95%; each model is ~0.8-0.9% from an
# fp32 run of the same weights). A wrong weight, missing bias or broken attention gives O(1).
LOGITS_REL_TOL = 3e-2


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    from npu_flashrl.sim.cpu_vllm import CpuVllm

    model_dir = str(tmp_path_factory.mktemp("tiny_qwen2"))
    hf = build_tiny_qwen2(model_dir, dtype=torch.bfloat16, seed=0, tokenizer=False).eval()
    with CpuVllm(model_dir, dtype=torch.bfloat16) as vm:
        yield hf, vm


def _expected_vllm_params(hf) -> dict:
    """vLLM Qwen2 parameter name -> the tensor it must hold, from the HF state dict: q/k/v
    concatenated (rows) into qkv_proj, gate/up into gate_up_proj, the rest one to one."""
    sd = dict(hf.state_dict())
    out, used = {}, set()

    def take(name):
        used.add(name)
        return sd[name]

    for i in range(TINY_QWEN2["num_hidden_layers"]):
        p = f"model.layers.{i}"
        for kind in ("weight", "bias"):
            out[f"{p}.self_attn.qkv_proj.{kind}"] = torch.cat(
                [take(f"{p}.self_attn.{s}_proj.{kind}") for s in ("q", "k", "v")], dim=0)
        out[f"{p}.mlp.gate_up_proj.weight"] = torch.cat(
            [take(f"{p}.mlp.gate_proj.weight"), take(f"{p}.mlp.up_proj.weight")], dim=0)
    for name in sd:
        if name not in used:
            out[name] = take(name)
    assert used == set(sd), "every HF tensor is mapped"
    return out


def test_vllm_model_holds_hf_weights_exactly(models):
    hf, vm = models
    from vllm.model_executor.models.qwen2 import Qwen2ForCausalLM

    assert isinstance(vm.model, Qwen2ForCausalLM)
    expected = _expected_vllm_params(hf)
    got = dict(vm.model.named_parameters())
    assert set(got) == set(expected)
    # the tiny config's shapes: GQA qkv = 4*32 + 2*2*32 rows, gate_up = 2*352 rows
    assert got["model.layers.0.self_attn.qkv_proj.weight"].shape == (256, 128)
    assert got["model.layers.0.self_attn.qkv_proj.bias"].shape == (256,)
    assert got["model.layers.0.mlp.gate_up_proj.weight"].shape == (704, 128)
    assert not torch.equal(got["lm_head.weight"], got["model.embed_tokens.weight"])  # untied
    for name, want in expected.items():
        have = got[name].data
        assert have.dtype == torch.bfloat16, name
        assert have.shape == want.shape, name
        assert torch.equal(have, want), f"{name} differs from the HF weights"


@torch.no_grad()
def test_vllm_logits_match_hf(models):
    hf, vm = models
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(0, TINY_QWEN2["vocab_size"], (2, 24), generator=g)
    lv = vm.logits(ids)
    lh = hf(ids).logits.float()
    assert lv.shape == lh.shape == (2, 24, TINY_QWEN2["vocab_size"])
    rel = ((lv - lh).norm() / lh.norm()).item()
    assert rel < LOGITS_REL_TOL, rel
    # the same comparison with the HF logits of other tokens is far off (the check has teeth,
    # and vLLM's logits really depend on the input)
    lh_other = hf(torch.roll(ids, 1, dims=1)).logits.float()
    assert ((lv - lh_other).norm() / lh_other.norm()).item() > 0.3
    # causal: the first position's logits depend only on the first token
    lv_prefix = vm.logits(ids[:, :1])
    assert ((lv_prefix[:, 0] - lv[:, 0]).norm() / lv[:, 0].norm()).item() < 1e-2
