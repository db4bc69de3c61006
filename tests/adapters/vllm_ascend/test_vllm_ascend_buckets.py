"""Weight syncs the way verl 0.9 (server mode) delivers them, on every stack line.

verl 0.9.1's `update_weights_from_ipc` calls `model.load_weights` once per bucket with VIEWS of a
reused buffer (q/k/v or gate/up of one layer may sit in different buckets, and the next bucket
overwrites the buffer), then vLLM's `process_weights_after_loading` once per sync. Here the real
vLLM model (`CpuVllm`, real vLLM + vllm-ascend W8A8 layers) gets exactly that: the bucket buffer
and the post-sync call are the only stand-ins for verl's sender (no ZMQ / IPC on a CPU test).
Also: dense Qwen3 (q_norm / k_norm, no q/k/v bias), Qwen2 with tied embeddings, NZ on and off,
and vLLM 0.23's own layerwise reload next to the run-once post-processing guard.
Stand-ins: torch_npu (reference kernels), vLLM attention (plain causal SDPA on the CPU).
"""
import os
import tempfile

import pytest
import torch

from npu_flashrl import lines, kernels
from npu_flashrl.sim import ascend_harness
from npu_flashrl.sim import cpu_vllm
from npu_flashrl.sim.sync import BucketBuffer, assert_same_state, post_sync, ptrs, split_buckets, state
from npu_flashrl.sim.tiny_models import build_tiny_qwen2, build_tiny_qwen3

from helpers import FUSED, build, fresh_states, layerwise_reload

pytestmark = pytest.mark.every_line

ATTN = ("q_proj", "k_proj", "v_proj", "o_proj")


def _make(kind, seeds):
    root = tempfile.mkdtemp(prefix=f"npu_flashrl_sync_{kind}_")
    dirs, models = [], []
    for seed in seeds:
        d = os.path.join(root, f"w{seed}")
        if kind == "qwen3":
            models.append(build_tiny_qwen3(d, seed=seed, tokenizer=False))
        elif kind == "qwen2_tied":
            models.append(build_tiny_qwen2(d, seed=seed, tokenizer=False,
                                           config_overrides={"tie_word_embeddings": True}))
        else:
            models.append(build_tiny_qwen2(d, seed=seed, tokenizer=False))
        dirs.append(d)
    return dirs, models


@pytest.fixture(scope="module")
def qwen2():
    return _make("qwen2", range(3))


@pytest.fixture(scope="module")
def qwen3():
    return _make("qwen3", range(3))


@pytest.fixture(scope="module")
def qwen2_tied():
    return _make("qwen2_tied", range(3))


def trainer_weights(model):
    """What an FSDP trainer's state dict holds: every HF name (tied lm_head included), bf16."""
    return [(n, t.detach().clone()) for n, t in model.state_dict().items()]


def check_against_reference(model, hf):
    """Every quantized layer holds the per-channel INT8 of the HF weights, [in, out]."""
    for i in range(hf.config.num_hidden_layers):
        mods = hf.model.layers[i]
        for path, names in FUSED.items():
            layer = model.get_submodule(f"model.layers.{i}.{path}")
            qs, ss = zip(*(kernels.quantize_weight_per_channel(
                getattr(mods.self_attn if n in ATTN else mods.mlp, n).weight.detach(),
                torch.bfloat16) for n in names))
            assert torch.equal(layer.weight.data, torch.cat(qs).t()), f"layer {i} {path}"
            torch.testing.assert_close(layer.weight_scale.data.float(), torch.cat(ss), rtol=4e-3, atol=0)
            assert torch.equal(layer.weight_scale_fp32, layer.weight_scale.data.float())


# --------------------------------------------------------------------------- models

@pytest.mark.parametrize("kind", ["qwen3", "qwen2_tied"])
def test_model_cold_load_and_syncs_equal_fresh_loads(va, request, kind):
    dirs, models = request.getfixturevalue(kind)
    fresh = fresh_states(va, dirs, (1, 2))
    with build(va, dirs[0]) as v:
        m = v.model
        check_against_reference(m, models[0])
        p = dict(m.named_parameters())
        if kind == "qwen3":
            assert "model.layers.0.self_attn.q_norm.weight" in p
            assert "model.layers.0.self_attn.qkv_proj.bias" not in p
            assert p["model.layers.0.self_attn.qkv_proj.weight"].shape == (128, 4 * 48 + 2 * 2 * 48)
        else:
            # tied: one tensor serves as embedding and lm_head, unquantized
            assert m.lm_head.weight is m.model.embed_tokens.weight
            assert torch.equal(m.lm_head.weight, models[0].model.embed_tokens.weight)
        before = ptrs(m)
        for k in (1, 2):
            m.load_weights(trainer_weights(models[k]))
            va.end_weight_sync(m)
            post_sync(v)
            assert_same_state(state(m), fresh[k])
            check_against_reference(m, models[k])
            assert ptrs(m) == before


# --------------------------------------------------------------------------- buckets

def test_buckets_splitting_qkv_and_gate_up_commit_only_complete_layers(va, qwen2):
    dirs, models = qwen2
    with build(va, dirs[1]) as f:
        want = state(f.model)
    with build(va, dirs[0]) as v:
        m = v.model
        w = dict(trainer_weights(models[1]))
        layer0 = "model.layers.0"
        first = [f"{layer0}.self_attn.q_proj.weight", f"{layer0}.mlp.gate_proj.weight"]
        second = [f"{layer0}.self_attn.k_proj.weight", f"{layer0}.mlp.up_proj.weight"]
        third = [f"{layer0}.self_attn.v_proj.weight"]
        old = state(m)
        buffer = BucketBuffer(1 << 20)
        buffer.deliver(m, [(n, w[n]) for n in first])
        assert m._npu_flashrl_loader.pending() == {
            f"{layer0}.self_attn.qkv_proj": ["q_proj"], f"{layer0}.mlp.gate_up_proj": ["gate_proj"]}
        buffer.deliver(m, [(n, w[n]) for n in second])
        # gate/up complete: committed; q/k/v still waits for v, live weights untouched
        assert list(m._npu_flashrl_loader.pending()) == [f"{layer0}.self_attn.qkv_proj"]
        now = state(m)
        assert torch.equal(now[f"{layer0}.self_attn.qkv_proj.weight"], old[f"{layer0}.self_attn.qkv_proj.weight"])
        assert torch.equal(now[f"{layer0}.mlp.gate_up_proj.weight"], want[f"{layer0}.mlp.gate_up_proj.weight"])
        buffer.deliver(m, [(n, w[n]) for n in third])
        rest = [(n, t) for n, t in w.items() if n not in first + second + third]
        for bucket in split_buckets(rest, 64 << 10):
            buffer.deliver(m, bucket)
        va.end_weight_sync(m)
        post_sync(v)
        assert_same_state(state(m), want)


@pytest.mark.parametrize("bucket_kb", [16, 256])
def test_reused_bucket_buffer_overwritten_after_each_call_leaves_model_right(va, qwen2, bucket_kb):
    dirs, models = qwen2
    with build(va, dirs[2]) as f:
        want = state(f.model)
    with build(va, dirs[0]) as v:
        m = v.model
        before = ptrs(m)
        buffer = BucketBuffer(1 << 20)
        for bucket in split_buckets(trainer_weights(models[2]), bucket_kb << 10):
            buffer.deliver(m, bucket)
        va.end_weight_sync(m)
        post_sync(v)
        assert_same_state(state(m), want)  # no NaN from the overwritten buffer anywhere
        assert ptrs(m) == before


def test_post_processing_after_every_sync_equals_a_fresh_load(va, qwen2):
    dirs, models = qwen2
    fresh = fresh_states(va, dirs, (0, 1, 2))
    with build(va, dirs[0]) as v:
        m = v.model
        before = ptrs(m)
        post_sync(v)  # a post-processing call with nothing new is a no-op too
        assert_same_state(state(m), fresh[0])
        for k in (1, 2, 1):
            buffer = BucketBuffer(1 << 20)
            for bucket in split_buckets(trainer_weights(models[k]), 64 << 10):
                buffer.deliver(m, bucket)
            va.end_weight_sync(m)
            post_sync(v)
            assert_same_state(state(m), fresh[k])
            assert ptrs(m) == before


# --------------------------------------------------------------------------- NZ

@pytest.mark.parametrize("enable_nz", [True, False], ids=["nz", "nd"])
def test_nz_on_and_off_kept_across_syncs(va, qwen2, enable_nz):
    from npu_flashrl.kernels import reference

    dirs, models = qwen2
    try:
        with build(va, dirs[1], enable_nz=enable_nz) as f:
            if ascend_harness.nz_flag_target() is None and not enable_nz:
                pytest.skip(f"vllm-ascend {lines.current().name} always NZ-casts W8A8 weights")
            want = state(f.model)
        with build(va, dirs[0], enable_nz=enable_nz) as v:
            assert ascend_harness.nz_enabled() == enable_nz
            m = v.model
            layers = [m.get_submodule(f"model.layers.{i}.{p}") for i in range(2) for p in FUSED]
            fmt = 29 if enable_nz else 2  # ACL_FORMAT_FRACTAL_NZ / ND
            assert all(reference.get_npu_format(layer.weight) == fmt for layer in layers)
            m.load_weights(trainer_weights(models[1]))
            va.end_weight_sync(m)
            post_sync(v)
            assert all(reference.get_npu_format(layer.weight) == fmt for layer in layers)
            assert_same_state(state(m), want)
    finally:
        cpu_vllm.prepare_process(enable_nz=True)  # the other tests' default


# --------------------------------------------------------------------------- vLLM's layerwise reload

def checkpoint_format(model):
    """Checkpoint-format INT8 of an HF model from npu_flashrl's kernel: int8 [out, in] weights
    with weight_scale / weight_offset [out, 1] (what vLLM's layerwise reload expects)."""
    out = []
    for n, t in model.state_dict().items():
        if n.endswith("_proj.weight"):
            q, s = kernels.quantize_weight_per_channel(t.detach(), torch.bfloat16)
            base = n[: -len("weight")]
            out += [(n, q), (base + "weight_scale", s.to(t.dtype).unsqueeze(1)),
                    (base + "weight_offset", torch.zeros_like(s, dtype=t.dtype).unsqueeze(1))]
        else:
            out.append((n, t.detach().clone()))
    return out


@pytest.mark.parametrize("fed", ["checkpoint_int8", "trainer_bf16"])
def test_vllm_layerwise_reload_runs_through_the_run_once_guard(va, qwen2, fed):
    """vLLM's reload restores each layer's checkpoint layout and reruns post-processing: the
    guard lets that run. It needs checkpoint-format int8 + scales; bf16 trainer weights, which
    vLLM's own loader would truncate into the int8 parameters, are quantized on the way by
    npu_flashrl's loader (the model's load_weights)."""
    reload = layerwise_reload()
    dirs, models = qwen2
    fresh = fresh_states(va, dirs, (1, 2))
    with build(va, dirs[0]) as v:
        m = v.model
        before = ptrs(m)
        reload.initialize_layerwise_reload(m)
        # in buckets of a reused buffer: vLLM buffers a layer's tensors until it is complete,
        # npu_flashrl's loader hands it copies
        weights = checkpoint_format(models[1]) if fed == "checkpoint_int8" else trainer_weights(models[1])
        buffer = BucketBuffer(1 << 20)
        for bucket in split_buckets(weights, 32 << 10):
            buffer.deliver(m, bucket)
        reload.finalize_layerwise_reload(m, v.vllm_config.model_config)
        assert_same_state(state(m), fresh[1])
        assert ptrs(m) == before
        # and npu_flashrl's in-place sync plus verl's post-processing call still work after it
        m.load_weights(trainer_weights(models[2]))
        va.end_weight_sync(m)
        post_sync(v)
        assert_same_state(state(m), fresh[2])
        assert ptrs(m) == before
