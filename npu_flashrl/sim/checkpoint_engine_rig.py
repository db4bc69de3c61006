"""verl's checkpoint-engine weight sync (server-mode line) on a CPU, in separate Ray processes.

What runs is verl's own: `CheckpointEngineManager.update_weights` (abort, release kv cache,
process group, send/receive, finalize, resume kv cache, resume generation), `vLLMReplica`'s
abort / drain / resume over its servers, the rollout-side `CheckpointEngineWorker` actor
(`ray.remote(CheckpointEngineWorker)`, as `RolloutReplica.get_ray_class_with_init_args` builds it)
with the `ServerAdapter` it creates, `ActorRolloutRefWorker.update_weights` (npu_flashrl's
`verl_int8_wire` patch included), `vLLMHttpServer`'s submission gate / abort / resume / kv-cache
methods, verl's `BucketedWeightSender` / `update_weights_from_ipc` between the
CheckpointEngineWorker and the rollout, and npu_flashrl's activation through the Ray
`worker_process_setup_hook` users set.

Stand-ins, each for something that needs an NPU/GPU or vLLM's serving engine:
- HCCL: `npu_flashrl.sim.gloo_checkpoint_engine` (registered through verl's
  `custom_backend_module`);
- the trainer worker (`ActorRolloutRefWorker` with an FSDP engine): `SimTrainerWorker`, a verl
  `Worker` whose `actor.engine.get_per_tensor_param()` yields a safetensors file's tensors in the
  trainer's order (what the FSDP engine's export yields on one rank), and whose `update_weights`
  IS verl's `ActorRolloutRefWorker.update_weights`, run on it;
- the vLLM server and its worker: `SimVllmServer`, a `vLLMHttpServer` whose methods that verl's
  manager and replica call are verl's own (abort_all_requests, resume_engine_generation,
  open_submission_gate, _park_until_admitted, clear_kv_cache, release/resume_kv_cache,
  collective_rpc, set_global_steps); its `engine` (vLLM's AsyncLLM) is `SimEngine`: pause /
  resume / cache resets are recorded, `collective_rpc` runs verl's real `update_weights_from_ipc`
  on the vLLM worker stand-in (`verl_transfer.make_worker`) in a thread, as vLLM's workers run it
  beside the server's event loop; the INT8 model is built in-process (`cpu_vllm`, emulated
  torch_npu); generation is `generate_steps`: admission through verl's gate, then decode steps
  that each record which weights every quantized layer held (a checksum per tensor);
- verl's device helpers (`use_cpu_device`, `is_support_ipc`): CPU, shared memory;
- HF `datasets` in the trainer process, when the CPU stack lacks it (`_stand_in_datasets`).
"""
from __future__ import annotations

import asyncio
import os
import time
import types
from typing import Dict, List, Optional

import torch

from npu_flashrl import lines

SETUP_HOOK = "npu_flashrl.sim.checkpoint_engine_rig.setup_worker"


def setup_worker() -> None:
    """Ray worker_process_setup_hook of the CPU rig: the CPU stand-ins, then npu_flashrl's own
    hook (`npu_flashrl.activation.worker_process_setup`, what users set)."""
    os.environ.setdefault("TORCH_DEVICE_BACKEND_AUTOLOAD", "0")
    from npu_flashrl.sim import cpu_vllm, verl_transfer

    cpu_vllm.prepare_process()
    verl_transfer.use_cpu_device()
    import verl.workers.rollout.vllm_rollout.vllm_rollout as vllm_rollout

    vllm_rollout.is_support_ipc = lambda: False  # ServerAdapter: shared memory, as NPUs without IPC
    from npu_flashrl.activation import worker_process_setup

    worker_process_setup()


# ----------------------------------------------------------------------------- trainer side

class FileEngine:
    """Stand-in for verl's model engine export: `get_per_tensor_param()` -> (generator, None)."""

    def __init__(self):
        self.path: Optional[str] = None
        self.drop: set = set()

    def get_per_tensor_param(self, *args, **kwargs):
        import json

        from safetensors import safe_open

        path, drop = self.path, set(self.drop)
        with open(path + ".order") as f:
            order = json.load(f)

        def gen():
            with safe_open(path, "pt") as f:
                for name in order:
                    if name not in drop:
                        yield name, f.get_tensor(name)

        return gen(), None


def _stand_in_datasets() -> None:
    """Stand-in for HF `datasets` when the CPU stack lacks it: verl's worker module imports its
    dataset loader at module level; nothing here loads a dataset."""
    import importlib.util
    import sys

    if "datasets" not in sys.modules and importlib.util.find_spec("datasets") is None:
        stub = types.ModuleType("datasets")
        stub.Dataset = object  # rl_dataset's annotations are evaluated at import
        sys.modules["datasets"] = stub


def _trainer_worker_cls():
    from verl.single_controller.base import Worker
    from verl.single_controller.base.decorator import Dispatch, register

    class SimTrainerWorker(Worker):
        """The trainer-side worker (see the module doc): checkpoint engine built as verl's
        `ActorRolloutRefWorker.init_model` builds it, `update_weights` is verl's."""

        def __init__(self, rollout_config: dict):
            super().__init__()
            from omegaconf import OmegaConf

            from verl.checkpoint_engine import CheckpointEngineRegistry
            from verl.utils.config import omega_conf_to_dataclass
            from verl.utils.import_utils import import_external_libs

            self.config = OmegaConf.create({"rollout": rollout_config})
            self.actor = types.SimpleNamespace(engine=FileEngine())
            ce = omega_conf_to_dataclass(self.config.rollout.checkpoint_engine)
            import_external_libs(ce.custom_backend_module or None)
            self.checkpoint_engine = CheckpointEngineRegistry.new(
                ce.backend, is_master=self.rank == 0,
                bucket_size=ce.update_weights_bucket_megabytes << 20,
                **ce.engine_kwargs.get(ce.backend, {}))

        @register(dispatch_mode=Dispatch.ONE_TO_ALL)
        def set_weights(self, path: str, drop=(), wire_drop=(), wire_nan=()):
            """The next sync's weights; `drop`: names the export leaves out; `wire_drop` /
            `wire_nan`: faults on what reaches the checkpoint engine (after the INT8 wire)."""
            self.actor.engine.path, self.actor.engine.drop = path, set(drop)
            self.wire_faults = (set(wire_drop), set(wire_nan))

        def _faulty(self, weights):
            drop, nan = getattr(self, "wire_faults", (set(), set()))
            for name, t in weights:
                if name in drop:
                    continue
                if name in nan:
                    t = t.clone()
                    t.view(-1)[0] = float("nan")
                yield name, t

        @register(dispatch_mode=Dispatch.ONE_TO_ALL, blocking=False)
        async def update_weights(self, global_steps: int = None, mode: str = "auto"):
            _stand_in_datasets()
            from verl.workers.engine_workers import ActorRolloutRefWorker

            send = self.checkpoint_engine.send_weights
            self.checkpoint_engine.send_weights = lambda w, **kw: send(self._faulty(w), **kw)
            try:
                # verl's own method (and npu_flashrl's patch on it), run on this worker
                return await ActorRolloutRefWorker.update_weights(self, global_steps=global_steps,
                                                                  mode=mode)
            finally:
                del self.checkpoint_engine.send_weights

        @register(dispatch_mode=Dispatch.DP_COMPUTE, blocking=False)
        def execute_checkpoint_engine(self, method: str, *args, **kwargs):
            return getattr(self.checkpoint_engine, method)(*args, **kwargs)

    return SimTrainerWorker


# ----------------------------------------------------------------------------- rollout side

def checksums(model) -> Dict[str, float]:
    """One number per tensor a forward reads (parameters and vllm-ascend's derived fp32 scales)."""
    out = {}
    for name, p in model.named_parameters():
        out[name] = float(p.detach().double().sum())
    for name, mod in model.named_modules():
        for attr, t in vars(mod).items():
            if attr.endswith("scale_fp32") and isinstance(t, torch.Tensor) \
                    and not isinstance(t, torch.nn.Parameter):
                out[f"{name}.{attr}"] = float(t.double().sum())
    return out


class SimEngine:
    """Stand-in for vLLM's AsyncLLM behind `vLLMHttpServer` (see the module doc)."""

    def __init__(self, worker):
        self.worker = worker
        self.paused = False
        self.calls: List[str] = []
        self.output_processor = types.SimpleNamespace(request_states={})
        self.sync_running = False

    async def pause_generation(self, wait_for_inflight_requests=False, clear_cache=True):
        self.calls.append("pause_generation")
        self.paused = True
        while self.output_processor.request_states:  # in-flight requests end (aborted)
            await asyncio.sleep(0.005)
        if clear_cache:
            self.calls.append("reset_prefix_cache")

    async def resume_generation(self):
        self.calls.append("resume_generation")
        self.paused = False

    async def reset_prefix_cache(self, reset_connector=False):
        self.calls.append("reset_prefix_cache")

    async def reset_mm_cache(self):
        self.calls.append("reset_mm_cache")

    async def reset_encoder_cache(self):
        self.calls.append("reset_encoder_cache")

    async def wait_for_requests_to_drain(self):
        while self.output_processor.request_states:
            await asyncio.sleep(0.005)

    async def sleep(self, level=1):
        self.calls.append("sleep")

    async def wake_up(self, tags=None):
        self.calls.append(f"wake_up:{','.join(tags or [])}")

    async def collective_rpc(self, method, timeout=None, args=(), kwargs=None):
        self.calls.append(f"collective_rpc:{method}")
        self.sync_running = True
        try:
            return await asyncio.to_thread(getattr(self.worker, method), *args, **(kwargs or {}))
        finally:
            self.sync_running = False


def _server_cls():
    from verl.workers.rollout.vllm_rollout.vllm_async_server import vLLMHttpServer

    class SimVllmServer(vLLMHttpServer):
        """`vLLMHttpServer` with verl's methods, over `SimEngine` (see the module doc)."""

        def __init__(self, model_dir: str, fn: Optional[str], rollout_config, replica_rank: int = 0):
            import ray

            from verl.workers.rollout.replica import RolloutMode

            os.environ["VERL_REPLICA_RANK"] = str(replica_rank)
            os.environ["VERL_RAY_JOB_ID"] = ray.get_runtime_context().get_job_id()
            from npu_flashrl.sim import cpu_vllm, verl_transfer

            from npu_flashrl.adapters.engine_choice import EngineChoice

            # as the engine patch records it for the policy rollout (fn None: a bf16 entry)
            choice = EngineChoice(fn=fn, profile=None, rank=replica_rank)
            vc = cpu_vllm.make_vllm_config(model_dir, quantization="ascend" if fn else None,
                                           additional_config={"npu_flashrl": choice})
            self.vllm = cpu_vllm.CpuVllm(model_dir, vllm_config=vc).__enter__()
            self.model = self.vllm.model
            self.engine = SimEngine(verl_transfer.make_worker(self.model, vc))
            self.config = rollout_config
            self.replica_rank, self.node_rank = replica_rank, 0
            self.rollout_mode = RolloutMode.STANDALONE
            self.global_steps = None
            self._submission_paused, self._rejecting, self._admitting = False, False, 0
            self._resume_event = asyncio.Event()
            self._resume_event.set()
            self.steps: List[dict] = []
            self.finished: List[dict] = []
            self._load: List[asyncio.Task] = []

        def ready(self) -> dict:
            from npu_flashrl import patches

            return {"pid": os.getpid(), "loader": getattr(self.model, lines.SYNC_ATTR, None) is not None,
                    "patches": sorted(p["name"] for p in patches.status() if p.get("applied"))}

        def state(self) -> Dict[str, float]:
            return checksums(self.model)

        def engine_calls(self) -> List[str]:
            return list(self.engine.calls)

        async def generate_steps(self, request_id: str, max_steps: int) -> dict:
            """A request: verl's admission gate, then decode steps until aborted or done."""
            parked = await self._park_until_admitted(request_id)
            if parked is not None:
                return {"request_id": request_id, "steps": 0, "stop_reason": "rejected"}
            states = self.engine.output_processor.request_states
            states[request_id] = True
            self._admitting -= 1
            steps, reason = 0, "length"
            try:
                while steps < max_steps:
                    await asyncio.sleep(0.002)
                    if self.engine.paused:
                        reason = "aborted"
                        break
                    if getattr(self, "_stop", False):
                        reason = "stopped"
                        break
                    # a decode step: the weights every layer holds right now
                    self.steps.append({"request": request_id, "t": time.monotonic(),
                                       "global_steps": self.global_steps,
                                       "sync_running": self.engine.sync_running,
                                       "state": checksums(self.model)})
                    steps += 1
            finally:
                states.pop(request_id, None)
            out = {"request_id": request_id, "steps": steps, "stop_reason": reason,
                   "t": time.monotonic()}
            self.finished.append(out)
            return out

        def count_steps(self, global_steps=None) -> int:
            return sum(1 for s in self.steps if global_steps is None or s["global_steps"] == global_steps)

        async def start_load(self, clients: int, max_steps: int) -> None:
            """verl's agent loop stand-in: `clients` callers that resubmit their request when it
            is aborted (partial rollout) until `stop_load`."""
            self._stop = False

            async def client(k):
                n = 0
                while not self._stop:
                    await self.generate_steps(f"c{k}-r{n}", max_steps)
                    n += 1

            self._load = [asyncio.ensure_future(client(k)) for k in range(clients)]

        async def stop_load(self) -> dict:
            self._stop = True
            await asyncio.gather(*self._load, return_exceptions=True)
            out = {"steps": self.steps, "finished": self.finished}
            self.steps, self.finished = [], []
            return out

    return SimVllmServer
