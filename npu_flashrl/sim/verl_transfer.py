"""Server-mode verl's bucketed weight sync on a CPU (the current line): its real sender in one process, its real receiver
(`vLLMColocateWorkerExtension.update_weights_from_ipc`) in another, over shared memory.

Stand-ins, only for what needs a GPU/NPU or verl's Ray/vLLM process tree:
- `use_cpu_device()`: `get_torch_device` and `is_support_ipc` inside
  `bucketed_weight_transfer` (on a CPU verl falls back to its CUDA platform, whose
  `torch.cuda.synchronize()` fails): the CPU device module, and no IPC, so the transport is
  verl's POSIX shared-memory fallback (`use_shm=True`, what NPUs without IPC support use).
- `make_worker()`: the vLLM worker object verl's extension is mixed into. It is built with
  `object.__new__` (verl's `__new__` sets a parent-death signal meant for vLLM's worker
  process) and carries what `update_weights_from_ipc` reads from a vLLM worker: `model_runner`
  (`model`, `vllm_config`), `device`, `local_rank`.

- `"bucket_bytes"` (a command option, used by `npu-flashrl rehearse`): the sender's bucket size
  in bytes instead of verl's whole megabytes (`bucket_size_mb << 20`), so that a tiny model's
  sync arrives in several buckets the way a real model's does in 512 MB ones. verl's own packing
  loop does the rest.

The sender process: `python -m npu_flashrl.sim.verl_transfer ZMQ_HANDLE` reads one JSON
command per line on stdin: `{"weights": <safetensors file>, "drop": [names], "bucket_mb": 1,
"bucket_bytes": N, "overwrite": true}`, sends the file's tensors in the file's order with verl's
`BucketedWeightSender`, and prints `sent` (with `overwrite`: after the last bucket is
acknowledged it fills the bucket buffer with garbage, prints `overwritten` and waits for a
line on stdin before releasing it). Protocol lines start with PREFIX (vLLM logs to stdout).
`SenderProcess` starts and drives it from the receiving process.
"""
from __future__ import annotations

import json
import os
import queue
import subprocess
import sys
import tempfile
import threading
import types
from typing import Optional

import torch

from npu_flashrl.errors import NpuFlashrlError

PREFIX = "@npu_flashrl@ "
_TRANSFER = "verl.workers.rollout.vllm_rollout.bucketed_weight_transfer"


def _cpu_device_module():
    return types.SimpleNamespace(synchronize=torch.cpu.synchronize, empty_cache=lambda: None,
                                 ipc_collect=lambda: None)


def use_cpu_device() -> None:
    """Stand-in: verl's device helpers inside the bucket transfer, pointed at the CPU."""
    import importlib

    mod = importlib.import_module(_TRANSFER)
    mod.get_torch_device = _cpu_device_module
    mod.is_support_ipc = lambda: False


def make_worker(model, vllm_config, local_rank: int = 0):
    """Stand-in for the vLLM worker that verl's extension is mixed into (see module doc)."""
    from verl.workers.rollout.vllm_rollout.utils import vLLMColocateWorkerExtension

    worker = object.__new__(vLLMColocateWorkerExtension)
    worker.model_runner = types.SimpleNamespace(model=model, vllm_config=vllm_config)
    worker.device = torch.device("cpu")
    worker.local_rank = local_rank
    worker._is_qat_model = False
    worker._is_modelopt_qat = False
    return worker


def _say(word: str) -> None:
    # vLLM logs to stdout too: protocol lines carry a prefix
    print(PREFIX + word, flush=True)


def _send(handle: str, cmd: dict) -> None:
    import asyncio

    from safetensors.torch import load_file

    from verl.workers.rollout.vllm_rollout.bucketed_weight_transfer import BucketedWeightSender

    drop = set(cmd.get("drop") or ())
    tensors = load_file(cmd["weights"])
    with open(cmd["weights"] + ".order") as f:  # the trainer's order (safetensors sorts names)
        order = json.load(f)
    sender = BucketedWeightSender(zmq_handle=handle, bucket_size_mb=int(cmd.get("bucket_mb", 1)),
                                  use_shm=True)
    if cmd.get("bucket_bytes"):
        sender.bucket_size = int(cmd["bucket_bytes"])  # stand-in, see the module doc
    if cmd.get("overwrite"):
        cleanup = sender._cleanup

        def overwrite_then_cleanup():
            # the receiver acknowledged the last bucket: nothing of it may still be in use there
            if sender.buffer is not None:
                sender.buffer.fill_(0x7F)
            _say("overwritten")
            sys.stdin.readline()
            cleanup()

        sender._cleanup = overwrite_then_cleanup
    weights = ((n, tensors[n]) for n in order if n not in drop)
    asyncio.run(sender.async_send_weights(weights))
    _say("sent")


def fsdp_engine_params(model, dtype: torch.dtype = torch.float32):
    """(name, tensor) pairs as server-mode verl's FSDP engine hands them to the rollout's sender
    (`FSDPEngine.get_per_tensor_param` in verl/workers/engine/fsdp/transformer_impl.py, no LoRA,
    no QAT): the actor module's `state_dict()` in the actor's master dtype
    (`actor_rollout_ref.actor.fsdp_config.model_dtype`, default fp32, so the rollout receives
    fp32 and casts or quantizes itself), keys through verl's `convert_weight_keys`, transformers
    5's packed MoE experts (3-D `gate_up_proj` / `down_proj`) expanded to per-expert checkpoint
    names by verl's `unfuse_moe_params` (through `tiny_models.trainer_weights`). Both functions
    are verl's own. verl renames keys before unfusing; the conversion mapping renames module
    prefixes only, so applying it after gives the same names.

    Stand-in: the FSDP-wrapped actor module. This takes the unwrapped HF `model` (a copy is cast
    to `dtype`, the master dtype the actor would keep); on one trainer rank an FSDP2 DTensor's
    `full_tensor()` (what the engine yields) is the whole parameter, which is what the plain
    state dict holds.
    """
    import copy

    from verl.utils.model import convert_weight_keys

    from npu_flashrl.sim.tiny_models import trainer_weights

    master = copy.deepcopy(model).to(dtype)
    return list(convert_weight_keys(dict(trainer_weights(master)), master).items())


def save_weights(named_tensors, path: str) -> str:
    """Write (name, tensor) pairs for the sender process, keeping their order."""
    from safetensors.torch import save_file

    items = [(n, t.detach().contiguous().cpu()) for n, t in named_tensors]
    save_file(dict(items), path)
    with open(path + ".order", "w") as f:
        json.dump([n for n, _ in items], f)
    return path


class TransferError(NpuFlashrlError, RuntimeError):
    """The sender process did not answer as expected; the message carries its stderr tail."""


def sender_env(environ: Optional[dict] = None) -> dict:
    """The sender process's environment: this checkout first on the path, no vLLM plugins (the
    trainer side of a sync needs none), no FlashRL config."""
    env = dict(os.environ if environ is None else environ)
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    env["PYTHONPATH"] = os.pathsep.join(p for p in (root, env.get("PYTHONPATH")) if p)
    env.setdefault("TORCH_DEVICE_BACKEND_AUTOLOAD", "0")
    env["VLLM_PLUGINS"] = "none"
    env.pop("FLASHRL_CONFIG", None)
    return env


class SenderProcess:
    """verl's BucketedWeightSender in its own process (the trainer side of a sync), driven over
    its stdin/stdout protocol (module doc). Each wait for a protocol line is bounded by
    `timeout_s`: a sender that died is a TransferError naming its stderr, not a hang."""

    def __init__(self, handle: str, env: Optional[dict] = None, timeout_s: float = 300.0):
        self.handle, self.timeout_s = handle, timeout_s
        self.err = tempfile.TemporaryFile()
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "npu_flashrl.sim.verl_transfer", handle],
            env=sender_env() if env is None else env, stdin=subprocess.PIPE, stdout=subprocess.PIPE,
            stderr=self.err, text=True, bufsize=1)
        # A reader thread, not select() on the pipe: two lines written at once land in the
        # text wrapper's buffer, where select() cannot see the second one (a wait until timeout).
        self._lines: queue.Queue[str] = queue.Queue()
        threading.Thread(target=self._read_lines, name=f"sender-{handle}-stdout", daemon=True).start()
        try:
            self.expect("ready")
        except BaseException:
            self.close()
            raise

    def send(self, weights: str, **opts) -> None:
        """Start one sync of the tensors in `weights` (a `save_weights` file); options as in the
        module doc. The receiver's `update_weights_from_ipc` then takes it; `expect("sent")` after."""
        self._write(json.dumps({"weights": weights, **opts}) + "\n")

    def release(self) -> None:
        self._write("\n")

    def _write(self, text: str) -> None:
        try:
            self.proc.stdin.write(text)
            self.proc.stdin.flush()
        except (BrokenPipeError, ValueError):
            raise TransferError(f"verl sender process exited ({self.proc.poll()}); stderr:\n"
                                f"{self.stderr_tail()}") from None

    def stderr_tail(self, n: int = 3000) -> str:
        self.err.seek(0)
        return self.err.read().decode(errors="replace")[-n:]

    def _read_lines(self) -> None:
        for line in self.proc.stdout:
            self._lines.put(line)
        self._lines.put("")  # end of output: the process closed stdout or exited

    def expect(self, word: str) -> None:
        line = ""
        while not line.startswith(PREFIX):
            try:
                line = self._lines.get(timeout=self.timeout_s)
            except queue.Empty:
                line = "<timeout>"
            if line == "":
                self._lines.put("")  # stays at the end for a later expect()
            if line in ("", "<timeout>"):
                break
        line = line.strip()[len(PREFIX.strip()):].strip() if line.startswith(PREFIX) else line
        if line != word:
            raise TransferError(f"verl sender process: expected {word!r}, got {line!r} (exit code "
                                f"{self.proc.poll()}); stderr:\n{self.stderr_tail()}")

    def close(self) -> None:
        if self.proc.poll() is None:
            try:
                self.proc.stdin.close()
            except (BrokenPipeError, ValueError):
                pass
            try:
                self.proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self.err.close()

    def __enter__(self) -> "SenderProcess":
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if len(argv) != 1:
        print("usage: python -m npu_flashrl.sim.verl_transfer ZMQ_HANDLE", file=sys.stderr)
        return 2
    os.environ.setdefault("VLLM_PLUGINS", "none")
    use_cpu_device()
    _say("ready")
    for line in sys.stdin:
        if not line.strip():
            continue
        _send(argv[0], json.loads(line))
    return 0


if __name__ == "__main__":
    sys.exit(main())
