"""Fresh process standing in for verl 0.9's `vLLMHttpServer` Ray actor (run by
tests/adapters/verl/test_verl_server.py, not collected by pytest).

    python tests/support/verl_server_engine.py MODEL_DIR OUT_DIR SCENARIOS_JSON
    python tests/support/verl_server_engine.py --worker VLLM_CONFIG_PKL

Each scenario `{"name", "replica_rank", "quantization"}` builds verl's real `vLLMHttpServer`
(its `__init__`, `launch_server` and `run_server`) and records the VllmConfig that verl's
`AsyncEngineArgs.create_engine_config` produced, pickled to OUT_DIR/<name>.pkl (vLLM pickles the
same object to its EngineCore and worker processes), or the error. One JSON line per scenario on
stdout. Run with NPU_FLASHRL_NO_AUTOACTIVATE=1: importing the CPU harness does not activate
npu_flashrl, so it becomes active only if vLLM's general-plugin loading (inside verl's CLI
parser set-up) reaches it; the first line says which patches were applied before that.

`--worker` is the fresh process vLLM's MultiprocExecutor spawns for a worker (same environment):
it runs vLLM's real `WorkerWrapperBase.init_worker` on the pickled config, which loads the general
plugins, resolves the worker class and mixes verl's extension into it; the CPU worker's own
constructor then needs vLLM's compiled CPU kernels (`vllm._C`, not in an empty-target build) and
fails, which is reported, not hidden. One JSON line: patches applied, extension injected,
`update_weights_from_ipc` wrapped.

Stand-ins (need a cluster or a device):
- `ray.get_runtime_context()` (job id) and `ray.util.get_node_ip_address()`: no Ray cluster;
- `AsyncLLM.from_vllm_config`: starting vLLM's EngineCore needs a GPU/NPU; it records the
  config and stops `run_server` there (the HTTP server, `collective_rpc("monkey_patch_model")`
  and uvicorn after it are not run);
- the platform: vLLM's CPU platform accepting "ascend" and emulated torch_npu
  (`npu_flashrl.sim.cpu_vllm.prepare_process`).
"""
import asyncio
import json
import os
import pickle
import sys
import types


class _EngineStarted(Exception):
    pass


def main(model_dir: str, out_dir: str, scenarios: list) -> None:
    from npu_flashrl.sim import cpu_vllm

    cpu_vllm.prepare_process()
    import ray

    ray.get_runtime_context = lambda: types.SimpleNamespace(get_job_id=lambda: "0a000000")
    ray.util.get_node_ip_address = lambda: "127.0.0.1"

    from verl.workers.config import HFModelConfig, RolloutConfig

    try:
        from verl.workers.rollout.vllm_rollout import vllm_async_server as server_mod
    except ModuleNotFoundError as exc:  # a dependency of vLLM's OpenAI server not installed
        print(f"MISSING {exc.name} (needed by vLLM's OpenAI server, which verl's "
              "vllm_async_server imports)", flush=True)
        return

    captured = {}

    def from_vllm_config(vllm_config, **kwargs):
        captured["config"] = vllm_config
        raise _EngineStarted()

    server_mod.AsyncLLM.from_vllm_config = from_vllm_config
    model_config = HFModelConfig(path=model_dir)
    from npu_flashrl import patches

    print("BEFORE " + json.dumps(sorted(p["name"] for p in patches.status() if p["applied"])),
          flush=True)
    for sc in scenarios:
        captured.clear()
        rollout = RolloutConfig(name="vllm", mode="async", prompt_length=16, response_length=16,
                                max_model_len=64, max_num_batched_tokens=64, max_num_seqs=8,
                                enforce_eager=True, tensor_model_parallel_size=1,  # gpus_per_node=1
                                enable_sleep_mode=False, quantization=sc.get("quantization"))
        out = {"name": sc["name"]}
        try:
            srv = server_mod.vLLMHttpServer(
                config=rollout, model_config=model_config,
                rollout_mode=server_mod.RolloutMode.HYBRID, workers=[None],
                replica_rank=sc["replica_rank"], node_rank=0, gpus_per_node=1, nnodes=1,
                cuda_visible_devices="0")
            asyncio.run(srv.launch_server())
            out["error"] = "run_server returned without starting the engine"
        except _EngineStarted:
            cfg = captured["config"]
            out.update(quantization=cfg.model_config.quantization,
                       choice=(cfg.additional_config or {}).get("npu_flashrl"),
                       backend=cfg.parallel_config.distributed_executor_backend,
                       extension=cfg.parallel_config.worker_extension_cls)
            with open(os.path.join(out_dir, sc["name"] + ".pkl"), "wb") as f:
                pickle.dump(cfg, f)
        except Exception as exc:  # noqa: BLE001 - reported to the test
            out["error"] = f"{type(exc).__name__}: {exc}"
        out["patches"] = sorted(p["name"] for p in patches.status() if p["applied"])
        print("RESULT " + json.dumps(out), flush=True)


def worker(pkl: str) -> None:
    from npu_flashrl.sim import cpu_vllm

    cpu_vllm.prepare_process()
    with open(pkl, "rb") as f:
        vllm_config = pickle.load(f)
    from vllm.v1.worker.worker_base import WorkerWrapperBase

    from npu_flashrl import patches

    out = {"before": sorted(p["name"] for p in patches.status() if p["applied"])}
    wrapper = WorkerWrapperBase(rpc_rank=0)
    try:
        wrapper.init_worker([{"vllm_config": vllm_config, "local_rank": 0, "rank": 0,
                              "distributed_init_method": "tcp://127.0.0.1:1",
                              "is_driver_worker": True}])
        out["constructed"] = True
    except Exception as exc:  # noqa: BLE001 - the CPU worker needs vllm._C (see module doc)
        out["constructed"] = f"{type(exc).__name__}: {exc}"
    from vllm.utils.import_utils import resolve_obj_by_qualname

    worker_cls = resolve_obj_by_qualname(vllm_config.parallel_config.worker_cls)
    ext = resolve_obj_by_qualname(vllm_config.parallel_config.worker_extension_cls)
    out.update(patches=sorted(p["name"] for p in patches.status() if p["applied"]),
               injected=ext in worker_cls.__bases__,
               wrapped=getattr(worker_cls.update_weights_from_ipc, "__npu_flashrl_original__",
                               None) is not None)
    print("WORKER " + json.dumps(out), flush=True)


if __name__ == "__main__":
    if sys.argv[1] == "--worker":
        worker(sys.argv[2])
    else:
        main(sys.argv[1], sys.argv[2], json.loads(sys.argv[3]))
