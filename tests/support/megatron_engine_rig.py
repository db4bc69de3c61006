"""The trainer side of the Megatron engine sync tests (imported as `megatron_engine_rig`:
tests/support is on sys.path): verl 0.9.1's `MegatronEngineWithLMHead` in rank processes
(`python -m npu_flashrl.sim.megatron_engine`, whose stand-ins that module lists), the checkpoints
they load, and the three-sync check against a fresh rollout load (`verl_server_rig`). Used by
tests/adapters/megatron/test_megatron_engine.py and test_megatron_engine_archs.py.

megatron-core and mbridge live in an overlay directory (`<venv>/megatron-overlay`,
scripts/bootstrap_cpu_stack.sh; or NPU_FLASHRL_MEGATRON_OVERLAY), put on the rank processes'
PYTHONPATH only.
"""
import contextlib
import json
import os
import queue
import subprocess
import sys
import tempfile
import threading

import pytest

from helpers import restore_environ, set_verl_replica_env
from npu_flashrl.sim.cpu_vllm import free_port
from verl_server_rig import assert_state, fresh_state, replica_handle, split_layers

ROOT = os.path.abspath(os.path.join(os.path.dirname(__file__), "..", ".."))
SUPPORT = os.path.join(ROOT, "tests", "support")
PREFIX = "@npu_flashrl@ "
TIMEOUT_S = 600
BUCKET_BYTES = 1 << 20
CHECKPOINTS = 4  # w0 (the engine's first load) .. w3


def megatron_overlay():
    """Where megatron-core and mbridge are installed for this venv, or None."""
    path = os.environ.get("NPU_FLASHRL_MEGATRON_OVERLAY") or os.path.join(sys.prefix,
                                                                          "megatron-overlay")
    ok = all(os.path.isdir(os.path.join(path, p)) for p in ("megatron/core", "mbridge"))
    return path if ok else None


class EngineRanks:
    """The trainer's ranks, each a `python -m npu_flashrl.sim.megatron_engine` process."""

    def __init__(self, model_dir, world, tp, handle, ep=1, patches=(), environ=None,
                 engine="megatron", path=(), pp=1):
        overlay = megatron_overlay()
        env = dict(os.environ, TORCH_DEVICE_BACKEND_AUTOLOAD="0", VLLM_PLUGINS="none",
                   PYTHONPATH=os.pathsep.join(p for p in (*path, ROOT, SUPPORT, overlay,
                                                          os.environ.get("PYTHONPATH")) if p))
        env.pop("FLASHRL_CONFIG", None)
        env.update(environ or {})
        port = free_port()
        self.errs, self.procs, self.lines = [], [], []
        for rank in range(world):
            spec = dict(rank=rank, world=world, port=port, model=model_dir, tp=tp, ep=ep, pp=pp,
                        handle=handle, patches=list(patches), engine=engine)
            err = tempfile.TemporaryFile()
            self.errs.append(err)
            self.procs.append(subprocess.Popen(
                [sys.executable, "-W", "ignore", "-m", "npu_flashrl.sim.megatron_engine",
                 json.dumps(spec)], env=env, stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                stderr=err, text=True, bufsize=1))
            # one reader thread per rank: select() on a buffered text pipe misses lines already read
            lines = queue.Queue()
            threading.Thread(target=self._pump, args=(self.procs[-1].stdout, lines),
                             daemon=True).start()
            self.lines.append(lines)
        self.expect("ready")

    @staticmethod
    def _pump(stream, lines):
        for line in stream:
            if line.startswith(PREFIX):
                lines.put(line[len(PREFIX):].strip())
        lines.put("")

    def tell(self, **cmd):
        for p in self.procs:
            p.stdin.write(json.dumps(cmd) + "\n")
            p.stdin.flush()

    def expect(self, word, ranks=None):
        got = []
        for r in (range(len(self.procs)) if ranks is None else ranks):
            proc = self.procs[r]
            try:
                line = self.lines[r].get(timeout=TIMEOUT_S)
            except queue.Empty:
                line = "<timeout>"
            if not line.startswith(word):
                self.errs[r].seek(0)
                tail = self.errs[r].read().decode(errors="replace")[-4000:]
                raise AssertionError(f"rank {r}: expected {word!r}, got {line!r} "
                                     f"(exit {proc.poll()}); stderr:\n{tail}")
            got.append(line[len(word):].strip())
        return got

    def close(self):
        for p in self.procs:
            if p.poll() is None:
                p.stdin.close()
        for p in self.procs:
            try:
                p.wait(timeout=60)
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait()
        for e in self.errs:
            e.close()


@contextlib.contextmanager
def engine_rig(int8_ready, prefix, arch, build_checkpoint, **ranks_kw):
    """Checkpoints <arch>_w0..w3 in a new directory (`build_checkpoint(dir, seed)` writes one and
    returns its HF model), this process as verl's replica 0 and the engine on w0 with TP=2 over
    two ranks (`ranks_kw`: EngineRanks' other options). Skips without the megatron overlay."""
    if megatron_overlay() is None:
        pytest.skip("megatron-core/mbridge overlay not installed (scripts/bootstrap_cpu_stack.sh "
                    "--line current installs it into <venv>/megatron-overlay)")
    saved = set_verl_replica_env("mcore")
    try:
        root = tempfile.mkdtemp(prefix=prefix)
        dirs, hf = [], []
        for seed in range(CHECKPOINTS):
            d = os.path.join(root, f"{arch}_w{seed}")
            hf.append(build_checkpoint(d, seed))
            dirs.append(d)
        handle = replica_handle()
        ranks = EngineRanks(dirs[0], world=2, tp=2, handle=handle, **ranks_kw)
        try:
            yield dict(root=root, dirs=dirs, hf=hf, ranks=ranks, handle=handle, int8_ready=int8_ready)
        finally:
            ranks.close()
    finally:
        restore_environ(saved)


def three_syncs_equal_fresh_loads(rig, ranks, worker, buckets, model, fn, ptrs, bucket_bytes, arch):
    """Checkpoints 1, 2, 3 in turn: the engine ranks export each through verl's bucketed sender
    into `worker`; after each the rollout state equals a fresh load (same tensors in place) and
    the sync came in several buckets that split decoder layers."""
    for i in (1, 2, 3):
        ranks.tell(load=rig["dirs"][i])
        ranks.expect("loaded")
        buckets.clear()
        ranks.tell(send=True, bucket_bytes=bucket_bytes)
        worker.update_weights_from_ipc(use_shm=True)
        ranks.expect("sent")
        assert_state(model, fresh_state(rig, i, fn), ptrs)
        assert len(buckets) > 1 and split_layers(arch, buckets), buckets
