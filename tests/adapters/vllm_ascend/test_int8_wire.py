"""The INT8 wire (`wire: int8`): trainer-side quantization, receiver commits pre-quantized shards.

verl's real `BucketedWeightSender` runs in its own process (`npu_flashrl.sim.verl_transfer`)
and verl's real `vLLMColocateWorkerExtension.update_weights_from_ipc` (npu_flashrl's patches
applied) in this one, over shared memory, as in tests/adapters/verl/test_verl_server.py. What the sender sends
is the trainer's stream through `npu_flashrl.quant.wire.int8_wire` (int8 + fp32 [out, 1] scale
under W8A8_DYNAMIC names), the same stream the trainer-side patch produces in verl's
`ActorRolloutRefWorker.update_weights` (tests/adapters/verl/test_checkpoint_engine.py drives that one).

Stand-ins (each for something that needs a GPU/NPU), as in tests/adapters/verl/test_verl_server.py: the
FSDP-wrapped actor (its unwrapped state dict, `verl_transfer.fsdp_engine_params` for the MoE),
verl's device helpers in the bucket transfer (`verl_transfer.use_cpu_device`), the vLLM worker
object the extension is mixed into (`verl_transfer.make_worker`), torch_npu (emulated; the
trainer side runs `npu_flashrl.kernels`' reference path where an NPU trainer runs torch_npu's).
"""
import os
import tempfile

import pytest
import torch
from helpers import forward_tensors, restore_environ, set_verl_replica_env

from npu_flashrl import lines, patches

pytestmark = [
    pytest.mark.every_line,
    pytest.mark.skipif(not lines.verl_server_mode(),
                       reason="needs a server-mode verl line (bucketed syncs)"),
]

FN = "int8_profile_free"
SHAPE = dict(hidden_size=256, intermediate_size=704)
BUCKET_BYTES = {"qwen2": 1 << 20, "qwen3_moe": 256 << 10}
TIMEOUT_S = 300


@pytest.fixture(scope="module")
def rig():
    from npu_flashrl.quant.wire import int8_wire
    from npu_flashrl.sim import cpu_vllm, verl_transfer
    from npu_flashrl.sim.tiny_models import build_tiny_qwen2, build_tiny_qwen3_moe

    cpu_vllm.prepare_process()
    from npu_flashrl.adapters import vllm_ascend
    from npu_flashrl.adapters.verl import server_mode as verl_server

    applied = patches.apply_patches(list(vllm_ascend.PATCHES))
    if not applied.get("ascend_w8a8_dynamic_process_once", False):
        pytest.skip("npu_flashrl's INT8 W8A8_DYNAMIC patches do not apply on this vllm-ascend line")
    assert all(patches.apply_patches(list(verl_server.PATCHES)).values())
    verl_transfer.use_cpu_device()
    saved = set_verl_replica_env("wire")
    root = tempfile.mkdtemp(prefix="npu_flashrl_wire_")
    archs = {}
    setups = {"qwen2": (build_tiny_qwen2, SHAPE, lambda m: list(m.named_parameters())),
              "qwen3_moe": (build_tiny_qwen3_moe, None, verl_transfer.fsdp_engine_params)}
    for arch, (build, shape, sent) in setups.items():
        dirs, floats, wires, stats = [], [], [], []
        for seed in range(3):
            d = os.path.join(root, f"{arch}_w{seed}")
            model = build(d, seed=seed, config_overrides=shape, tokenizer=False)
            named = [(n, t.detach()) for n, t in sent(model)]
            dirs.append(d)
            floats.append(verl_transfer.save_weights(named, os.path.join(root, f"{arch}_{seed}.f")))
            st = {}
            wires.append(verl_transfer.save_weights(
                int8_wire(named, torch.bfloat16, stats=st), os.path.join(root, f"{arch}_{seed}.w")))
            stats.append(st)
        archs[arch] = dict(dirs=dirs, floats=floats, wires=wires, stats=stats)
    handle = f"ipc:///tmp/rl-colocate-zmq-{os.environ['VERL_RAY_JOB_ID']}-replica-0-rank-0.sock"
    sender = verl_transfer.SenderProcess(handle, timeout_s=TIMEOUT_S)
    yield dict(root=root, archs=archs, sender=sender)
    sender.close()
    restore_environ(saved)


def _build(d, fn=FN):
    """The INT8 engine as the engine patch configures it (additional_config['npu_flashrl'])."""
    from npu_flashrl.sim import cpu_vllm

    vc = cpu_vllm.make_vllm_config(d, quantization="ascend",
                                   additional_config={"npu_flashrl": cpu_vllm.int8(fn)})
    return cpu_vllm.CpuVllm(d, vllm_config=vc)


def _snapshot(model):
    return {n: t.detach().clone() for n, t in forward_tensors(model).items()}


def _fresh(d):
    """A fresh INT8 load of checkpoint `d` (no sync)."""
    from npu_flashrl.sim import cpu_vllm

    with cpu_vllm.CpuVllm(d, quantization="ascend", choice=cpu_vllm.int8(FN)) as v:
        return _snapshot(v.model)


def _assert_state(model, want, ptrs=None):
    got = forward_tensors(model)
    assert got.keys() == want.keys()
    for n, t in got.items():
        if ptrs is not None:
            assert t.data_ptr() == ptrs[n], f"{n}: storage replaced"
        assert torch.equal(t.detach(), want[n]), f"{n} differs"


def _sync(rig, worker, path, arch, **opts):
    rig["sender"].send(path, bucket_mb=1, bucket_bytes=BUCKET_BYTES[arch], **opts)
    try:
        worker.update_weights_from_ipc(use_shm=True)
    finally:
        rig["sender"].expect("sent")  # the trainer's sender finished: no hang, whatever happened


@pytest.mark.parametrize("arch", ["qwen2", "qwen3_moe"], ids=["dense", "moe"])
def test_int8_wire_sync_equals_float_wire_sync(rig, arch):
    """INT8-wire syncs commit the trainer's int8 + scale in place: after each, the INT8 state
    (int8 weights, scales, vllm-ascend's fp32 scale copies, float parameters) is bit-identical to
    a float-wire sync of the same weights and to a fresh INT8 load, every tensor at its address;
    the wire carries under half the bytes of bf16 for the projections."""
    from npu_flashrl.sim import verl_transfer

    a = rig["archs"][arch]
    with _build(a["dirs"][0]) as v:
        worker = verl_transfer.make_worker(v.model, v.vllm_config)
        loader = v.model._npu_flashrl_loader
        calls = []
        original = loader.quantizer.quantize
        loader.quantizer.quantize = lambda *x, **k: calls.append(x[0]) or original(*x, **k)
        ptrs = {n: t.data_ptr() for n, t in forward_tensors(v.model).items()}
        _sync(rig, worker, a["wires"][1], arch)
        assert calls == [], f"the receiver quantized again: {calls[:3]}"
        _assert_state(v.model, _fresh(a["dirs"][1]), ptrs)
        _sync(rig, worker, a["floats"][2], arch)  # float wire: the rollout quantizes
        assert calls, "the float-wire sync did not go through the rollout's quantizer"
        float_state = _snapshot(v.model)
        calls.clear()
        _sync(rig, worker, a["wires"][1], arch)
        _sync(rig, worker, a["wires"][2], arch)
        assert calls == []
        _assert_state(v.model, float_state, ptrs)
        assert loader.staging_bytes() == 0 and loader.pending() == {}
    st = a["stats"][1]
    assert st["quantize_s"] > 0
    from safetensors import safe_open

    with safe_open(a["wires"][1], "pt") as f:
        names = list(f.keys())
    projections = [n for n in names if n.endswith("_proj.weight")]
    assert projections and all(n[:-6] + "weight_scale" in names for n in projections)
    with safe_open(a["wires"][1], "pt") as f, safe_open(a["floats"][1], "pt") as g:
        wire = sum(f.get_tensor(n).numel() + f.get_tensor(n[:-6] + "weight_scale").numel() * 4
                   for n in projections)
        bf16 = sum(g.get_tensor(n).numel() * 2 for n in projections)
        cols = {g.get_tensor(n).shape[1] for n in projections}
    # one int8 per weight plus one fp32 scale per output row: bf16/int8 = 2 in / (in + 4), 1.94
    # at the tiny MoE's in=128, 1.997 at Qwen2.5-7B's 3584 (benchmarks/sync.py)
    assert bf16 / wire >= 2 * min(cols) / (min(cols) + 4) - 1e-9, (bf16, wire)
    assert bf16 / wire > 1.9


@pytest.mark.parametrize("arch,fault", [
    ("qwen2", "drop"), ("qwen2", "nan"), ("qwen3_moe", "drop"), ("qwen3_moe", "nan")],
    ids=["dense-drop", "dense-nan", "moe-drop", "moe-nan"])
def test_int8_wire_fault_refused_by_name(rig, arch, fault):
    """A scale that never arrives, or a NaN scale, on the INT8 wire: the sync is refused naming
    the tensor, the sender finishes (no hang), the layer keeps its previous INT8 weights (MoE:
    staged) or, where the wire was written in place (linear), keeps its scales and the model
    refuses to generate, and the next complete sync equals a fresh load."""
    from npu_flashrl.adapters import vllm_ascend
    from npu_flashrl.sim import verl_transfer
    from safetensors.torch import load_file

    a = rig["archs"][arch]
    if arch == "qwen2":
        name, path = "model.layers.1.self_attn.k_proj.weight_scale", "model.layers.1.self_attn.qkv_proj"
        kept = ("weight", "weight_scale")
    else:
        name, path = "model.layers.1.mlp.experts.5.down_proj.weight_scale", "model.layers.1.mlp.experts"
        kept = ("w13_weight", "w2_weight", "w13_weight_scale", "w2_weight_scale")
    opts = {}
    if fault == "drop":
        opts["drop"] = [name]
        wire_file = a["wires"][1]
    else:
        import json

        tensors = load_file(a["wires"][1])
        with open(a["wires"][1] + ".order") as f:
            order = json.load(f)
        tensors[name] = tensors[name].clone()
        tensors[name][3] = float("nan")
        wire_file = verl_transfer.save_weights([(n, tensors[n]) for n in order],
                                               os.path.join(rig["root"], f"{arch}_nan.w"))
    with _build(a["dirs"][0]) as v:
        worker = verl_transfer.make_worker(v.model, v.vllm_config)
        layer = v.model.get_submodule(path)
        before = {n: getattr(layer, n).detach().clone() for n in kept}
        with pytest.raises(vllm_ascend.WeightSyncError, match=name.replace(".", r"\.")) as err:
            _sync(rig, worker, wire_file, arch, **opts)
        if fault == "nan":
            assert "NaN" in str(err.value)
        loader = v.model._npu_flashrl_loader
        if arch == "qwen2":
            # a linear layer takes the INT8 wire straight into its live weight: q_proj of the
            # layer may hold the new sync, so the model refuses to generate; its scales wait
            # for the commit
            kept = ("weight_scale",)
            assert loader.inconsistent is not None
            with pytest.raises(vllm_ascend.WeightSyncError, match="weights of two syncs"):
                layer(torch.zeros(1, layer.input_size, dtype=torch.bfloat16))
        for n in kept:
            assert torch.equal(getattr(layer, n), before[n]), f"{path}.{n} was written"
        ptrs = {n: t.data_ptr() for n, t in forward_tensors(v.model).items()}
        _sync(rig, worker, a["wires"][2], arch)
        _assert_state(v.model, _fresh(a["dirs"][2]), ptrs)
