"""The rollout side of the server-mode sync tests (imported as `verl_server_rig`: tests/support is on
sys.path): this process set up as verl 0.9's vLLM worker on the CPU harness, a vLLM model built the
way npu_flashrl's engine patch configures one, verl's worker object around it, and the checks of a
sync's result. Used by tests/adapters/verl/test_verl_server.py and the Megatron engine tests
(tests/adapters/megatron/test_megatron_engine*.py), whose trainer side differs.

Stand-ins (named in the tests' docstrings too): emulated torch_npu and vLLM's CPU platform
(`npu_flashrl.sim.cpu_vllm`), verl's device helpers in the transfer and the vLLM worker object
(`npu_flashrl.sim.verl_transfer`), plain causal attention.
"""
import os

import pytest
import torch

from helpers import forward_tensors
from npu_flashrl import patches

# hidden 256 / intermediate 704: one decoder layer is ~1.4 MB of bf16, so 1 MB buckets split
# fused layers (gate/up, q/k/v) across buckets.
SHAPE = dict(hidden_size=256, intermediate_size=704)
FUSED = (("q_proj", "k_proj", "v_proj"), ("gate_proj", "up_proj"))
MOE_LAYERS = 2  # the tiny Qwen3-MoE's decoder layers


@pytest.fixture(scope="module")
def int8_ready():
    """This process on the CPU harness with npu_flashrl's vllm-ascend and verl server patches;
    True when the INT8 W8A8_DYNAMIC path applies on this line."""
    from npu_flashrl.sim import cpu_vllm, verl_transfer

    cpu_vllm.prepare_process()
    from npu_flashrl.adapters import vllm_ascend
    from npu_flashrl.adapters.verl import server_mode as verl_server

    applied = patches.apply_patches(list(vllm_ascend.PATCHES))
    assert all(patches.apply_patches(list(verl_server.PATCHES)).values())
    verl_transfer.use_cpu_device()
    return applied.get("ascend_w8a8_dynamic_process_once", False)


def need_int8(ready):
    if not ready:
        pytest.skip("npu_flashrl's INT8 W8A8_DYNAMIC patches do not apply on this vllm-ascend "
                    "line yet (the INT8 path of the current line is verified on its own)")


def replica_handle() -> str:
    """The ZMQ handle verl's rollout replica 0, rank 0 receives on (after `set_verl_replica_env`)."""
    return f"ipc:///tmp/rl-colocate-zmq-{os.environ['VERL_RAY_JOB_ID']}-replica-0-rank-0.sock"


def engine_choice(fn, rank=0):
    from npu_flashrl.adapters.engine_choice import EngineChoice

    return EngineChoice(fn=fn, profile=None, rank=rank)


def build_rollout(rig, i, fn=None, choice=True):
    """vLLM model from checkpoint rig["dirs"][i]: bf16 (fn None) or INT8 through npu_flashrl,
    configured the way the engine patch configures it (additional_config['npu_flashrl']);
    `choice=False`: an engine built without npu_flashrl."""
    from npu_flashrl.sim import cpu_vllm

    extra = {"npu_flashrl": engine_choice(fn)} if choice else None
    vc = cpu_vllm.make_vllm_config(rig["dirs"][i], quantization="ascend" if fn else None,
                                   additional_config=extra)
    return cpu_vllm.CpuVllm(rig["dirs"][i], vllm_config=vc)


def fresh_state(rig, i, fn=None):
    """Every tensor a forward reads, from a fresh load of checkpoint rig["dirs"][i]."""
    with build_rollout(rig, i, fn) as v:
        return {n: t.detach().clone() for n, t in forward_tensors(v.model).items()}


def rollout_worker(v):
    """verl's vLLM worker extension around `v`'s model, and the list its buckets are recorded in
    (the names of each `_update_weights` call; verl's own method does the work)."""
    from npu_flashrl.sim import verl_transfer

    worker = verl_transfer.make_worker(v.model, v.vllm_config)
    buckets = []
    update = worker._update_weights

    def spy(weights, **kw):
        buckets.append([n for n, _ in weights])
        return update(weights, **kw)

    worker._update_weights = spy
    return worker, buckets


def split_layers(arch, buckets):
    """What the buckets split: dense, a fused layer's shards (q/k/v, gate/up) over several
    buckets; MoE, each layer's experts over more than two buckets."""
    where = {n: k for k, names in enumerate(buckets) for n in names}
    if arch == "qwen3_moe":
        assert not any(n.endswith(("gate_up_proj", "experts.down_proj")) for n in where), \
            "the trainer sends per-expert names (verl's unfuse_moe_params)"
        spread = {i: {k for n, k in where.items() if n.startswith(f"model.layers.{i}.mlp.experts.")}
                  for i in range(MOE_LAYERS)}
        return [i for i, b in spread.items() if len(b) > 2]
    return [g for g in FUSED for layer in range(2)
            if len({where[f"model.layers.{layer}.{'self_attn' if 'q_proj' in g else 'mlp'}"
                          f".{s}.weight"] for s in g}) > 1]


def assert_state(model, want, ptrs):
    """`model` holds `want` (a `fresh_state`), every tensor at its address in `ptrs`."""
    got = forward_tensors(model)
    assert got.keys() == want.keys()
    for n, p in got.items():
        assert p.data_ptr() == ptrs[n], f"{n}: storage replaced"
        assert torch.equal(p.detach(), want[n]), f"{n} differs from a fresh load"
