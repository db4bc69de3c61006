"""Qwen2.5-VL and Qwen3-VL (vLLM's Qwen2_5_VLForConditionalGeneration /
Qwen3VLForConditionalGeneration) through the INT8 rollout, current line:
the language model's projections W8A8_DYNAMIC, the vision tower and merger 16-bit, vLLM's
multimodal name mapping honoured (the trainer sends transformers 5's in-memory names
`model.language_model.*` / `model.visual.*` / `lm_head.*`, the checkpoint on disk has the
pre-4.52 names, vLLM holds `language_model.model.*` / `visual.*`), and an image prompt through the
rollout after the syncs.

Real vLLM Qwen2.5-VL / Qwen3-VL + vllm-ascend's W8A8_DYNAMIC linear method on the CPU; tiny
models (2 text layers, 2 vision blocks; Qwen3-VL with a deepstack merger) built offline
(`sim.tiny_models.build_tiny_qwen2_5_vl`, `build_tiny_qwen3_vl`).
Stand-ins: torch_npu (reference kernels), vLLM's text attention (plain causal SDPA), the image
processor's output and the request's multimodal record (`sim.vl_rollout`), verl's IPC sender
(`sim.sync.BucketBuffer`).
"""
import os

import pytest
import torch

from npu_flashrl import kernels
from npu_flashrl.sim import vl_rollout
from npu_flashrl.sim.tiny_models import build_tiny_qwen2_5_vl, build_tiny_qwen3_vl, trainer_weights

from helpers import FUSED, build
from models_checks import three_syncs, wire_syncs

pytestmark = pytest.mark.skipif(
    not __import__("importlib").util.find_spec("torchvision"),
    reason="vLLM's Qwen2.5-VL / Qwen3-VL import torchvision (the current line's CPU stack has it)")
BUILDERS = {"qwen2_5_vl": build_tiny_qwen2_5_vl, "qwen3_vl": build_tiny_qwen3_vl}

ATTN = ("q_proj", "k_proj", "v_proj", "o_proj")
LM, HF_LM = "language_model.model.layers", "model.language_model.layers"


@pytest.fixture(scope="module", params=sorted(BUILDERS))
def vl(request, tmp_path_factory):
    root = str(tmp_path_factory.mktemp(request.param))
    dirs = [os.path.join(root, f"w{s}") for s in range(4)]
    models = [BUILDERS[request.param](d, seed=s, tokenizer=False) for s, d in enumerate(dirs)]
    image = vl_rollout.image_inputs(models[0].config)
    return dirs, models, image, vl_rollout.prompt(models[0].config, image)


_IMAGE = {}


def image_logits(v, ids):
    """The multimodal prefill (one forward object for the module's fresh-load cache)."""
    return vl_rollout.logits(v, ids.reshape(-1), _IMAGE["image"])


def check(hf):
    def run(model, k):
        ref = hf[k].state_dict()
        for name, mod in model.named_modules():
            if name.startswith("visual.") and hasattr(mod, "quant_method"):
                assert mod.weight.dtype == torch.bfloat16, f"{name}: vision tower must stay 16-bit"
                assert "Unquantized" in type(mod.quant_method).__name__, name
                hf_name = f"model.{name}"
                want = torch.cat([ref[hf_name.replace("gate_up_proj", p) + ".weight"] for p in ("gate_proj", "up_proj")]) \
                    if name.endswith("gate_up_proj") else ref[hf_name + ".weight"]
                assert torch.equal(mod.weight, want), f"sync {k}: {name}"
        for i in range(hf[k].config.text_config.num_hidden_layers):
            for path, names in FUSED.items():
                layer = model.get_submodule(f"{LM}.{i}.{path}")
                part = path.split(".")[0]
                qs = [kernels.quantize_weight_per_channel(ref[f"{HF_LM}.{i}.{part}.{n}.weight"],
                                                          torch.bfloat16)[0] for n in names]
                assert layer.weight.dtype == torch.int8
                assert torch.equal(layer.weight.data, torch.cat(qs).t()), f"sync {k}: layer {i} {path}"
    return run


def test_vl_cold_load_and_three_syncs_equal_fresh_int8_loads(va, vl):
    """Cold INT8 load from the checkpoint's names, then 3 syncs of the trainer's names (fp32
    masters, bf16, bf16 after a NaN refused by name) in random buckets splitting q/k/v and
    gate/up: each bit-identical to a fresh INT8 load (the vision tower's 16-bit weights
    included), pointers unchanged, the image prompt's logits equal (`models_checks.three_syncs`)."""
    dirs, models, image, ids = vl
    _IMAGE["image"] = image
    fused = {f"{HF_LM}.{i}.{path}": [f"{HF_LM}.{i}.{path.split('.')[0]}.{n}.weight" for n in names]
             for i in range(2) for path, names in FUSED.items() if len(names) > 1}
    out = three_syncs(va, dirs, lambda k: trainer_weights(models[k]), ids, fused,
                      nan_name="lm_head.weight", check=check(models), logits=image_logits)
    assert all(n >= 1 for n in out["split_fused_layers"])


def test_vl_image_rollout_after_a_sync_tracks_bf16(va, vl):
    """An image prompt through the INT8 rollout after a sync: its logits stay close to vLLM's
    bf16 model of the same weights, and a greedy rollout runs to its end."""
    dirs, models, image, ids = vl
    with build(va, dirs[1], fn=None, ascend=False) as ref:
        want = vl_rollout.logits(ref, ids, image)
    with build(va, dirs[0]) as v:
        v.model.load_weights(trainer_weights(models[1]))
        assert va.end_weight_sync(v.model) == []
        got = vl_rollout.logits(v, ids, image)
        tokens = vl_rollout.greedy(v, ids, image, steps=3)
    err = ((got - want).norm() / want.norm()).item()
    assert err < 0.1, f"relative logit error {err:.3f}"
    assert tokens.shape == (3,) and int(tokens.max()) < models[0].config.text_config.vocab_size


def test_vl_int8_wire_commits_the_trainers_int8_as_a_fresh_load(va, vl):
    """The INT8 wire's receiving end with the trainer's VL names: every language-model projection
    travels int8 + scale (the vision tower's travel 16-bit: the wire's rule names decoder layers),
    the rollout quantizes nothing again, the state equals a fresh INT8 load."""
    dirs, models, image, ids = vl
    _IMAGE["image"] = image
    counts = wire_syncs(va, dirs, lambda k: trainer_weights(models[k]), ids, logits=image_logits)
    assert counts == {"int8": 2 * 7, "quantized_on_arrival": 0}
