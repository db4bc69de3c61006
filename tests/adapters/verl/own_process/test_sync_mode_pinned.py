"""verl 51d2104's OWN weight sync into a real INT8 rollout model, ended by npu_flashrl (verl 51d2104 never ends a sync itself).

What runs for real: verl 51d2104's `vLLMRollout.update_weights` (its `patch_vllm_moe_model_weight_loader`,
the `model.load_weights` call and vLLM's `process_weights_after_loading` afterwards), fed with the
generator the FSDP worker's `rollout_mode` builds (`convert_weight_keys` over the trainer's fp32
state dict); the rollout model is a tiny Qwen2 built by vLLM's loader on vllm-ascend W8A8_DYNAMIC layers
through npu_flashrl (tests/conftest.py `va`, npu_flashrl/sim/cpu_vllm.py).

Stand-ins, each for what needs an NPU or a cluster:
* `vLLMRollout.__init__` builds a `vllm.LLM` on the device: the rollout is made with
  `object.__new__(vLLMRollout)` and only `inference_engine` is set, a namespace with the two paths
  `update_weights` reads: `llm_engine.model_executor.driver_worker.worker.model_runner.model` (the CPU
  vLLM model) and `llm_engine.vllm_config` (its VllmConfig);
* the FSDP-sharded trainer: its `state_dict()` is the unsharded HF model's fp32 state dict (one CPU
  process has no DTensor, so the worker's `.full_tensor()` branch does not apply).
"""
import asyncio
import os
import sys
import tempfile
import types

import pytest
import torch

from npu_flashrl import patches
from npu_flashrl.sim import cpu_vllm
from npu_flashrl.sim.tiny_models import build_tiny_qwen2
from npu_flashrl.sim.sync import state

from helpers import build

pytestmark = pytest.mark.every_line

DROPPED = "model.layers.1.self_attn.v_proj.weight"


@pytest.fixture(scope="module")
def spmd(verl_51d2104):
    try:
        from verl.workers.rollout.vllm_rollout import vllm_rollout_spmd
    except ImportError as exc:
        pytest.skip(f"verl 51d2104's vLLM rollout does not import on this line ({exc}); it runs on the "
                    "pinned line (vllm 0.10.1)")
    return vllm_rollout_spmd


@pytest.fixture(scope="module")
def ckpts():
    root = tempfile.mkdtemp(prefix="npu_flashrl_verlsync_")
    dirs, models = [], []
    for seed in range(3):
        d = os.path.join(root, f"w{seed}")
        models.append(build_tiny_qwen2(d, seed=seed))
        dirs.append(d)
    return dirs, models


@pytest.fixture(scope="module")
def synced(va, spmd):
    """The sync patch applied the way activation applies it."""
    from npu_flashrl.adapters import verl as verl_adapter

    assert patches.apply_patch(verl_adapter.PATCH_SYNC_END)
    return spmd.vLLMRollout


def rollout_for(cls, v):
    """vLLMRollout without __init__ (stand-in engine: see the module docstring)."""
    rollout = object.__new__(cls)
    worker = types.SimpleNamespace(model_runner=types.SimpleNamespace(model=v.model))
    rollout.inference_engine = types.SimpleNamespace(llm_engine=types.SimpleNamespace(
        model_executor=types.SimpleNamespace(driver_worker=types.SimpleNamespace(worker=worker)),
        vllm_config=v.vllm_config))
    return rollout


def fsdp_weights(hf_model, drop=()):
    """What fsdp_workers.rollout_mode hands to update_weights: convert_weight_keys over the trainer's
    fp32 state dict, streamed as a generator of (HF name, tensor)."""
    from verl.utils.model import convert_weight_keys

    masters = {k: v.detach().float().clone() for k, v in hf_model.state_dict().items()}
    params = convert_weight_keys(masters, hf_model)
    return ((name, param) for name, param in params.items() if name not in drop)


def sync(rollout, weights, update=None):
    update = update or type(rollout).update_weights
    asyncio.run(update(rollout, weights))


def test_complete_sync_equals_a_fresh_int8_load(va, synced, ckpts):
    dirs, models = ckpts
    with build(va, dirs[1]) as fresh:
        want = state(fresh.model)
    with build(va, dirs[0]) as v:
        ptrs = {n: p.data_ptr() for n, p in v.model.named_parameters()}
        rollout = rollout_for(synced, v)
        sync(rollout, fsdp_weights(models[1]))
        got = state(v.model)
        assert got.keys() == want.keys()
        for n in want:
            assert torch.equal(got[n], want[n]), n
        assert v.model._npu_flashrl_loader.pending() == {}
        assert {n: p.data_ptr() for n, p in v.model.named_parameters()} == ptrs  # in place


def test_sync_with_a_dropped_tensor_fails_naming_it_and_keeps_the_layer(va, synced, ckpts):
    dirs, models = ckpts
    with build(va, dirs[2]) as fresh:
        want2 = state(fresh.model)
    with build(va, dirs[0]) as v:
        rollout = rollout_for(synced, v)
        before = state(v.model)
        with pytest.raises(va.WeightSyncError, match=DROPPED.replace(".", r"\.")):
            sync(rollout, fsdp_weights(models[1], drop={DROPPED}))
        after = state(v.model)
        qkv = "model.layers.1.self_attn.qkv_proj.weight"
        assert torch.equal(after[qkv], before[qkv])  # the layer kept its old weights
        assert not torch.equal(after["model.layers.0.self_attn.qkv_proj.weight"],
                               before["model.layers.0.self_attn.qkv_proj.weight"])
        assert v.model._npu_flashrl_loader.pending() == {}  # nothing carried into the next sync
        sync(rollout, fsdp_weights(models[2]))
        got = state(v.model)
        for n in want2:
            assert torch.equal(got[n], want2[n]), n


def test_failed_update_raises_verls_error_and_drops_what_it_staged(va, synced, ckpts):
    """verl's update_weights fails mid-sync (the trainer's stream breaks before layer 1's v_proj,
    after its q/k shards were staged): verl's error is the one raised, nothing staged is left for
    a later sync to commit, and the next complete sync equals a fresh load (the rule shared with
    server mode, adapters/verl/sync_end.py)."""
    dirs, models = ckpts
    with build(va, dirs[1]) as fresh:
        want = state(fresh.model)

    def broken():
        for name, tensor in fsdp_weights(models[2]):
            if name == DROPPED:
                raise RuntimeError("trainer stream broke")
            yield name, tensor

    with build(va, dirs[0]) as v:
        rollout = rollout_for(synced, v)
        before = state(v.model)
        with pytest.raises(RuntimeError, match="trainer stream broke"):
            sync(rollout, broken())
        assert v.model._npu_flashrl_loader.pending() == {}
        qkv = "model.layers.1.self_attn.qkv_proj.weight"
        assert torch.equal(state(v.model)[qkv], before[qkv])
        sync(rollout, fsdp_weights(models[1]))
        got = state(v.model)
        for n in want:
            assert torch.equal(got[n], want[n]), n


def test_without_the_patch_verl_leaves_the_layer_pending_silently(va, synced, ckpts):
    """Documents the defect: verl's own update_weights returns normally after an incomplete sync."""
    dirs, models = ckpts
    upstream = patches.original(synced.update_weights)
    assert upstream is not synced.update_weights
    with build(va, dirs[0]) as v:
        rollout = rollout_for(synced, v)
        sync(rollout, fsdp_weights(models[1], drop={DROPPED}), update=upstream)  # no error
        assert "model.layers.1.self_attn.qkv_proj" in v.model._npu_flashrl_loader.pending()
        with pytest.raises(va.WeightSyncError):
            va.end_weight_sync(v.model)


def test_patch_is_registered_idempotent_and_activated(synced, monkeypatch):
    from npu_flashrl import activation
    from npu_flashrl.adapters import verl as verl_adapter

    wrapped = synced.update_weights
    assert patches.apply_patch(verl_adapter.PATCH_SYNC_END)
    patches.get(verl_adapter.PATCH_SYNC_END).apply_fn()  # applying again never wraps twice
    assert synced.update_weights is wrapped
    assert asyncio.iscoroutinefunction(wrapped)
    assert any(p["name"] == verl_adapter.PATCH_SYNC_END and p["applied"] for p in patches.status())
    from npu_flashrl import verify

    rows = [r for r in verify.patch_rows() if r["check"] == f"patch {verl_adapter.PATCH_SYNC_END}"]
    assert rows and rows[0]["status"] == verify.OK and "vLLMRollout.update_weights" in rows[0]["detail"]
    seen = []
    monkeypatch.setattr(activation.patches, "arm_patches", lambda names: seen.extend(names) or {})
    import npu_flashrl.config as config_mod

    monkeypatch.setattr(config_mod, "load_config", lambda path=None: None)
    try:
        activation.activate("unused.yaml")
    finally:
        from npu_flashrl.adapters import vllm_engine

        vllm_engine.set_config(None)
    assert verl_adapter.PATCH_SYNC_END in seen


def test_when_imported_patches_a_module_imported_later(tmp_path, monkeypatch):
    (tmp_path / "npu_flashrl_late_mod.py").write_text("X = 1\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    sys.modules.pop("npu_flashrl_late_mod", None)
    seen = []
    patches.when_imported("npu_flashrl_late_mod", lambda m: seen.append(m.X))
    assert seen == []
    import npu_flashrl_late_mod  # noqa: F401

    assert seen == [1]
    patches.when_imported("npu_flashrl_late_mod", lambda m: seen.append(m.X + 1))  # already imported
    assert seen == [1, 2]
    sys.modules.pop("npu_flashrl_late_mod", None)
