"""verl 0.9 server mode: weight syncs through verl's real bucketed transfer, and the engine build
through verl's real `vLLMHttpServer`, on CPU.

The sync tests run verl's real `BucketedWeightSender` in a separate process
(`npu_flashrl.sim.verl_transfer`) and verl's real
`vLLMColocateWorkerExtension.update_weights_from_ipc` (npu_flashrl's patches applied) in this
one. They use POSIX shared memory with 1 MB buckets and push new weights into a vLLM model built on
the CPU harness. The tiny Qwen3-MoE (vLLM's Qwen3MoeForCausalLM on vllm-ascend's
AscendW8A8DynamicFusedMoEMethod) is fed what verl 0.9.1's FSDP engine sends
(`verl_transfer.fsdp_engine_params`: fp32 master weights, verl's own `convert_weight_keys` and
`unfuse_moe_params`, i.e. per-expert names) in 256 KB buckets, so each layer's experts arrive
over several buckets. Stand-ins, each for something that needs a GPU/NPU:
- the FSDP-wrapped actor module behind `get_per_tensor_param`: the unwrapped HF model's state
  dict (on one trainer rank `full_tensor()` is the whole parameter; `fsdp_engine_params`);
- `get_torch_device` / `is_support_ipc` inside verl's `bucketed_weight_transfer`: the CPU device
  module and no IPC (`verl_transfer.use_cpu_device`; on a CPU verl picks its CUDA platform);
- the vLLM worker the extension is mixed into: an object carrying `model_runner.model`,
  `model_runner.vllm_config`, `device` and `local_rank` (`verl_transfer.make_worker`; verl's
  `__new__`, which sets a parent-death signal for vLLM's worker process, is not run);
- attention: plain causal attention (`cpu_vllm.use_plain_attention`), torch_npu emulated;
- MoE: the torch_npu / vllm-ascend fused-MoE kernels are the emulation's reference kernels
  (`kernels.moe_reference`), the HCCL name of vllm-ascend's mc2 group and the expert-parallel
  group of a process that built a dense model first are the CPU harness's (`cpu_vllm`).
The engine-build test's stand-ins are listed in tests/support/verl_server_engine.py.
"""
import json
import os
import subprocess
import sys
import tempfile

import pytest
import torch
from helpers import forward_tensors, restore_environ, set_verl_replica_env
from verl_server_rig import (SHAPE, assert_state, build_rollout, engine_choice, fresh_state, need_int8,
                             replica_handle, rollout_worker, split_layers)
from verl_server_rig import int8_ready  # noqa: F401  (a fixture)

from npu_flashrl import lines
from npu_flashrl.sim import verl_transfer

pytestmark = [
    pytest.mark.every_line,
    pytest.mark.skipif(not lines.verl_server_mode(),
                       reason="needs verl with server-mode bucketed syncs (0.7.1+, e.g. 0.9.1)"),
]

ROOT = os.path.abspath(os.path.join(os.path.dirname(__file__), "..", "..", ".."))
BUCKET_MB = 1
# the tiny Qwen3-MoE at its own shape (hidden 128, 8 experts of 96): one layer's experts are
# 1.2 MB in the trainer's fp32, so 256 KB buckets spread them over about five buckets
MOE_BUCKET_BYTES = 256 << 10
SYNC_OPTS = {"qwen3_moe": {"bucket_bytes": MOE_BUCKET_BYTES}}
TIMEOUT_S = 300


def _env():
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(p for p in (ROOT, env.get("PYTHONPATH")) if p)
    env.setdefault("TORCH_DEVICE_BACKEND_AUTOLOAD", "0")
    env["VLLM_PLUGINS"] = "none"
    env.pop("FLASHRL_CONFIG", None)
    return env


class Sender(verl_transfer.SenderProcess):
    """verl's BucketedWeightSender in its own process (the trainer side of a sync), 1 MB buckets."""

    def __init__(self, handle: str, env: dict):
        super().__init__(handle, env, timeout_s=TIMEOUT_S)

    def send(self, weights: str, **opts) -> None:
        super().send(weights, **{"bucket_mb": BUCKET_MB, **opts})


@pytest.fixture(scope="module")
def rig(int8_ready):
    """Checkpoints w0..w3, their HF state dicts as the trainer sends them, the sender process,
    and this process set up as a vLLM worker with npu_flashrl's patches."""
    from npu_flashrl.sim import verl_transfer
    from npu_flashrl.sim.tiny_models import (build_tiny_qwen2, build_tiny_qwen3,
                                                 build_tiny_qwen3_moe)

    saved = set_verl_replica_env("test")
    root = tempfile.mkdtemp(prefix="npu_flashrl_verl_server_")
    archs = {}
    # (builder, checkpoints, config overrides, what the trainer sends)
    setups = {"qwen2": (build_tiny_qwen2, 4, SHAPE, lambda m: m.named_parameters()),
              "qwen3": (build_tiny_qwen3, 3, SHAPE, lambda m: m.named_parameters()),
              "qwen3_moe": (build_tiny_qwen3_moe, 4, None, verl_transfer.fsdp_engine_params)}
    for arch, (build, n, shape, sent) in setups.items():
        dirs, files, hf = [], [], []
        for seed in range(n):
            d = os.path.join(root, f"{arch}_w{seed}")
            model = build(d, seed=seed, config_overrides=shape, tokenizer=False)
            dirs.append(d)
            hf.append(model)
            files.append(verl_transfer.save_weights(
                sent(model), os.path.join(root, f"{arch}_w{seed}.safetensors")))
        archs[arch] = (dirs, files, hf)
    dirs, files, hf = archs["qwen2"]
    handle = replica_handle()
    sender = Sender(handle, _env())
    rig = dict(root=root, dirs=dirs, files=files, hf=hf, sender=sender, handle=handle,
               int8_ready=int8_ready, archs=archs)
    yield rig
    sender.close()
    restore_environ(saved)



def _sync(rig, worker, i, **opts):
    rig["sender"].send(rig["files"][i], **opts)
    try:
        worker.update_weights_from_ipc(use_shm=True)
    finally:
        if opts.get("overwrite"):
            rig["sender"].expect("overwritten")


@pytest.mark.parametrize("arch,fn", [("qwen2", None), ("qwen2", "int8_profile_free"),
                                     ("qwen3", "int8_profile_free"),
                                     ("qwen3_moe", "int8_profile_free")],
                         ids=["qwen2-bf16", "qwen2-int8", "qwen3-int8", "qwen3-moe-int8"])
def test_three_syncs_equal_fresh_load(rig, arch, fn):
    """Each sync leaves the model equal to a fresh load of the same weights, every tensor at its
    old address. MoE: the INT8 experts (w13/w2, their scales, vllm-ascend's fp32 scale copy) are
    rewritten in place from fp32 per-expert tensors arriving over several buckets."""
    if fn:
        need_int8(rig["int8_ready"])
    dirs, files, _ = rig["archs"][arch]
    rig = dict(rig, dirs=dirs, files=files)
    syncs = (1, 2, 1) if arch == "qwen3" else (1, 2, 3)
    opts = SYNC_OPTS.get(arch, {})
    with build_rollout(rig, 0, fn) as v:
        worker, buckets = rollout_worker(v)
        assert worker._get_zmq_handle() == rig["handle"]
        if fn:
            assert getattr(v.model, "_npu_flashrl_loader", None) is not None
        ptrs = {n: t.data_ptr() for n, t in forward_tensors(v.model).items()}
        if fn:
            assert any(n.endswith("weight_scale_fp32") for n in ptrs)
        if arch == "qwen3_moe":
            experts = v.model.get_submodule("model.layers.0.mlp.experts")
            assert experts.w13_weight.dtype == torch.int8 and experts.w2_weight.dtype == torch.int8
            assert "model.layers.0.mlp.experts.w13_weight_scale_fp32" in ptrs
        for k, i in enumerate(syncs):
            last = k == len(syncs) - 1
            buckets.clear()
            _sync(rig, worker, i, overwrite=last, **opts)
            if last:
                # the sender has overwritten its bucket buffer after the last bucket: a kept
                # view of it would show up as a difference from the fresh load
                assert_state(v.model, fresh_state(rig, i, fn), ptrs)
                rig["sender"].release()
            else:
                assert_state(v.model, fresh_state(rig, i, fn), ptrs)
            rig["sender"].expect("sent")
            assert len(buckets) > 1
            split = split_layers(arch, buckets)
            assert split, f"no layer split across buckets: {buckets}"


# (arch, the tensor the sender drops, the INT8 layer it belongs to, that layer's INT8 tensors)
MISSING = {
    "qwen2": ("model.layers.1.self_attn.k_proj.weight", "model.layers.1.self_attn.qkv_proj",
              ("weight", "weight_scale")),
    "qwen3_moe": ("model.layers.1.mlp.experts.5.down_proj.weight", "model.layers.1.mlp.experts",
                  ("w13_weight", "w2_weight", "w13_weight_scale", "w2_weight_scale")),
}


@pytest.mark.parametrize("arch", list(MISSING), ids=["qwen2", "qwen3-moe"])
def test_sync_missing_tensor_named(rig, arch):
    """The sender drops one shard of a fused layer (dense: k of q/k/v; MoE: one expert's
    down_proj): the sync fails naming it after the last bucket, the layer's INT8 tensors are not
    committed (an MoE layer keeps all its previous experts), the model refuses to generate with
    weights of two syncs, and the next complete sync brings it back to a fresh load's state."""
    need_int8(rig["int8_ready"])
    from npu_flashrl.adapters import vllm_ascend

    dirs, files, _ = rig["archs"][arch]
    rig = dict(rig, dirs=dirs, files=files)
    opts = SYNC_OPTS.get(arch, {})
    dropped, path, kept = MISSING[arch]
    with build_rollout(rig, 0, "int8_profile_free") as v:
        worker, buckets = rollout_worker(v)
        layer = v.model.get_submodule(path)
        before = {n: getattr(layer, n).detach().clone() for n in kept}
        with pytest.raises(vllm_ascend.WeightSyncError, match=dropped.replace(".", r"\.")):
            _sync(rig, worker, 1, drop=[dropped], **opts)
        rig["sender"].expect("sent")
        assert len(buckets) > 1 and dropped not in {n for b in buckets for n in b}
        for n in kept:
            assert torch.equal(getattr(layer, n), before[n]), f"{path}.{n} was written"
        with pytest.raises(vllm_ascend.WeightSyncError, match="complete sync"):
            v.logits(torch.tensor([[1, 2, 3]]))
        ptrs = {n: t.data_ptr() for n, t in forward_tensors(v.model).items()}
        _sync(rig, worker, 2, **opts)
        rig["sender"].expect("sent")
        assert_state(v.model, fresh_state(rig, 2, "int8_profile_free"), ptrs)
        assert torch.isfinite(v.logits(torch.tensor([[1, 2, 3]]))).all()


def test_sync_into_model_without_loader_refused_and_drained(rig):
    from npu_flashrl.adapters.verl import server_mode as verl_server

    with build_rollout(rig, 0, None, choice=False) as v:
        # an engine configured for INT8 whose model has no npu_flashrl loader
        v.vllm_config.additional_config = {"npu_flashrl": engine_choice("int8_profile_free")}
        worker, buckets = rollout_worker(v)
        before = {n: p.detach().clone() for n, p in v.model.named_parameters()}
        with pytest.raises(verl_server.ServerModeError, match="has no npu_flashrl INT8 loader"):
            _sync(rig, worker, 1)
        rig["sender"].expect("sent")  # drained: the trainer's sender finished, no hang
        assert buckets == []
        for n, p in v.model.named_parameters():
            assert torch.equal(p.detach(), before[n])


def test_sync_into_engine_built_without_npu_flashrl_refused(rig, monkeypatch):
    from npu_flashrl.adapters.verl import server_mode as verl_server

    monkeypatch.setenv("FLASHRL_CONFIG", os.path.join(rig["root"], "flashrl.yaml"))
    with build_rollout(rig, 0, None, choice=False) as v:
        worker, _ = rollout_worker(v)
        with pytest.raises(verl_server.ServerModeError, match="built without npu_flashrl"):
            _sync(rig, worker, 1)
        rig["sender"].expect("sent")


def test_failed_bucket_fails_the_sync_instead_of_hanging(rig):
    """A tensor vLLM's loader rejects (wrong shape) in an early bucket: verl's receiver would
    stop answering and leave the sender blocked; with npu_flashrl the rest is drained unloaded
    and the error reaches the caller."""
    from npu_flashrl.sim import verl_transfer

    bad = os.path.join(rig["root"], "bad.safetensors")
    named = [(n, p.detach()) for n, p in rig["hf"][1].named_parameters()]
    named[1] = (named[1][0], torch.zeros(3, 3, dtype=named[1][1].dtype))
    verl_transfer.save_weights(named, bad)
    with build_rollout(rig, 0, None) as v:
        worker, buckets = rollout_worker(v)
        rig["sender"].proc.stdin.write(json.dumps({"weights": bad, "bucket_mb": BUCKET_MB}) + "\n")
        rig["sender"].proc.stdin.flush()
        with pytest.raises((AssertionError, RuntimeError, ValueError)):
            worker.update_weights_from_ipc(use_shm=True)
        rig["sender"].expect("sent")
        assert len(buckets) == 1, "buckets after the failed one must not be loaded"


# ------------------------------------------------------------------------------- engine build

FLASHRL_YAML = """\
configs:
  - fn: int8_profile_free
  - fn: bf16
"""


SITECUSTOMIZE = """\
# Stand-in for an installed torch_npu in every process vLLM starts (its model-inspection
# subprocess imports vllm_ascend once npu_flashrl's plugin is active there).
from npu_flashrl.kernels import emulation as _emulation
_emulation.install()
"""


def test_engine_build_through_verl_server(tmp_path, int8_ready):
    """verl's real vLLMHttpServer in a fresh process with FLASHRL_CONFIG in its environment, as a
    Ray actor inherits it: npu_flashrl is reached through vLLM's plugin loading, the hybrid
    config's entry is `replica_rank % 2`, the choice travels in the pickled VllmConfig to the
    process that builds the model, and verl's own rollout.quantization next to FLASHRL_CONFIG is
    refused; in a fresh worker process vLLM's own init_worker activates npu_flashrl and mixes in
    the wrapped extension (the CPU worker's constructor needs vllm._C and is not run to the end).
    Stand-ins: see tests/support/verl_server_engine.py, plus emulated torch_npu in every process (a
    sitecustomize on the subprocess's path)."""
    from importlib.metadata import entry_points

    from npu_flashrl.sim.tiny_models import build_tiny_qwen2

    if "npu_flashrl" not in entry_points(group="vllm.general_plugins").names:
        pytest.skip("npu_flashrl is not installed here (pip install -e .): its vLLM plugin entry "
                    "point is what reaches verl's vLLM processes")
    model_dir = str(tmp_path / "model")
    build_tiny_qwen2(model_dir)
    cfg = tmp_path / "flashrl.yaml"
    cfg.write_text(FLASHRL_YAML)
    site = tmp_path / "site"
    site.mkdir()
    (site / "sitecustomize.py").write_text(SITECUSTOMIZE)
    scenarios = [{"name": "replica1", "replica_rank": 1},
                 {"name": "replica3_fp8", "replica_rank": 3, "quantization": "fp8"}]
    if int8_ready:
        scenarios.append({"name": "replica2", "replica_rank": 2})
    env = _env()
    env.update(FLASHRL_CONFIG=str(cfg), VLLM_PLUGINS="npu_flashrl", NPU_FLASHRL_NO_AUTOACTIVATE="1",
               PYTHONPATH=os.pathsep.join((env["PYTHONPATH"], str(site))))
    proc = subprocess.run([sys.executable, os.path.join(ROOT, "tests", "support", "verl_server_engine.py"),
                           model_dir, str(tmp_path), json.dumps(scenarios)], env=env,
                          capture_output=True, text=True, timeout=TIMEOUT_S)
    missing = [l for l in proc.stdout.splitlines() if l.startswith("MISSING ")]
    if missing:
        pytest.skip(f"verl's vllm_async_server does not import on this line: {missing[0][8:]}")
    lines = [l for l in proc.stdout.splitlines() if l.startswith(("BEFORE ", "RESULT "))]
    assert proc.returncode == 0 and len(lines) == 1 + len(scenarios), proc.stderr[-4000:]
    before = json.loads(lines[0].split(" ", 1)[1])
    results = {r["name"]: r for r in (json.loads(l.split(" ", 1)[1]) for l in lines[1:])}
    assert "vllm_engine_flashrl_config" not in before  # not activated by an import

    r1 = results["replica1"]
    assert "error" not in r1, r1
    # reached through the vLLM plugin, with the server-mode sync patches
    assert {"vllm_engine_flashrl_config", "verl_server_sync_end"} <= set(r1["patches"])
    assert r1["backend"] == "mp"
    assert r1["extension"] == "verl.workers.rollout.vllm_rollout.utils.vLLMColocateWorkerExtension"
    assert tuple(r1["choice"]) == engine_choice(None, rank=1)  # JSON: the fields in order
    assert r1["quantization"] is None  # replica 1 % 2 -> the bf16 entry

    # a fresh process as vLLM's executor spawns for a worker, same environment: vLLM's own
    # init_worker loads the plugin, and the extension it mixes in has the wrapped sync
    proc = subprocess.run([sys.executable, os.path.join(ROOT, "tests", "support", "verl_server_engine.py"),
                           "--worker", str(tmp_path / "replica1.pkl")], env=env,
                          capture_output=True, text=True, timeout=TIMEOUT_S)
    lines = [l for l in proc.stdout.splitlines() if l.startswith("WORKER ")]
    assert proc.returncode == 0 and lines, proc.stderr[-4000:]
    w = json.loads(lines[0].split(" ", 1)[1])
    assert "verl_server_sync_end" not in w["before"]
    assert {"verl_server_sync_end", "verl_server_receiver_drains",
            "model_loader_int8_load_weights"} <= set(w["patches"]), w
    assert w["injected"] and w["wrapped"], w

    clash = results["replica3_fp8"]["error"]
    assert "quantization='fp8'" in clash and "actor_rollout_ref.rollout.quantization" in clash
    assert "Drop one" in clash

    if not int8_ready:
        return  # replica 2 -> the INT8 entry needs the INT8 path on this line
    r2 = results["replica2"]
    assert "error" not in r2, r2
    assert r2["quantization"] == "ascend"
    assert tuple(r2["choice"]) == engine_choice("int8_profile_free", rank=2)
    # the model build, where vLLM's worker does it: from the pickled config (the choice travels
    # in it; this process applied no FlashRL entry)
    import pickle

    from npu_flashrl.sim import cpu_vllm

    with open(tmp_path / "replica2.pkl", "rb") as f:
        vllm_config = pickle.load(f)
    vllm_config.device_config.device = torch.device("cpu")
    with cpu_vllm.CpuVllm(model_dir, vllm_config=vllm_config) as v:
        loader = v.model._npu_flashrl_loader
        assert loader.quantizer.name == "int8_profile_free" and loader.targets
