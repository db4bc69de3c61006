"""How each simulated step's bf16 weights reach the rollout model (`--transport`).

- ``verl``: verl's real bucketed weight sync, the path a verl 0.7-0.9 server-mode job runs:
  verl's `BucketedWeightSender` in its own process (the trainer side) packs the weights into
  buckets in POSIX shared memory (verl's `use_shm=True`, what NPUs without IPC support use), and
  verl's `vLLMColocateWorkerExtension.update_weights_from_ipc` in this process receives them into
  the vLLM rollout model, with npu_flashrl's server-mode patches (`adapters.verl.server_mode`:
  refusal of a sync into a model without the INT8 loader, `end_weight_sync` after the last
  bucket, draining after a failed bucket). Stand-ins (`npu_flashrl.sim.verl_transfer`):
  verl's device helpers inside the transfer on the CPU, the vLLM worker object verl's extension
  is mixed into, and the sender's bucket size in bytes (so a tiny model's sync arrives in about
  `--buckets` buckets; verl itself takes whole megabytes).
- ``direct``: `model.load_weights` per shuffled bucket, then `end_weight_sync` for INT8: the
  in-process push of verl's sync-mode rollout (verl <= 0.6, the pinned and 0.11 lines).
- ``auto`` (default): ``verl`` where the installed stack line runs verl in server mode and that
  verl is installed (`lines.current().verl_mode`, `lines.verl_server_mode()`), else ``direct``.

Both push the same shuffled order (the trainer's order) of the same tensors, so fused layers
(q/k/v, gate/up) arrive split across buckets either way.
"""
from __future__ import annotations

import math
import os
import random
import tempfile
from typing import Any, Dict, List, Optional, Tuple

from npu_flashrl.rehearsal.common import RehearsalError

TRANSPORTS = ("auto", "verl", "direct")
VERL_PATH = ("verl BucketedWeightSender (own process) -> shared memory -> "
             "vLLMColocateWorkerExtension.update_weights_from_ipc")
DIRECT_PATH = "model.load_weights per bucket (in process)"
# A wait for the sender (one bucket, or the sender's answer) longer than this is a failure, not a hang.
TIMEOUT_S = 300


def resolve(requested: str) -> Dict[str, Any]:
    """The transport `--transport requested` means on the installed stack, and why."""
    from npu_flashrl import lines
    try:
        line = lines.current()
        line_name, verl_mode = line.name, line.verl_mode
    except lines.UnsupportedVersion as exc:
        line_name, verl_mode = None, None
        line_problem = str(exc)
    else:
        line_problem = None
    server = lines.verl_server_mode()
    if requested == "verl" and not server:
        raise RehearsalError("--transport verl needs verl with server-mode bucketed syncs (0.7.1 .. 0.9.1, "
                             "verl/workers/rollout/vllm_rollout/bucketed_weight_transfer.py); the installed "
                             "verl has none (use --transport direct, or the current stack line)")
    if requested == "auto":
        if verl_mode == "server" and server:
            name, reason = "verl", f"vllm-ascend {line_name} line: verl server mode"
        elif verl_mode == "server":
            name, reason = "direct", (f"vllm-ascend {line_name} line runs verl in server mode, but no verl with "
                                      "bucketed syncs is installed")
        else:
            name = "direct"
            reason = (f"vllm-ascend {line_name} line: verl sync mode (in-process load_weights)" if line_name
                      else f"stack line unknown ({line_problem})")
    else:
        name, reason = requested, "--transport " + requested
    return {"name": name, "requested": requested, "reason": reason, "line": line_name,
            "path": VERL_PATH if name == "verl" else DIRECT_PATH}


def shuffled_buckets(weights: List[Tuple[str, Any]], n: int, rng: random.Random) -> List[List[Tuple[str, Any]]]:
    items = list(weights)
    rng.shuffle(items)
    n = max(1, min(n, len(items)))
    size = math.ceil(len(items) / n)
    return [items[i:i + size] for i in range(0, len(items), size)]


class DirectSync:
    """`load_weights` per bucket in this process, then `end_weight_sync` for INT8."""

    name = "direct"

    def __init__(self, buckets: int):
        self.buckets = buckets

    def __enter__(self) -> "DirectSync":
        return self

    def __exit__(self, *exc) -> None:
        pass

    def attach(self, rollout) -> None:
        pass

    def prepare(self, snap, rng: random.Random):
        return shuffled_buckets(snap, self.buckets, rng)

    def push(self, rollout, prepared, int8: bool) -> int:
        from npu_flashrl.adapters import vllm_ascend

        moe = _has_fused_moe(rollout.model)
        if moe:
            _verl_moe_weight_loader(rollout.model)
        for bucket in prepared:
            rollout.model.load_weights(iter(bucket))
        if int8:
            vllm_ascend.end_weight_sync(rollout.model)
        elif moe:
            # vLLM 0.23's load_weights re-creates an unquantized fused-MoE layer's w13 / w2 in the
            # checkpoint layout ([E, 2I, H]); vllm-ascend's post-processing (transpose) must run
            # again, once per sync, as verl 0.9's update_weights_from_ipc runs it after the last
            # bucket. On 0.11 the post-processing keeps its layout on a rerun (no-op).
            from vllm.model_executor.model_loader.utils import process_weights_after_loading

            device = next(rollout.model.parameters()).device
            process_weights_after_loading(rollout.model, rollout.vllm_config.model_config, device)
        return len(prepared)

    def info(self) -> Dict[str, Any]:
        return {"buckets_requested": self.buckets}


def _has_fused_moe(model) -> bool:
    return any(hasattr(m, "w13_weight") for m in model.modules())


def _verl_moe_weight_loader(model) -> None:
    """What verl's sync-mode rollout (sharding managers, `vllm_rollout_spmd`) and its server-mode
    receiver run on a MoE model before loading weights: `patch_vllm_moe_model_weight_loader`, which
    gives the fused-MoE parameters that post-processing re-created (vllm-ascend's unquantized
    method replaces w13 / w2 by transposed copies) the layer's weight_loader again. verl's own
    function; the INT8 experts go through npu_flashrl's loader either way."""
    from npu_flashrl.adapters.verl.moe_names import moe_weight_loader_patch

    try:
        patch_vllm_moe_model_weight_loader = moe_weight_loader_patch()
    except RuntimeError as exc:
        raise RehearsalError(f"--transport direct with a MoE model: {exc}") from None
    patch_vllm_moe_model_weight_loader(model)


class VerlSync:
    """verl's bucketed sender (own process) and receiver (this process), see the module doc."""

    name = "verl"

    def __init__(self, buckets: int, work_dir: str, device: str):
        self.buckets, self.work_dir, self.device = buckets, work_dir, device
        self.sender = None
        self._saved_env: Dict[str, Optional[str]] = {}
        self._workers: Dict[int, Any] = {}
        self._bucket_bytes: List[int] = []
        self._zmq_timeout_set = False
        self._segments: set = set()

    def __enter__(self) -> "VerlSync":
        from npu_flashrl.adapters.verl import server_mode
        from npu_flashrl.sim import verl_transfer

        if self.device == "cpu":
            verl_transfer.use_cpu_device()
        applied = server_mode.install()
        failed = [n for n, ok in applied.items() if not ok]
        if failed:
            raise RehearsalError(f"--transport verl: npu_flashrl's verl server-mode patches {', '.join(failed)} "
                                 "could not be applied to the installed verl (see the WARNING above)")
        # verl's socket name: the job id keeps two rehearsals on one host apart
        for key, value in (("VERL_RAY_JOB_ID", f"npu-flashrl-rehearsal-{os.getpid()}"), ("VERL_REPLICA_RANK", "0")):
            self._saved_env[key] = os.environ.get(key)
            os.environ[key] = value
        import zmq

        # verl's receiver waits for buckets without a timeout: a dead sender would hang the rehearsal
        zmq.Context.instance().setsockopt(zmq.RCVTIMEO, TIMEOUT_S * 1000)
        self._zmq_timeout_set = True
        return self

    def __exit__(self, *exc) -> None:
        self.sender = None  # kept running for the next run in this process (`_sender`)
        if self._zmq_timeout_set:
            import zmq

            zmq.Context.instance().setsockopt(zmq.RCVTIMEO, -1)
        for key, value in self._saved_env.items():
            if value is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = value

    def attach(self, rollout) -> None:
        """Make `rollout`'s model a verl vLLM worker; the sender process starts with the first one."""
        import torch

        from npu_flashrl.sim import verl_transfer

        worker = verl_transfer.make_worker(rollout.model, rollout.vllm_config)
        if self.device != "cpu":
            worker.device = torch.device(f"{self.device}:0")
        counts = []
        update = worker._update_weights

        def counted(weights, **kw):  # counts buckets; verl's own method does the work
            if not counts:
                self._segments.update(_verl_segments())
            counts.append(len(weights))
            return update(weights, **kw)

        worker._update_weights = counted
        worker._npu_flashrl_bucket_counts = counts
        self._workers[id(rollout)] = worker
        if self.sender is None:
            self.sender = _sender(worker._get_zmq_handle())

    def prepare(self, snap, rng: random.Random) -> str:
        """The step's weights in the trainer's (shuffled) order, written for the sender process,
        and the bucket size that splits them into about `--buckets` buckets."""
        from npu_flashrl.sim import verl_transfer

        ordered = [t for bucket in shuffled_buckets(snap, 1, rng) for t in bucket]
        fd, path = tempfile.mkstemp(suffix=".safetensors", prefix="sync_", dir=self.work_dir)
        os.close(fd)
        verl_transfer.save_weights(ordered, path)
        total = sum(t.numel() * t.element_size() for _, t in ordered)
        largest = max(t.numel() * t.element_size() for _, t in ordered)
        # every tensor must fit in one bucket with shared memory (verl asserts it); 64-byte aligned
        size = max(math.ceil(total / self.buckets), largest)
        self._bucket_bytes.append((size + 63) // 64 * 64)
        return path

    def push(self, rollout, prepared: str, int8: bool) -> int:
        import zmq

        from npu_flashrl.sim import verl_transfer

        worker = self._workers[id(rollout)]
        counts = worker._npu_flashrl_bucket_counts
        counts.clear()
        self.sender.send(prepared, bucket_mb=1, bucket_bytes=self._bucket_bytes[-1])
        try:
            try:
                worker.update_weights_from_ipc(use_shm=True)
            except zmq.Again:
                raise RehearsalError(f"verl weight sync: no bucket from the sender process for {TIMEOUT_S} s; "
                                     f"its stderr:\n{self.sender.stderr_tail()}") from None
            finally:
                # npu_flashrl's drain patch lets the sender finish even when a bucket failed
                self.sender.expect("sent")
        except verl_transfer.TransferError as exc:
            _SENDERS.pop(self.sender.handle, None)  # not reused by a later run in this process
            self.sender.close()
            raise RehearsalError(f"verl weight sync: {exc}") from None
        finally:
            _forget_segments(self._segments)
            for f in (prepared, prepared + ".order"):
                try:
                    os.remove(f)
                except OSError:
                    pass
        return len(counts)

    def info(self) -> Dict[str, Any]:
        return {"buckets_requested": self.buckets, "use_shm": True,
                "bucket_bytes": self._bucket_bytes[-1] if self._bucket_bytes else None,
                "stand_ins": ["verl get_torch_device / is_support_ipc in bucketed_weight_transfer: CPU, no IPC"
                              + (" (sender and receiver)" if self.device == "cpu" else
                                 " (sender only: it reads the step's weights to the CPU; the receiver uses "
                                 "verl's own device helpers)"),
                              "the vLLM worker verl's extension is mixed into (model_runner, device, local_rank)",
                              "the sender's bucket size in bytes (verl: whole MB)"]}


_SENDERS: Dict[str, Any] = {}


def _sender(handle: str):
    """The sender process for `handle`, started once per process (about 5 s of imports) and reused
    by later runs in the same process (the fault tests run several); closed at exit."""
    from npu_flashrl.sim import verl_transfer

    sender = _SENDERS.get(handle)
    if sender is not None and sender.proc.poll() is None:
        return sender
    if not _SENDERS:
        import atexit

        atexit.register(lambda: [s.close() for s in _SENDERS.values()])
    sender = _SENDERS[handle] = verl_transfer.SenderProcess(handle, timeout_s=TIMEOUT_S)
    return sender


def _verl_segments() -> set:
    """The shared-memory segments verl's senders have open now (Linux: /dev/shm)."""
    try:
        return {n for n in os.listdir("/dev/shm") if n.startswith("verl_weights_")}
    except OSError:
        return set()


def _forget_segments(names: set) -> None:
    """CPython < 3.13 registers a segment with this process's resource tracker when verl's receiver
    merely attaches to it (gh-82300); the sender unlinks it, and at exit the tracker would warn
    about "leaked" segments and fail to unlink them again. Deregistered after each sync."""
    if not names:
        return
    try:
        from multiprocessing import resource_tracker

        for name in names:
            resource_tracker.unregister("/" + name, "shared_memory")
    except Exception:  # noqa: BLE001 - cosmetic only: the tracker's warnings at exit
        pass
    names.clear()


def make(transport: Dict[str, Any], buckets: int, work_dir: str, device: str):
    return VerlSync(buckets, work_dir, device) if transport["name"] == "verl" else DirectSync(buckets)
