"""Weight-sync benchmark of the INT8 wire on Qwen2.5-7B layer shapes, CPU with emulated torch_npu.

One run, four variants side by side, each through two transports:

  (a) bf16 wire into the bf16 rollout
  (b) bf16 wire into the INT8 rollout (today: the rollout quantizes)
  (c) INT8 wire into the INT8 rollout (the trainer quantizes, the receiver commits in place)
  (d) vLLM's layerwise reload fed the same int8 wire (`initialize_layerwise_reload`, the model's
      vLLM `load_weights`, `finalize_layerwise_reload`; zero weight_offsets added on receipt)

  shm: verl's real `BucketedWeightSender` in a trainer process -> verl's real
       `BucketedWeightReceiver` here, over POSIX shared memory (what NPUs without IPC use)
  ce:  the gloo checkpoint engine (`npu_flashrl.sim.gloo_checkpoint_engine`, the CPU stand-in
       for HCCL) from a trainer process to this one, verl's `split/merge_weight_chunks`, then
       what verl 0.9.1's rollout-side `CheckpointEngineWorker` does with it: every tensor
       copied into the rollout's IPC bucket, one `load_weights` list call per bucket
       (`rollout_buckets`)

For each: seconds of trainer-side quantization, transfer and receiver (median of `--repeats`
syncs, [min-max]), bytes on the wire and the receiver's peak extra heap, then the ratio lines
`bytes bf16/int8 = `, `receiver b/c = `, `layerwise/in-place = ` (d/c) and `end-to-end b/c = `.

Then the receiver's machine-independent costs of one more sync of each (`npu_flashrl.sim.costs`:
operator launches, bytes read + written, bytes allocated and their peak), next to the limit
(each wire byte read once and written once into the live layer; the INT8 wire carries int8 plus
one scale per row) and the anchor ((d), vLLM's layerwise reload), and per transport the lines
`receiver traffic / limit = X` ((c)'s traffic over the limit; target <= 1.5; also printed
without the transport's own device traffic, `TRANSPORT_OPS`) and
`peak extra in-place / layerwise = Y` ((c)'s counted peak over (d)'s; target < 1), each with
`target met` / `target NOT met`.

Harness: one trainer process per transport for all syncs (verl's BucketedWeightSender over shared
memory; `benchmarks/_ce_trainer.py` for the checkpoint engine), started before and ended after
every measured receive, with the receiver's torch threads; the machine's load printed at start
and end; the temporary weight files and shared-memory segments removed at the end.

    .venv/bin/python benchmarks/sync.py --layers 2
    .venv/bin/python benchmarks/sync.py --tiny          # smoke run (hidden 256), seconds
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time

os.environ.setdefault("TORCH_DEVICE_BACKEND_AUTOLOAD", "0")
os.environ.setdefault("VLLM_PLUGINS", "none")
os.environ.setdefault("VLLM_LOGGING_LEVEL", "WARNING")

import torch  # noqa: E402

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from _reload_common import (H_ALLOWS, PeakMemory, check_json_output, check_positive,  # noqa: E402
                            fmt_spread, has_layerwise_reload, load_line, median_spread, verdict)
from reload import QWEN25_7B, make_weights  # noqa: E402

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
LABELS = {"a": "bf16 wire -> bf16 rollout", "b": "bf16 wire -> INT8 rollout",
          "c": "INT8 wire -> INT8 rollout", "d": "INT8 wire -> vLLM layerwise"}
TINY = dict(hidden_size=256, intermediate_size=704, num_attention_heads=4, num_key_value_heads=2)


def _env(threads=None):
    env = dict(os.environ)
    if threads:
        env["OMP_NUM_THREADS"] = str(threads)  # the trainer's torch threads, as the receiver's
    env["PYTHONPATH"] = os.pathsep.join(p for p in (ROOT, env.get("PYTHONPATH")) if p)
    env["VLLM_PLUGINS"] = "none"
    env.pop("FLASHRL_CONFIG", None)
    return env


def _with_offsets(weights):
    """(d): vLLM's layerwise reload completes a layer once every checkpoint tensor arrived, the
    zero weight_offset of W8A8_DYNAMIC included; the wire does not carry it. Copies too: the
    layerwise reload keeps what it is given until the layer is complete, past the bucket."""
    for name, t in weights:
        yield name, t.clone()
        if name.endswith(".weight_scale"):
            yield name[: -len("scale")] + "offset", torch.zeros_like(t)


class Rollout:
    """One rollout model and how each variant loads a sync into it."""

    def __init__(self, variant, model_dir, cpu_vllm, vllm_ascend):
        self.variant = variant
        self.va = vllm_ascend
        self.v = cpu_vllm.CpuVllm(model_dir, quantization=None if variant == "a" else "ascend",
                                  load_format="dummy",
                                  # ND weights: verl 0.9.1's worker extension sets
                                  # VLLM_ASCEND_ENABLE_NZ=0 in every rollout worker
                                  enable_nz=False,
                                  choice=None if variant == "a" else cpu_vllm.int8()).__enter__()
        self.model = self.v.model
        self.seconds = 0.0
        self.calls = 0
        self.buckets = []  # the names of each list call of the last sync

    def begin(self):
        self.seconds = 0.0
        self.calls = 0
        self.buckets = []
        if self.variant == "d":
            from vllm.model_executor.model_loader import reload

            reload.initialize_layerwise_reload(self.model)

    def load(self, weights):
        self.calls += 1
        if isinstance(weights, list):
            self.buckets.append([n for n, _ in weights])
        t0 = time.perf_counter()
        if self.variant == "a":
            self.model.load_weights(weights)
        elif self.variant == "d":
            self.model._npu_flashrl_loader._original(_with_offsets(weights))
        else:
            self.model.load_weights(weights)
        self.seconds += time.perf_counter() - t0

    def end(self):
        t0 = time.perf_counter()
        if self.variant == "d":
            from vllm.model_executor.model_loader import reload

            reload.finalize_layerwise_reload(self.model, self.v.vllm_config.model_config)
        elif self.variant in "bc":
            self.va.end_weight_sync(self.model)
        self.seconds += time.perf_counter() - t0

    def state(self):
        return {n: p.detach().clone() for n, p in self.model.named_parameters()}

    def close(self):
        self.v.__exit__(None, None, None)


def _untrack_attached_segments():
    """verl's receiver attaches to the sender's shared-memory segments; Python < 3.13 registers an
    attached segment with this process's resource tracker too, which then warns at exit about
    segments the sender already unlinked. The sender owns them: unregister on attach."""
    import importlib
    from multiprocessing import resource_tracker

    mod = importlib.import_module("verl.workers.rollout.vllm_rollout.bucketed_weight_transfer")
    original = mod.rebuild_shared_memory
    if getattr(original, "_npu_flashrl_bench", False):
        return

    def rebuild_shared_memory(name, size, dtype=torch.uint8):
        from npu_flashrl.sim.device_costs import active

        tensor, shm = original(name, size, dtype=dtype)
        if active() is not None:  # host memory: verl's `.to(device)` of it is a copy to the device
            active().mark_host(tensor)
        try:
            resource_tracker.unregister(shm._name, "shared_memory")
        except Exception:  # noqa: BLE001 - Python >= 3.13 does not track attached segments
            pass
        return tensor, shm

    rebuild_shared_memory._npu_flashrl_bench = True
    mod.rebuild_shared_memory = rebuild_shared_memory


def _measure(counter):
    """The sampled heap peak, under the cost counter when counting."""
    import contextlib

    stack = contextlib.ExitStack()
    if counter is not None:
        stack.enter_context(counter)
    mem = stack.enter_context(PeakMemory())
    return stack, mem


def sync_shm(rollout, path, bucket_bytes, sender, counter=None):
    from verl.workers.rollout.vllm_rollout.bucketed_weight_transfer import BucketedWeightReceiver

    sender.send(path, bucket_mb=1, bucket_bytes=bucket_bytes)
    receiver = BucketedWeightReceiver(zmq_handle=sender.handle, device=torch.device("cpu"),
                                      use_shm=True)
    rollout.begin()
    stack, mem = _measure(counter)
    with stack:
        t0 = time.perf_counter()
        receiver.receive_weights(on_bucket_received=lambda w, is_last: rollout.load(w))
        rollout.end()
        total = time.perf_counter() - t0
    sender.expect("sent")
    return total, rollout.seconds, mem.extra


class CeTrainer:
    """The long-lived trainer rank of the checkpoint engine (`_ce_trainer.py`) and this process's
    receiving rank, connected once for all syncs."""

    def __init__(self, bucket_bytes, threads):
        from npu_flashrl.sim import cpu_vllm, gloo_checkpoint_engine as gce

        self.gce = gce
        self.bucket_bytes = bucket_bytes
        port = cpu_vllm.free_port()
        self.proc = subprocess.Popen(
            [sys.executable, os.path.join(os.path.dirname(os.path.abspath(__file__)), "_ce_trainer.py"),
             str(port), "2", str(bucket_bytes), str(threads)],
            env=_env(threads), stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, bufsize=1)
        try:
            self.engine = gce.connect(port, 1, 2, bucket_bytes, timeout_s=600)
        except Exception as exc:  # noqa: BLE001 - say what the trainer process did
            self.close()
            raise RuntimeError(f"gloo trainer process (exit code {self.proc.poll()}) never served "
                               f"the group: {exc}".splitlines()[0]) from None

    def start(self, path):
        if self.proc.poll() is not None:
            raise RuntimeError(f"gloo trainer process exited ({self.proc.returncode})")
        self.proc.stdin.write(path + "\n")
        self.proc.stdin.flush()

    def finish(self):
        while True:  # other lines are upstream's logging
            line = self.proc.stdout.readline()
            if not line:
                raise RuntimeError(f"gloo trainer process ended ({self.proc.poll()}) before 'sent'")
            if line.startswith("sent"):
                return

    def close(self):
        if self.proc.poll() is None:
            try:
                self.proc.stdin.write("\n")
                self.proc.stdin.close()
                self.proc.wait(timeout=60)
            except (BrokenPipeError, subprocess.TimeoutExpired, ValueError):
                self.proc.kill()
                self.proc.wait()


# device-side work of the transport (not of the receiver): what `receiver traffic / limit`
# also prints without
TRANSPORT_OPS = {"shm": ("h2d_copy",), "ce": ("hccl_broadcast", "ce_bucket_copy", "ce_merge_copy")}


def rollout_buckets(items, bucket_bytes, counter=None):
    """verl 0.9.1's checkpoint-engine path past the engine, as lists of (name, tensor): each
    rollout rank's `CheckpointEngineWorker.update_weights` hands the engine's generator to
    `ServerAdapter.update_weights`, whose `BucketedWeightSender` copies every tensor into its
    bucket (`copy_`, one per tensor) and sends a bucket when the next tensor would overflow it
    (tensors aligned to their element size); the vLLM worker's `update_weights_from_ipc` then
    calls `load_weights` once per bucket with views of that bucket (NPU IPC, no further copy).
    A tensor larger than the bucket goes alone and uncopied (`_direct_send_large_weight`),
    after verl's `merge_weight_chunks` re-assembled it from its chunks (a copy). Stand-ins: the
    bucket's copy is a `clone` per tensor (CPU), counted on the device by `counter` (a
    DeviceCounter) as `ce_bucket_copy` / `ce_merge_copy`, with the broadcast's write into the
    engine's device bucket (`hccl_broadcast`, HCCL's work, no kernel of its own per tensor);
    the ZeroMQ hand-over between the two processes is a Python call. Without IPC (HDK < 25.3)
    the bucket is host shared memory: the same bytes as a device-to-host and a host-to-device
    copy instead of one device copy."""
    on_device = hasattr(counter, "device_copy")
    bucket, offset = [], 0
    it = iter(items)
    while True:
        with counter.paused() if counter is not None else _nothing():
            item = next(it, None)  # a view of the engine's bucket (HCCL wrote it)
        if item is None:
            break
        name, tensor = item
        nbytes = tensor.numel() * tensor.element_size()
        align = tensor.element_size()
        offset = (offset + align - 1) // align * align
        if bucket and offset + nbytes > bucket_bytes:  # verl sends the full bucket first
            full, bucket, offset = bucket, [], 0
            yield full
            del full
        if on_device:
            counter.device_write(nbytes, "hccl_broadcast", launches=0)
            copied = counter.device_copy(tensor, "ce_bucket_copy" if nbytes <= bucket_bytes
                                         else "ce_merge_copy")
        else:
            with counter.paused() if counter is not None else _nothing():
                copied = tensor.clone()
        del item, tensor
        if nbytes > bucket_bytes:
            yield [(name, copied)]
            del copied
            continue
        bucket.append((name, copied))
        del copied
        offset += nbytes
    if bucket:
        full, bucket = bucket, []
        yield full


def sync_ce(rollout, path, trainer, counter=None):
    """One sync over the checkpoint engine, as verl 0.9.1 delivers it to the rollout: list calls,
    one per bucket (`rollout_buckets`)."""
    trainer.start(path)
    rollout.begin()
    stack, mem = _measure(counter)
    with stack:
        t0 = time.perf_counter()  # receiving and copying into the buckets is transfer time
        for bucket in rollout_buckets(trainer.gce.iter_received(trainer.engine), trainer.bucket_bytes,
                                      counter):
            rollout.load(bucket)
            del bucket  # verl's receiver drops a bucket's views before it acknowledges it
        rollout.end()
        total = time.perf_counter() - t0
    trainer.finish()
    return total, rollout.seconds, mem.extra


def transport_bytes(device_counts, transport):
    """The device bytes of `transport`'s own work in one counted sync (`TRANSPORT_OPS`)."""
    return sum(device_counts["bytes_by_op"].get(op, 0) for op in TRANSPORT_OPS[transport])


def _nothing():
    import contextlib

    return contextlib.nullcontext()


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--layers", type=int, default=2, help="decoder layers of Qwen2.5-7B shape")
    ap.add_argument("--tiny", action="store_true", help="hidden 256 instead of 7B shapes (smoke run)")
    ap.add_argument("--bucket-mb", type=int, default=512, help="bucket size (verl's default 2048)")
    ap.add_argument("--threads", type=int, default=None,
                    help="torch threads of the receiver and of both trainer processes")
    ap.add_argument("--repeats", type=int, default=3,
                    help="timed syncs per variant and transport (the median is printed)")
    ap.add_argument("--json", help="also write the results here")
    args = ap.parse_args(argv)
    check_positive(ap, args, "layers", "bucket_mb", "repeats")
    check_json_output(ap, args)
    if args.threads:
        torch.set_num_threads(args.threads)
    threads = torch.get_num_threads()
    root = tempfile.mkdtemp(prefix="npu_flashrl_bench_sync_")
    try:
        return run(args, root, threads)
    finally:
        shutil.rmtree(root, ignore_errors=True)  # gigabytes of weight files at 7B shapes


def run(args, root, threads):
    from npu_flashrl import patches
    from npu_flashrl.quant.wire import int8_wire
    from npu_flashrl.sim import cpu_vllm, verl_transfer
    from npu_flashrl.sim.costs import CostCounter
    from npu_flashrl.sim.device_costs import DeviceCounter

    print(load_line("start"), flush=True)
    cpu_vllm.prepare_process()
    verl_transfer.use_cpu_device()
    _untrack_attached_segments()
    from npu_flashrl.adapters import vllm_ascend

    patches.apply_patches(list(vllm_ascend.PATCHES))
    cfg = dict(QWEN25_7B, num_hidden_layers=args.layers, **(TINY if args.tiny else {}))
    # a tensor must fit one bucket (verl asserts it on shared memory): the tiny embedding is 512 KB
    bucket = (1 << 20) if args.tiny else args.bucket_mb << 20
    with open(os.path.join(root, "config.json"), "w") as f:
        json.dump(cfg, f)
    weights = make_weights(cfg, args.layers)
    bf16_file = verl_transfer.save_weights(weights, os.path.join(root, "bf16.safetensors"))
    stats = {}
    t0 = time.perf_counter()
    wire = list(int8_wire(weights, torch.bfloat16, stats=stats))
    quant_s = time.perf_counter() - t0
    int8_file = verl_transfer.save_weights(wire, os.path.join(root, "int8.safetensors"))
    with DeviceCounter() as trainer_counter:  # the trainer side of the INT8 wire, on its device
        for _ in int8_wire(weights, torch.bfloat16):
            pass  # each item dropped as sent (a bucket holds it; its copy is the transport's)
    trainer_costs = dict(trainer_counter.costs.as_dict(), by_op=dict(trainer_counter.costs.by_op))
    wire_bytes = {"bf16": sum(t.numel() * t.element_size() for _, t in weights),
                  "int8": sum(t.numel() * t.element_size() for _, t in wire),
                  # the float tensors both wires carry as they are (embedding, norms, biases)
                  "float": sum(t.numel() * t.element_size() for n, t in wire
                               if t.is_floating_point() and not n.endswith(".weight_scale"))}
    del wire
    print(f"Qwen2.5-7B {'(tiny) ' if args.tiny else ''}shapes, {args.layers} decoder layers; bucket "
          f"{bucket >> 10} KB; torch threads={threads} (receiver and trainers); "
          f"{args.repeats} timed syncs + 1 counted per variant and transport")

    variants = ["a", "b", "c"] + (["d"] if has_layerwise_reload() else [])
    files = {"a": bf16_file, "b": bf16_file, "c": int8_file, "d": int8_file}
    handle = f"ipc:///tmp/npu-flashrl-bench-sync-{os.getpid()}.sock"
    results, states, costs = {}, {}, {}
    with verl_transfer.SenderProcess(handle, env=_env(threads), timeout_s=600) as sender:
        trainer = CeTrainer(bucket, threads)
        try:
            fns = {"shm": lambda r, p, c=None: sync_shm(r, p, bucket, sender, c),
                   "ce": lambda r, p, c=None: sync_ce(r, p, trainer, c)}
            for k in variants:
                rollout = Rollout(k, root, cpu_vllm, vllm_ascend)
                try:
                    for transport, fn in fns.items():
                        print(f"  {k}) {LABELS[k]} via {transport} ...", flush=True)
                        if sender.proc.poll() is not None:
                            raise RuntimeError(f"verl sender process exited: {sender.stderr_tail()}")
                        try:
                            runs = [fn(rollout, files[k]) for _ in range(args.repeats)]
                            counter = CostCounter()
                            fn(rollout, files[k], counter)
                            dcounter = DeviceCounter()
                            fn(rollout, files[k], dcounter)
                            calls, buckets = rollout.calls, rollout.buckets
                        except RuntimeError as exc:  # reported in the table; the other runs go on
                            print(f"     failed: {exc}", flush=True)
                            results[(k, transport)] = {"failed": str(exc)}
                            continue
                        costs[(k, transport)] = counter.costs
                        q = quant_s if k in "cd" else 0.0
                        results[(k, transport)] = {
                            "quantize_s": q, "transfer_s": [t - r for t, r, _ in runs],
                            "receiver_s": [r for _, r, _ in runs],
                            "end_to_end_s": [q + t for t, _, _ in runs],
                            "wire_bytes": wire_bytes["int8" if k in "cd" else "bf16"],
                            "peak_extra_bytes": max(m for _, _, m in runs),
                            "buckets": buckets,
                            "counts": dict(counter.costs.as_dict(), by_op=dict(counter.costs.by_op),
                                           bytes_by_op=dict(counter.costs.bytes_by_op)),
                            "device_counts": dict(dcounter.costs.as_dict(),
                                                  by_op=dict(dcounter.costs.by_op),
                                                  bytes_by_op=dict(dcounter.costs.bytes_by_op),
                                                  load_calls=calls)}
                    states[k] = rollout.state() if k != "a" else None
                finally:
                    rollout.close()
        finally:
            trainer.close()
    same = {k: all(torch.equal(states[k][n], states["b"][n]) for n in states["b"])
            for k in variants if k in "cd" and k in states and "b" in states}
    report(args, results, same, wire_bytes, stats, trainer_costs)
    print(load_line("end"), flush=True)
    return 0


def report(args, results, same, wire_bytes, stats, trainer):
    med = lambda xs: median_spread(xs)[0]  # noqa: E731
    print(f"\nCPU seconds, median of {args.repeats} [min-max]:")
    print(f"{'variant':<31}{'via':>4}{'quant s':>8}{'transfer s':>22}{'receiver s':>22}"
          f"{'wire MB':>9}{'peak MB':>9}")
    for (k, tr), r in results.items():
        if "failed" in r:
            print(f"{k}) {LABELS[k]:<28}{tr:>4}  failed: {r['failed'][:80]}")
            continue
        print(f"{k}) {LABELS[k]:<28}{tr:>4}{r['quantize_s']:>8.3f}{fmt_spread(r['transfer_s']):>22}"
              f"{fmt_spread(r['receiver_s']):>22}{r['wire_bytes'] / 2**20:>9.1f}"
              f"{r['peak_extra_bytes'] / 2**20:>9.1f}")
    print(f"INT8 state after (c) and (d) equals (b)'s: {same}")
    print(f"trainer side of the INT8 wire on its device: {trainer['launches']} launches, "
          f"{trainer['traffic_bytes'] / 2**20:.1f} MB read + written for {wire_bytes['bf16'] / 2**20:.1f} MB "
          f"of bf16, peak extra {trainer['peak_extra_bytes'] / 2**20:.1f} MB, "
          f"{trainer['host_syncs']} host syncs")

    limit = 2 * wire_bytes["int8"]
    print(f"\nreceiver costs of one sync (machine-independent; limit = each INT8-wire byte read once "
          f"and written once into the live layer = {limit / 2**20:.1f} MB of traffic, "
          f"{wire_bytes['int8'] / 2**20:.1f} MB on the wire):")
    print(f"{'variant':<31}{'via':>4}{'launches':>10}{'read MB':>10}{'written MB':>11}"
          f"{'traffic/limit':>14}{'alloc MB':>10}{'peak MB':>9}{'wire MB':>9}")
    for (k, tr), r in results.items():
        if "failed" in r:
            continue
        c = r["counts"]
        print(f"{k}) {LABELS[k]:<28}{tr:>4}{c['launches']:>10}{c['read_bytes'] / 2**20:>10.1f}"
              f"{c['written_bytes'] / 2**20:>11.1f}{c['traffic_bytes'] / limit:>14.2f}"
              f"{c['allocated_bytes'] / 2**20:>10.1f}{c['peak_extra_bytes'] / 2**20:>9.1f}"
              f"{r['wire_bytes'] / 2**20:>9.1f}")

    print(f"\nreceiver costs of one sync on the device (`sim.device_costs`: NPU kernels, the "
          "transport's device-side copy counted: shm's host-to-device copy of every bucket tensor, "
          "HCCL's write and verl's copy into the rollout's IPC bucket over the checkpoint engine):")
    print(f"{'variant':<31}{'via':>4}{'launches':>10}{'read MB':>10}{'written MB':>11}"
          f"{'traffic/limit':>14}{'peak MB':>9}{'H2D MB':>8}{'syncs':>7}")
    for (k, tr), r in results.items():
        if "failed" in r:
            continue
        c = r["device_counts"]
        print(f"{k}) {LABELS[k]:<28}{tr:>4}{c['launches']:>10}{c['read_bytes'] / 2**20:>10.1f}"
              f"{c['written_bytes'] / 2**20:>11.1f}{c['traffic_bytes'] / limit:>14.2f}"
              f"{c['peak_extra_bytes'] / 2**20:>9.1f}{c['host_to_device_bytes'] / 2**20:>8.1f}"
              f"{c['host_syncs']:>7}")

    ratios = {}
    for tr in ("shm", "ce"):
        b, c, d = results.get(("b", tr), {"failed": 1}), results.get(("c", tr), {"failed": 1}), \
            results.get(("d", tr))
        if "failed" in b or "failed" in c:
            print(f"\n[{tr}] (b) or (c) failed: no ratios")
            continue
        if d is not None and "failed" in d:
            d = None
        ratios[tr] = {"bytes": b["wire_bytes"] / c["wire_bytes"],
                      "receiver_b_c": med(b["receiver_s"]) / med(c["receiver_s"]),
                      "end_to_end_b_c": med(b["end_to_end_s"]) / med(c["end_to_end_s"]),
                      "receiver_traffic_over_limit": c["counts"]["traffic_bytes"] / limit}
        print(f"\n[{tr}]")
        print(f"bytes bf16/int8 = {ratios[tr]['bytes']:.3f}")
        print(f"receiver b/c = {ratios[tr]['receiver_b_c']:.2f}")
        if d is not None:
            ratios[tr]["layerwise_in_place"] = med(d["receiver_s"]) / med(c["receiver_s"])
            ratios[tr]["layerwise_peak_minus_in_place_MB"] = (d["peak_extra_bytes"] -
                                                              c["peak_extra_bytes"]) / 2**20
            print(f"layerwise/in-place = {ratios[tr]['layerwise_in_place']:.2f} "
                  f"(sampled heap peak extra {d['peak_extra_bytes'] / 2**20:.1f} MB vs "
                  f"{c['peak_extra_bytes'] / 2**20:.1f} MB)")
        else:
            print("layerwise/in-place = - (this vLLM has no layerwise reload)")
        print(f"end-to-end b/c = {ratios[tr]['end_to_end_b_c']:.2f}")
        dc, dd = c["device_counts"], (d["device_counts"] if d is not None else None)
        x = ratios[tr]["device_traffic_over_limit"] = dc["traffic_bytes"] / limit
        own = transport_bytes(dc, tr)
        xr = ratios[tr]["device_traffic_over_limit_without_transport"] = (dc["traffic_bytes"] - own) / limit
        ratios[tr]["transport_traffic_over_limit"] = own / limit
        ratios[tr]["transport_ops"] = list(TRANSPORT_OPS[tr])
        print(f"receiver traffic / limit = {x:.2f} (device, the transport's device-side copy "
              f"counted; target <= 1.5: {verdict(x <= 1.5)}; CPU count "
              f"{ratios[tr]['receiver_traffic_over_limit']:.2f}); without the transport's own "
              f"device traffic ({', '.join(TRANSPORT_OPS[tr])}: {own / limit:.2f}) {xr:.2f}")
        floor = ratios[tr]["x_floor"] = own / limit + 1 + wire_bytes["float"] / limit
        print(f"  X's floor here: the transport's own {own / limit:.2f} + the limit 1 + one read "
              f"of the float tensors for their NaN/Inf check {wire_bytes['float'] / limit:.2f} "
              f"= {floor:.2f}")
        if dd is not None:
            dp = dd["peak_extra_bytes"]
            y = dc["peak_extra_bytes"] / dp if dp else float("inf")
            ratios[tr]["peak_extra_in_place_over_layerwise"] = y
            print(f"peak extra in-place / layerwise = {y:.2f} (device; target < 1: {verdict(y < 1)}; "
                  f"{dc['peak_extra_bytes'] / 2**20:.1f} MB vs {dp / 2**20:.1f} MB)")
            lr = ratios[tr]["launches_wire_over_layerwise"] = dc["launches"] / dd["launches"]
            print(f"launches wire receiver / layerwise = {lr:.2f} (device; target <= 1: "
                  f"{verdict(lr <= 1)}; {dc['launches']} vs {dd['launches']})")
        else:
            print("peak extra in-place / layerwise = - (this vLLM has no layerwise reload)")
            print("launches wire receiver / layerwise = - (this vLLM has no layerwise reload)")
    # both transports hand the rollout list calls, one per bucket
    h = {f"{k}/{tr}": max(0, r["device_counts"]["host_syncs"] - r["device_counts"]["load_calls"])
                      / args.layers
         for (k, tr), r in results.items() if "failed" not in r}
    if h:
        worst = max(h, key=h.get)
        ratios["host_syncs_per_layer"], ratios["host_syncs_rule"] = h, H_ALLOWS
        print(f"\nhost syncs per layer, max over receivers = {h[worst]:.1f} (target 0: "
              f"{verdict(h[worst] == 0)}; {H_ALLOWS}; "
              + ", ".join(f"{k} {v:.1f}" for k, v in h.items()) + ")")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"results": {f"{k}/{tr}": r for (k, tr), r in results.items()},
                       "ratios": ratios, "same_int8_state_as_b": same, "limit_traffic_bytes": limit,
                       "load": os.getloadavg(), "quantize_stats": stats,
                       "trainer_device_counts": trainer, "wire_bytes": wire_bytes,
                       "layers": args.layers}, f, indent=1)


if __name__ == "__main__":
    raise SystemExit(main())
