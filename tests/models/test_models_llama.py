"""Llama 3.x (vLLM's LlamaForCausalLM) through the INT8 rollout, on every stack line: no attention
or MLP bias, grouped-query attention, llama3 rope scaling, tied embeddings (the 1B / 3B sizes).

Real vLLM LlamaForCausalLM + vllm-ascend's W8A8_DYNAMIC linear method on the CPU; a tiny Llama
(2 layers) built offline (`sim.tiny_models.build_tiny_llama`). The trainer's weights are the HF
state dict (tied `lm_head.weight` included, as FSDP sends it). Stand-ins: torch_npu (reference
kernels), vLLM attention (plain causal SDPA: vllm-ascend's attention kernels need an NPU; the
weights they read, q/k/v and o, are compared bit for bit), verl's IPC sender (`sim.sync.
BucketBuffer`).
"""
import os

import pytest
import torch

from npu_flashrl import kernels
from npu_flashrl.sim.tiny_models import build_tiny_llama, trainer_weights

from helpers import FUSED, build
from models_checks import three_syncs

pytestmark = pytest.mark.every_line

IDS = torch.randint(0, 512, (2, 10), generator=torch.Generator().manual_seed(0))
ATTN = ("q_proj", "k_proj", "v_proj", "o_proj")


@pytest.fixture(scope="module")
def llama(tmp_path_factory):
    root = str(tmp_path_factory.mktemp("llama"))
    dirs = [os.path.join(root, f"w{s}") for s in range(4)]
    return dirs, [build_tiny_llama(d, seed=s, tokenizer=False) for s, d in enumerate(dirs)]


def check(hf):
    def run(model, k):
        ref = hf[k]
        assert model.lm_head.weight is model.model.embed_tokens.weight  # tied, unquantized
        assert torch.equal(model.lm_head.weight, ref.model.embed_tokens.weight)
        for i in range(ref.config.num_hidden_layers):
            mods = ref.model.layers[i]
            assert not hasattr(model.get_submodule(f"model.layers.{i}.self_attn.qkv_proj"), "bias") or \
                model.get_submodule(f"model.layers.{i}.self_attn.qkv_proj").bias is None
            for path, names in FUSED.items():
                layer = model.get_submodule(f"model.layers.{i}.{path}")
                qs = [kernels.quantize_weight_per_channel(
                    getattr(mods.self_attn if n in ATTN else mods.mlp, n).weight.detach(),
                    torch.bfloat16)[0] for n in names]
                assert layer.weight.dtype == torch.int8
                assert torch.equal(layer.weight.data, torch.cat(qs).t()), f"layer {i} {path}"
    return run


def test_llama_cold_load_and_three_syncs_equal_fresh_int8_loads(va, llama):
    """Cold INT8 load, then 3 syncs (fp32 masters, bf16, bf16 after a NaN refused by name) in
    random buckets splitting q/k/v and gate/up: each bit-identical to a fresh INT8 load, pointers
    unchanged, logits equal (`models_checks.three_syncs`)."""
    dirs, models = llama
    fused = {f"model.layers.{i}.{path}": [f"model.layers.{i}.{'self_attn' if n in ATTN else 'mlp'}.{n}.weight"
                                          for n in names]
             for i in range(2) for path, names in FUSED.items() if len(names) > 1}
    out = three_syncs(va, dirs, lambda k: trainer_weights(models[k]), IDS, fused,
                      nan_name="model.layers.1.self_attn.k_proj.weight", check=check(models))
    assert all(n >= 1 for n in out["split_fused_layers"])


def test_llama_int8_logits_track_bf16(va, llama):
    """The INT8 rollout of Llama (rope scaling, tied head) stays close to vLLM's bf16 model."""
    dirs, _ = llama
    with build(va, dirs[0], fn=None, ascend=False) as ref:
        want = ref.logits(IDS)
    with build(va, dirs[0]) as v:
        got = v.logits(IDS)
    err = ((got - want).norm() / want.norm()).item()
    assert err < 0.1, f"relative logit error {err:.3f}"


def test_llama_int8_wire_commits_the_trainers_int8_as_a_fresh_load(va, llama):
    """The INT8 wire's receiving end (trainer stream through `quant.wire.int8_wire`, delivered
    in random buckets): every Llama projection travels as int8 + scale, the rollout quantizes
    nothing again, the state equals a fresh INT8 load. (verl's sender process is driven in
    tests/adapters/vllm_ascend/test_int8_wire.py for Qwen2; the names and shapes here are what differs.)"""
    from models_checks import wire_syncs

    dirs, models = llama
    counts = wire_syncs(va, dirs, lambda k: trainer_weights(models[k]), IDS)
    assert counts == {"int8": 2 * 7, "quantized_on_arrival": 0}
