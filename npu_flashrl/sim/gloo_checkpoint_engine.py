"""A gloo checkpoint engine for verl's CheckpointEngineManager (server-mode line): the CPU stand-in for HCCL.

On Ascend, verl's `checkpoint_engine.backend=nccl` is `HCCLCheckpointEngine`
(`verl/checkpoint_engine/hccl_checkpoint_engine.py`, registered under "nccl"; it raises ImportError
without torch.npu). A CPU has neither HCCL nor NCCL, so CI registers this engine through verl's own
mechanism instead:

    actor_rollout_ref.rollout.checkpoint_engine.backend=gloo
    actor_rollout_ref.rollout.checkpoint_engine.custom_backend_module=npu_flashrl.sim.gloo_checkpoint_engine

verl imports `custom_backend_module` in the trainer worker (`init_model`), in every rollout-side
`CheckpointEngineWorker` and in the `CheckpointEngineManager` before it looks the backend up in
`CheckpointEngineRegistry`, so importing this module is all the registration there is.

What it mirrors of HCCLCheckpointEngine, so that a sync over it takes the same path as one over
HCCL: the same topology (trainer rank 0 broadcasts, trainer ranks > 0 consume their generator
without sending, rollout workers are ranks 1..N), one group kept across syncs, buckets filled
with verl's own `split_weight_chunks` and re-assembled with verl's own `merge_weight_chunks`, a
bucket's metadata `{"bucket_meta", "is_last"}` travelling before its bytes. What differs: the
metadata goes over the same gloo group (HCCL uses a ZeroMQ PUB/SUB socket), one bucket buffer
instead of two (no overlap; the consumer copies each tensor out before the next bucket arrives),
and every collective waits at most `timeout_s` (engine_kwargs), so a peer that died is an error
rather than a hang.
"""
from __future__ import annotations

import asyncio
import datetime
import pickle
from dataclasses import dataclass
from typing import Any, AsyncGenerator, Generator, Optional

import torch

from verl.checkpoint_engine.base import (CheckpointEngine, CheckpointEngineRegistry, TensorMeta,
                                         merge_weight_chunks, split_weight_chunks)

from npu_flashrl._logging import get_logger
from npu_flashrl.sim.ports import free_port

logger = get_logger(__name__)

BACKEND = "gloo"


@dataclass
class MasterMetadata:
    host: str
    port: int


@CheckpointEngineRegistry.register(BACKEND)
class GlooCheckpointEngine(CheckpointEngine):
    """Broadcast checkpoint engine over a gloo process group (see the module doc).

    Args, as verl passes them (`CheckpointEngineRegistry.new(backend, bucket_size=...,
    is_master=..., **engine_kwargs[backend])`):
        bucket_size: bytes per bucket (`update_weights_bucket_megabytes << 20`).
        is_master: trainer rank 0 (the only sender).
        host: address the master's store listens on (default 127.0.0.1: one machine).
        timeout_s: bound on every collective.
        rebuild_group: a new group at every sync (HCCLCheckpointEngine's option; lets several
            trainers, e.g. a test's, take turns feeding one rollout).
    """

    def __init__(self, bucket_size: int, is_master: bool = False, host: str = "127.0.0.1",
                 timeout_s: float = 120.0, rebuild_group: bool = False, **_: Any) -> None:
        self.bucket_size = int(bucket_size)
        self.is_master = is_master
        self.rebuild_group = rebuild_group
        self.master: Optional[MasterMetadata] = None
        self.host = host
        self.timeout = datetime.timedelta(seconds=float(timeout_s))
        self.port = free_port(host) if is_master else None
        self.group = None
        self.store = None
        self.rank: Optional[int] = None
        self.world_size: Optional[int] = None
        self.buffer: Optional[torch.Tensor] = None
        self.stats = {"syncs": 0, "bytes": 0, "buckets": 0}

    # ----------------------------------------------------------------- verl's engine protocol
    def prepare(self) -> Optional[MasterMetadata]:
        self.buffer = torch.zeros(self.bucket_size, dtype=torch.uint8)
        if self.is_master and self.rebuild_group:
            self.port = free_port(self.host)
        return MasterMetadata(self.host, self.port) if self.is_master else None

    @classmethod
    def build_topology(cls, actor_wg_world_size: int, rollout_world_size: int, metadata: list):
        # HCCLCheckpointEngine.build_topology: trainer rank 0 is rank 0, other trainer ranks -1
        world = rollout_world_size + 1
        actor = {"rank": [0] + [-1] * (actor_wg_world_size - 1),
                 "world_size": [world] * actor_wg_world_size,
                 "master_metadata": [metadata[0]] * actor_wg_world_size}
        rollout = {"rank": list(range(1, world)), "world_size": [world] * rollout_world_size,
                   "master_metadata": [metadata[0]] * rollout_world_size}
        return actor, rollout

    def init_process_group(self, rank: int, world_size: int, master_metadata: MasterMetadata):
        if rank < 0:
            self.rank, self.world_size = rank, world_size
            return
        if self.group is not None and master_metadata != self.master:
            self.group = self.store = None  # a new master (rebuilt group, or a failed sync's)
        if self.group is None:
            self.master = master_metadata
            self.store = torch.distributed.TCPStore(master_metadata.host, master_metadata.port,
                                                    world_size, is_master=rank == 0,
                                                    timeout=self.timeout)
            self.group = torch.distributed.ProcessGroupGloo(
                torch.distributed.PrefixStore("npu_flashrl_gloo_ce", self.store), rank, world_size,
                self.timeout)
            self.rank, self.world_size = rank, world_size
        elif (self.rank, self.world_size) != (rank, world_size):
            raise RuntimeError(f"gloo checkpoint engine: rank/world {rank}/{world_size} differs from "
                               f"the group's {self.rank}/{self.world_size}")
        self._broadcast(torch.ones(1, dtype=torch.int8))  # barrier, as HCCL's all_reduce

    def finalize(self):
        self.buffer = None
        if self.rebuild_group:
            self.group = self.store = None

    # ----------------------------------------------------------------- transfer
    def _broadcast(self, t: torch.Tensor) -> None:
        self.group.broadcast(t, 0, self.timeout).wait()

    def _broadcast_meta(self, meta: Optional[dict]) -> dict:
        if self.rank == 0:
            raw = torch.frombuffer(bytearray(pickle.dumps(meta)), dtype=torch.uint8)
            size = torch.tensor([raw.numel()], dtype=torch.int64)
        else:
            size = torch.zeros(1, dtype=torch.int64)
        self._broadcast(size)
        if self.rank != 0:
            raw = torch.empty(int(size.item()), dtype=torch.uint8)
        self._broadcast(raw)
        return meta if self.rank == 0 else pickle.loads(raw.numpy().tobytes())

    def _send_bucket(self, bucket_meta: dict, used: int, is_last: bool) -> None:
        self._broadcast_meta({"bucket_meta": bucket_meta, "used": used, "is_last": is_last})
        if used:
            self._broadcast(self.buffer[:used])
        self.stats["bytes"] += used
        self.stats["buckets"] += 1

    @torch.no_grad()
    async def send_weights(self, weights: Generator[tuple[str, torch.Tensor], None, None],
                           global_steps: Optional[int] = None):
        assert self.rank is not None and self.rank <= 0, "only trainer ranks send"
        if self.rank < 0:  # as HCCL: other trainer ranks run their generator (FSDP gathers) only
            for _ in weights:
                pass
            return {}
        bucket_meta: dict = {}
        offset = 0
        async for tensor_meta, chunk in split_weight_chunks(weights, self.bucket_size):
            if offset + tensor_meta.chunk_size > self.bucket_size:
                await asyncio.to_thread(self._send_bucket, bucket_meta, offset, False)
                bucket_meta, offset = {}, 0
            tensor_meta.offset = offset
            bucket_meta[tensor_meta.name] = tensor_meta
            self.buffer[offset: offset + tensor_meta.chunk_size] = chunk
            offset += tensor_meta.chunk_size
        await asyncio.to_thread(self._send_bucket, bucket_meta, offset, True)
        self.stats["syncs"] += 1
        return {}

    async def _receive_chunks(self) -> AsyncGenerator[tuple[TensorMeta, torch.Tensor], None]:
        assert self.rank is not None and self.rank > 0, "rank 0 sends"
        while True:
            meta = await asyncio.to_thread(self._broadcast_meta, None)
            used = meta["used"]
            if used:
                await asyncio.to_thread(self._broadcast, self.buffer[:used])
            self.stats["bytes"] += used
            self.stats["buckets"] += 1
            for tensor_meta in meta["bucket_meta"].values():
                yield tensor_meta, self.buffer[tensor_meta.offset: tensor_meta.offset + tensor_meta.chunk_size]
            if meta["is_last"]:
                break
        self.stats["syncs"] += 1

    @torch.no_grad()
    async def receive_weights(self, global_steps: Optional[int] = None
                              ) -> AsyncGenerator[tuple[str, torch.Tensor], None]:
        async for name, weight in merge_weight_chunks(self._receive_chunks(), self.bucket_size):
            yield name, weight

    # ----------------------------------------------------------------- for tests
    def report(self) -> dict:
        """What a test asks of the process this engine lives in (through verl's
        `execute_checkpoint_engine`): transfer counters, npu_flashrl's applied patches and those
        armed, waiting for their module's import (`pending`)."""
        import os

        from npu_flashrl import patches

        return {"pid": os.getpid(), "stats": dict(self.stats),
                "patches": sorted(p["name"] for p in patches.status() if p.get("applied")),
                "pending": {p["name"]: p["pending"] for p in patches.status() if p.get("pending")}}


# ----------------------------------------------------------------------------- a trainer process

def main(argv=None) -> int:
    """`python -m npu_flashrl.sim.gloo_checkpoint_engine PORT WORLD BUCKET_BYTES FILE [FILE ...]`:
    a trainer rank 0 that serves the group on 127.0.0.1:PORT and sends each file (a
    `verl_transfer.save_weights` file, in its order) as one sync, for a receiver started with
    `GlooCheckpointEngine.connect`. Prints `sent <seconds>` after each."""
    import sys

    argv = sys.argv[1:] if argv is None else argv
    port, world, bucket = int(argv[0]), int(argv[1]), int(argv[2])
    engine = GlooCheckpointEngine(bucket, is_master=True)
    engine.port = port
    engine.prepare()
    engine.init_process_group(0, world, MasterMetadata(engine.host, port))
    for path in argv[3:]:
        print(f"sent {send_file(engine, path):.4f}", flush=True)
    return 0


def send_file(engine: GlooCheckpointEngine, path: str) -> float:
    """Send the tensors of safetensors file `path` in the order `path`.order lists (a JSON list of
    names); the seconds the send took."""
    import json
    import time

    from safetensors import safe_open

    with open(path + ".order") as f:
        order = json.load(f)
    with safe_open(path, "pt") as f:
        t0 = time.perf_counter()
        asyncio.run(engine.send_weights((n, f.get_tensor(n)) for n in order))
    return time.perf_counter() - t0


def connect(port: int, rank: int, world: int, bucket_bytes: int,
            timeout_s: float = 300.0) -> GlooCheckpointEngine:
    """A receiving rank of the group `main` serves (rollout side)."""
    engine = GlooCheckpointEngine(bucket_bytes, timeout_s=timeout_s)
    engine.prepare()
    engine.init_process_group(rank, world, MasterMetadata(engine.host, port))
    return engine


def iter_received(engine: GlooCheckpointEngine):
    """One sync's (name, tensor) pairs as a plain generator (the engine's is async); each tensor
    is a view of the bucket and valid until the next item is asked for."""
    loop = asyncio.new_event_loop()
    agen = engine.receive_weights()
    try:
        while True:
            try:
                yield loop.run_until_complete(agen.__anext__())
            except StopAsyncIteration:
                return
    finally:
        loop.close()


if __name__ == "__main__":
    import sys

    sys.exit(main())
