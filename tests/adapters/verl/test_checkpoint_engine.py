"""INT8 rollouts behind verl 0.9.1's checkpoint engines (one-step-off / fully-async weight syncs).

Both experimental trainers sync through `CheckpointEngineManager.update_weights` (one_step_off_policy
`ray_trainer._fit_update_weights`, fully_async_policy `fully_async_trainer._fit_update_weights`):
abort the in-flight requests, release the kv cache, broadcast from the trainer to a
`CheckpointEngineWorker` per rollout rank, which hands the weights to `ServerAdapter.update_weights`
(verl's bucketed transfer into `update_weights_from_ipc`), finalize, resume kv cache and generation.
Here that runs in real Ray processes on a CPU: verl's manager in the test process, the trainer
worker, the rollout's CheckpointEngineWorker and the rollout server each in its own Ray actor,
npu_flashrl activated in each through the Ray `worker_process_setup_hook`.

Stand-ins (the full list is in npu_flashrl/sim/checkpoint_engine_rig.py): HCCL is a gloo
checkpoint engine registered through verl's `custom_backend_module`
(`npu_flashrl.sim.gloo_checkpoint_engine`); the FSDP trainer worker is a verl `Worker` running
verl's `ActorRolloutRefWorker.update_weights` over a file-backed engine export; vLLM's AsyncLLM
behind verl's `vLLMHttpServer` methods is `SimEngine` (its collective_rpc runs verl's real
`update_weights_from_ipc` on an in-process INT8 model, `cpu_vllm`, emulated torch_npu), and
generation is decode steps that record the weights each layer holds; verl's device helpers point
at the CPU (shared memory instead of IPC).
"""
import os
import tempfile
import time

import pytest
import torch

from npu_flashrl import lines
pytestmark = [
    pytest.mark.skipif(not lines.verl_server_mode(),
                       reason="needs verl 0.9's checkpoint engines (current line)"),
]

FN = "int8_profile_free"
SHAPE = dict(hidden_size=256, intermediate_size=704)
TIMEOUT_S = 600  # a loaded 2-core machine runs these actors at a few % CPU each


def _has_manager():
    try:
        from verl.checkpoint_engine import CheckpointEngineManager  # noqa: F401
        import ray  # noqa: F401
    except Exception:  # noqa: BLE001 - anything that keeps verl's manager from importing
        return False
    return True


def _env(extra=None):
    root = os.path.abspath(os.path.join(os.path.dirname(__file__), "..", "..", ".."))
    env = {"PYTHONPATH": os.pathsep.join(p for p in (root, os.environ.get("PYTHONPATH")) if p),
           "VLLM_PLUGINS": "none", "TORCH_DEVICE_BACKEND_AUTOLOAD": "0", "HF_HUB_OFFLINE": "1",
           "TRANSFORMERS_OFFLINE": "1", "MASTER_ADDR": "127.0.0.1", "WORLD_SIZE": "1", "RANK": "0",
           "LOCAL_RANK": "0", "RAY_LOCAL_WORLD_SIZE": "1"}
    env.update(extra or {})
    return env


def _rollout_config(backend="gloo"):
    from verl.workers.config import CheckpointEngineConfig, RolloutConfig

    ce = CheckpointEngineConfig(
        backend=backend, update_weights_bucket_megabytes=1,
        custom_backend_module="npu_flashrl.sim.gloo_checkpoint_engine",
        engine_kwargs={"gloo": {"timeout_s": 60, "rebuild_group": True}})
    return RolloutConfig(name="vllm", mode="async", tensor_model_parallel_size=1,
                         checkpoint_engine=ce, free_cache_engine=False)


def _ce_dict():
    return {"_target_": "verl.workers.config.CheckpointEngineConfig", "backend": "gloo",
            "update_weights_bucket_megabytes": 1,
            "custom_backend_module": "npu_flashrl.sim.gloo_checkpoint_engine",
            "engine_kwargs": {"gloo": {"timeout_s": 60, "rebuild_group": True}}}


@pytest.fixture(scope="module")
def rig():
    if not _has_manager():
        pytest.skip("verl's CheckpointEngineManager (or Ray) does not import on this line")
    import ray
    from verl.checkpoint_engine import CheckpointEngineWorker
    from verl.single_controller.ray import RayClassWithInitArgs, RayWorkerGroup
    from verl.workers.rollout.vllm_rollout.vllm_async_server import vLLMReplica

    from npu_flashrl.sim import checkpoint_engine_rig as sim, cpu_vllm, verl_transfer
    from npu_flashrl.sim.tiny_models import build_tiny_qwen2

    cpu_vllm.prepare_process()
    from npu_flashrl import patches
    from npu_flashrl.adapters import vllm_ascend

    if not patches.apply_patches(list(vllm_ascend.PATCHES)).get("ascend_w8a8_dynamic_process_once"):
        pytest.skip("npu_flashrl's INT8 W8A8_DYNAMIC patches do not apply on this vllm-ascend line")
    root = tempfile.mkdtemp(prefix="npu_flashrl_ce_")
    dirs, files = [], []
    for seed in range(4):
        d = os.path.join(root, f"w{seed}")
        model = build_tiny_qwen2(d, seed=seed, config_overrides=SHAPE, tokenizer=False)
        dirs.append(d)
        files.append(verl_transfer.save_weights(
            verl_transfer.fsdp_engine_params(model), os.path.join(root, f"w{seed}.safetensors")))
    configs = {}
    for name, text in (("float", f"configs:\n  - fn: {FN}\n"),
                       ("int8", f"configs:\n  - fn: {FN}\n    wire: int8\n")):
        configs[name] = os.path.join(root, f"{name}.yaml")
        with open(configs[name], "w") as f:
            f.write(text)
    ray.init(address="local", num_cpus=2, include_dashboard=False, object_store_memory=200 << 20,
             log_to_driver=False, namespace="npu_flashrl_ce",
             runtime_env={"worker_process_setup_hook": sim.SETUP_HOOK,
                          "env_vars": _env({"FLASHRL_CONFIG": configs["float"]})})
    try:
        rollout_config = _rollout_config()
        server = ray.remote(sim._server_cls()).options(
            name="vllm_server_0_0", num_cpus=0, max_concurrency=64).remote(
                dirs[0], FN, rollout_config)
        ce = ray.remote(CheckpointEngineWorker).options(
            num_cpus=0, runtime_env={"env_vars": _env({"MASTER_PORT": str(cpu_vllm.free_port()),
                                                       "FLASHRL_CONFIG": configs["float"]})}).remote(
            rollout_config=rollout_config, model_config=None, replica_rank=0)
        trainer_cls = sim._trainer_worker_cls()
        trainers, managers = {}, {}
        from verl.checkpoint_engine import CheckpointEngineManager

        replica = vLLMReplica(0, rollout_config, None, gpus_per_node=1)
        replica.workers, replica.servers = [ce], [server]
        for wire, cfg in configs.items():
            handle = ray.remote(trainer_cls).options(
                num_cpus=0, runtime_env={"env_vars": _env({"MASTER_PORT": str(cpu_vllm.free_port()),
                                                           "FLASHRL_CONFIG": cfg})}).remote(
                {"checkpoint_engine": _ce_dict(), "dtype": "bfloat16"})
            wg = RayWorkerGroup(worker_handles=[handle],
                                ray_cls_with_init=RayClassWithInitArgs(cls=ray.remote(trainer_cls)))
            trainers[wire] = wg
            managers[wire] = CheckpointEngineManager(rollout_config.checkpoint_engine, wg, [replica])
        ready = ray.get(server.ready.remote(), timeout=TIMEOUT_S)
        yield dict(root=root, dirs=dirs, files=files, server=server, ce=ce, trainers=trainers,
                   managers=managers, ready=ready, configs=configs, replica=replica,
                   rollout_config=rollout_config)
    finally:
        ray.shutdown()


def _fresh(d):
    from npu_flashrl.sim import checkpoint_engine_rig as sim, cpu_vllm

    with cpu_vllm.CpuVllm(d, quantization="ascend", choice=cpu_vllm.int8(FN)) as v:
        return sim.checksums(v.model), {n: p.detach().clone() for n, p in v.model.named_parameters()}


def _sync(rig, wire, i, step, **faults):
    rig["trainers"][wire].set_weights(rig["files"][i], **faults)  # blocking (ONE_TO_ALL)
    t0 = time.monotonic()
    rig["managers"][wire].update_weights(global_steps=step)
    return time.monotonic() - t0


def _state(rig):
    import ray

    return ray.get(rig["server"].state.remote(), timeout=TIMEOUT_S)


def _report(handle_or_wg, worker_group=False):
    import ray

    if worker_group:
        return ray.get(handle_or_wg.execute_checkpoint_engine(["report"]), timeout=TIMEOUT_S)[0]
    return ray.get(handle_or_wg.execute_checkpoint_engine.remote("report"), timeout=TIMEOUT_S)


def test_activation_reaches_every_rollout_process(rig):
    """npu_flashrl is active in the trainer worker, the rollout-side CheckpointEngineWorker and the
    rollout server (separate processes), through the Ray setup hook users set: the INT8 loader is
    on the rollout model, the sync / drain / checkpoint-engine / wire patches are applied where
    each is needed."""
    server = rig["ready"]
    assert server["loader"]
    assert {"verl_server_sync_end", "verl_server_receiver_drains"} <= set(server["patches"])
    ce = _report(rig["ce"])
    trainer = _report(rig["trainers"]["int8"], worker_group=True)
    assert "verl_checkpoint_engine_refusals" in ce["patches"]
    assert "verl_checkpoint_engine_refusals" in trainer["patches"]
    # the wire patch waits for verl's worker module, which this rig's trainer imports only when
    # it first syncs (the int8-wire syncs below use it): armed, never imported for it
    assert "verl_int8_wire" in trainer["patches"] or \
        trainer["pending"].get("verl_int8_wire") == ["verl.workers.engine_workers"], trainer
    assert len({server["pid"], ce["pid"], trainer["pid"], os.getpid()}) == 4


@pytest.mark.parametrize("wire", ["float", "int8"])
def test_three_syncs_each_equal_fresh_int8_load(rig, wire):
    """Three syncs through verl's CheckpointEngineManager (abort, gloo broadcast to the
    CheckpointEngineWorker, verl's bucketed transfer into the INT8 rollout, resume): after each
    the rollout's INT8 state equals a fresh INT8 load of the same weights; the kv cache is
    cleared after every sync as verl does; the INT8 wire moves fewer bytes than the float one."""
    calls_before = len(_ray_get(rig["server"].engine_calls.remote()))
    bytes_before = _report(rig["ce"])["stats"]["bytes"]
    for k, i in enumerate((1, 2, 3) if wire == "float" else (2, 3, 1)):
        _sync(rig, wire, i, step=10 * k + 1)
        want, _ = _fresh(rig["dirs"][i])
        got = _state(rig)
        assert got.keys() == want.keys()
        bad = [n for n in got if got[n] != want[n]]
        assert not bad, f"sync {k + 1} ({wire} wire) differs from a fresh INT8 load: {bad[:5]}"
    calls = _ray_get(rig["server"].engine_calls.remote())[calls_before:]
    for needed in ("pause_generation", "collective_rpc:update_weights_from_ipc", "reset_prefix_cache",
                   "reset_mm_cache", "reset_encoder_cache", "resume_generation"):
        assert calls.count(needed) >= 3, (needed, calls)
    moved = _report(rig["ce"])["stats"]["bytes"] - bytes_before
    rig.setdefault("moved", {})[wire] = moved
    if "float" in rig["moved"] and wire == "int8":
        # fp32 masters on the float wire (verl's FSDP default): projections at 1/4 + scales
        assert rig["moved"]["float"] / moved > 2.0, rig["moved"]


def _ray_get(ref):
    import ray

    return ray.get(ref, timeout=TIMEOUT_S)


def _wait_steps(server, n, global_steps=None):
    deadline = time.monotonic() + TIMEOUT_S
    while _ray_get(server.count_steps.remote(global_steps)) < n:
        assert time.monotonic() < deadline, f"fewer than {n} decode steps in {TIMEOUT_S} s"
        time.sleep(0.2)


def test_abort_sync_resume_no_request_on_mixed_weights(rig):
    """Requests decode while the trainer syncs (fully-async's partial rollout): verl's manager
    aborts them, syncs, resumes; the agent-loop stand-in resubmits the aborted ones. No decode
    step ran while the receiver was writing, and every step saw one sync's weights in every
    layer (the previous or the new), the new ones after the resume."""
    server = rig["server"]
    _sync(rig, "float", 1, step=100)
    before = _state(rig)
    _ray_get(server.start_load.remote(3, 10_000))  # requests long enough to be in flight at the abort
    _wait_steps(server, 6, 100)
    _sync(rig, "int8", 2, step=101)
    _wait_steps(server, 6, 101)
    load = _ray_get(server.stop_load.remote())
    steps, finished = load["steps"], load["finished"]
    after = _state(rig)
    assert before != after
    assert not [s for s in steps if s["sync_running"]], "a decode step ran during the sync"
    mixed = [s["request"] for s in steps if s["state"] not in (before, after)]
    assert not mixed, f"decode steps on a mix of two syncs' weights: {mixed[:5]}"
    old = [s for s in steps if s["state"] == before]
    new = [s for s in steps if s["state"] == after]
    assert old and new, (len(old), len(new))
    assert max(s["t"] for s in old) < min(s["t"] for s in new)
    assert all(s["global_steps"] == 101 for s in new) and all(s["global_steps"] == 100 for s in old)
    # requests in flight at the sync were aborted (partial rollout), and their clients went on
    # generating on the new weights once verl resumed the replica
    aborted = [f for f in finished if f["stop_reason"] == "aborted"]
    assert aborted, finished
    resumed = {s["request"].split("-")[0] for s in new}
    assert {f["request_id"].split("-")[0] for f in aborted} <= resumed


@pytest.mark.parametrize("fault", ["wire_drop", "wire_nan"])
def test_int8_wire_fault_refused_sender_finishes(rig, fault):
    """The trainer's INT8 wire lacks one scale, or carries a NaN scale: the sync fails naming it
    (WeightSyncError from the rollout, through the CheckpointEngineWorker to verl's manager)
    within the timeout, the trainer's broadcast completes (no hang), the rollout keeps its INT8
    state, and the next complete sync equals a fresh load."""
    import ray

    name = "model.layers.1.self_attn.k_proj.weight_scale"
    before = _state(rig)
    t0 = time.monotonic()
    with pytest.raises(ray.exceptions.RayError, match=name.replace(".", r"\.")) as err:
        _sync(rig, "int8", 2, step=200, **{fault: [name]})
    assert time.monotonic() - t0 < TIMEOUT_S  # a hang would end in the gloo timeout, not a WeightSyncError
    assert "WeightSyncError" in str(err.value) and ("NaN" in str(err.value)) == (fault == "wire_nan")
    # the layer's INT8 tensors are not committed (its float bias is, and the model then refuses
    # to generate until a complete sync: tests/adapters/verl/test_verl_server.py)
    qkv = [f"model.layers.1.self_attn.qkv_proj.{t}" for t in ("weight", "weight_scale",
                                                              "weight_scale_fp32")]
    after = _state(rig)
    assert all(after[n] == before[n] for n in qkv), "the failed layer's INT8 tensors were written"
    # verl's manager stops at the failed step (its trainer would stop too): reopen the gate as
    # its resume would, then a complete sync
    import asyncio

    asyncio.run(rig["replica"].resume_generation())
    _sync(rig, "int8", 3, step=201)
    want, _ = _fresh(rig["dirs"][3])
    assert _state(rig) == want


def test_delta_sharded_refused_at_startup(rig, monkeypatch):
    """checkpoint_engine.backend=delta_sharded with an INT8 rollout is refused by name where verl
    builds the engine (here: a rollout-side CheckpointEngineWorker actor, activated by the setup
    hook) and on the driver (the verl config check) before anything starts."""
    import ray
    from omegaconf import OmegaConf
    from verl.checkpoint_engine import CheckpointEngineWorker

    from npu_flashrl.adapters.verl import checkpoint_engine as ce_adapter
    from npu_flashrl.adapters.verl.config_check import RolloutModeError, check_rollout_mode
    from npu_flashrl.sim import cpu_vllm

    bad = _rollout_config("delta_sharded")
    actor = ray.remote(CheckpointEngineWorker).options(
        num_cpus=0, runtime_env={"env_vars": _env({"MASTER_PORT": str(cpu_vllm.free_port()),
                                                   "FLASHRL_CONFIG": rig["configs"]["float"]})}).remote(
        rollout_config=bad, model_config=None, replica_rank=0)
    with pytest.raises(ray.exceptions.RayError, match="delta_sharded with an INT8 rollout"):
        ray.get(actor.get_replica_rank.remote(), timeout=TIMEOUT_S)
    monkeypatch.setenv("FLASHRL_CONFIG", rig["configs"]["float"])
    cfg = OmegaConf.create({"actor_rollout_ref": {"rollout": {
        "name": "vllm", "checkpoint_engine": {"backend": "delta_sharded"}}}})
    with pytest.raises(RolloutModeError, match="delta_sharded with an INT8 rollout"):
        check_rollout_mode(cfg, verl="0.9")
    cfg.actor_rollout_ref.rollout.checkpoint_engine.backend = "nccl"
    ce_adapter.check_config(lambda k: OmegaConf.select(cfg, k), ce_adapter.config_from(os.environ))
    cfg.actor_rollout_ref.rollout.name = "sglang"
    monkeypatch.setenv("FLASHRL_CONFIG", rig["configs"]["int8"])
    with pytest.raises(ce_adapter.CheckpointEngineError, match="wire: int8"):
        ce_adapter.check_config(lambda k: OmegaConf.select(cfg, k), ce_adapter.config_from(os.environ))
