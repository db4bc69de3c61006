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
       for HCCL) from a trainer process to this one, verl's `split/merge_weight_chunks`

For each: seconds of trainer-side quantization, transfer and receiver, bytes on the wire and the
receiver's peak extra heap, then the ratio lines `bytes bf16/int8 = `, `receiver b/c = `,
`layerwise/in-place = ` (d/c) and `end-to-end b/c = `.

    .venv/bin/python benchmarks/sync.py --layers 2
    .venv/bin/python benchmarks/sync.py --tiny          # smoke run (hidden 256), seconds
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time

os.environ.setdefault("TORCH_DEVICE_BACKEND_AUTOLOAD", "0")
os.environ.setdefault("VLLM_PLUGINS", "none")
os.environ.setdefault("VLLM_LOGGING_LEVEL", "WARNING")

import torch  # noqa: E402

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from _reload_common import PeakMemory, has_layerwise_reload  # noqa: E402
from reload import QWEN25_7B, make_weights  # noqa: E402

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
LABELS = {"a": "bf16 wire -> bf16 rollout", "b": "bf16 wire -> INT8 rollout",
          "c": "INT8 wire -> INT8 rollout", "d": "INT8 wire -> vLLM layerwise"}
TINY = dict(hidden_size=256, intermediate_size=704, num_attention_heads=4, num_key_value_heads=2)


def _env():
    env = dict(os.environ)
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
                                  choice=None if variant == "a" else cpu_vllm.int8()).__enter__()
        self.model = self.v.model
        self.seconds = 0.0

    def begin(self):
        self.seconds = 0.0
        if self.variant == "d":
            from vllm.model_executor.model_loader import reload

            reload.initialize_layerwise_reload(self.model)

    def load(self, weights):
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


def sync_shm(rollout, path, bucket_bytes, sender):
    from verl.workers.rollout.vllm_rollout.bucketed_weight_transfer import BucketedWeightReceiver

    sender.send(path, bucket_mb=1, bucket_bytes=bucket_bytes)
    receiver = BucketedWeightReceiver(zmq_handle=sender.handle, device=torch.device("cpu"),
                                      use_shm=True)
    rollout.begin()
    with PeakMemory() as mem:
        t0 = time.perf_counter()
        receiver.receive_weights(on_bucket_received=lambda w, is_last: rollout.load(w))
        rollout.end()
        total = time.perf_counter() - t0
    sender.expect("sent")
    return total, rollout.seconds, mem.extra


def sync_ce(rollout, path, bucket_bytes):
    from npu_flashrl.sim import cpu_vllm, gloo_checkpoint_engine as gce

    port = cpu_vllm.free_port()
    proc = subprocess.Popen([sys.executable, "-m", "npu_flashrl.sim.gloo_checkpoint_engine",
                             str(port), "2", str(bucket_bytes), path], env=_env(),
                            stdout=subprocess.PIPE, text=True)
    try:
        try:
            engine = gce.connect(port, 1, 2, bucket_bytes, timeout_s=180)
        except Exception as exc:  # noqa: BLE001 - say what the trainer process did
            raise RuntimeError(f"gloo trainer process (exit code {proc.poll()}) never served the "
                               f"group: {exc}".splitlines()[0]) from None
        rollout.begin()
        pulled = [0.0]

        def received():
            # The engine's tensors are views of its bucket: copied out, as verl's
            # CheckpointEngineWorker copies them into its BucketedWeightSender's buffer. Time spent
            # waiting for the broadcast is transfer, not receiver.
            it = gce.iter_received(engine)
            while True:
                t = time.perf_counter()
                item = next(it, None)
                if item is not None:
                    item = (item[0], item[1].clone())
                pulled[0] += time.perf_counter() - t
                if item is None:
                    return
                yield item

        with PeakMemory() as mem:
            t0 = time.perf_counter()
            rollout.load(received())
            rollout.end()
            total = time.perf_counter() - t0
        rollout.seconds -= pulled[0]
        out = proc.communicate(timeout=600)[0]
        if proc.returncode != 0 or "sent" not in out:
            raise RuntimeError(f"gloo trainer process failed ({proc.returncode}): {out[-2000:]}")
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    return total, rollout.seconds, mem.extra


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--layers", type=int, default=2, help="decoder layers of Qwen2.5-7B shape")
    ap.add_argument("--tiny", action="store_true", help="hidden 256 instead of 7B shapes (smoke run)")
    ap.add_argument("--bucket-mb", type=int, default=512, help="bucket size (verl's default 2048)")
    ap.add_argument("--threads", type=int, default=None, help="torch threads")
    ap.add_argument("--json", help="also write the results here")
    args = ap.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)

    from npu_flashrl import patches
    from npu_flashrl.quant.wire import int8_wire
    from npu_flashrl.sim import cpu_vllm, verl_transfer

    cpu_vllm.prepare_process()
    verl_transfer.use_cpu_device()
    from npu_flashrl.adapters import vllm_ascend

    patches.apply_patches(list(vllm_ascend.PATCHES))
    cfg = dict(QWEN25_7B, num_hidden_layers=args.layers, **(TINY if args.tiny else {}))
    # a tensor must fit one bucket (verl asserts it on shared memory): the tiny embedding is 512 KB
    bucket = (1 << 20) if args.tiny else args.bucket_mb << 20
    root = tempfile.mkdtemp(prefix="npu_flashrl_bench_sync_")
    with open(os.path.join(root, "config.json"), "w") as f:
        json.dump(cfg, f)
    weights = make_weights(cfg, args.layers)
    bf16_file = verl_transfer.save_weights(weights, os.path.join(root, "bf16.safetensors"))
    stats = {}
    t0 = time.perf_counter()
    wire = list(int8_wire(weights, torch.bfloat16, stats=stats))
    quant_s = time.perf_counter() - t0
    int8_file = verl_transfer.save_weights(wire, os.path.join(root, "int8.safetensors"))
    wire_bytes = {"bf16": sum(t.numel() * t.element_size() for _, t in weights),
                  "int8": sum(t.numel() * t.element_size() for _, t in wire)}
    del wire
    print(f"Qwen2.5-7B {'(tiny) ' if args.tiny else ''}shapes, {args.layers} decoder layers; bucket "
          f"{bucket >> 10} KB; torch threads={torch.get_num_threads()}; load: {os.getloadavg()}")

    variants = ["a", "b", "c"] + (["d"] if has_layerwise_reload() else [])
    files = {"a": bf16_file, "b": bf16_file, "c": int8_file, "d": int8_file}
    handle = f"ipc:///tmp/npu-flashrl-bench-sync-{os.getpid()}.sock"
    results, states = {}, {}
    with verl_transfer.SenderProcess(handle, env=_env(), timeout_s=600) as sender:
        for k in variants:
            rollout = Rollout(k, root, cpu_vllm, vllm_ascend)
            try:
                for transport in ("shm", "ce"):
                    fn = (lambda r, p: sync_shm(r, p, bucket, sender)) if transport == "shm" \
                        else (lambda r, p: sync_ce(r, p, bucket))
                    print(f"  {k}) {LABELS[k]} via {transport} ...", flush=True)
                    if sender.proc.poll() is not None:
                        raise RuntimeError(f"verl sender process exited: {sender.stderr_tail()}")
                    try:
                        total, recv, peak = fn(rollout, files[k])
                    except RuntimeError as exc:  # reported in the table; the other runs go on
                        print(f"     failed: {exc}", flush=True)
                        results[(k, transport)] = {"failed": str(exc)}
                        continue
                    q = quant_s if k in "cd" else 0.0
                    results[(k, transport)] = {"quantize_s": q, "transfer_s": total - recv,
                                               "receiver_s": recv, "end_to_end_s": q + total,
                                               "wire_bytes": wire_bytes["int8" if k in "cd" else "bf16"],
                                               "peak_extra_bytes": peak}
                states[k] = rollout.state() if k != "a" else None
            finally:
                rollout.close()
    same = {k: all(torch.equal(states[k][n], states["b"][n]) for n in states["b"])
            for k in variants if k in "cd"}

    print(f"\n{'variant':<28}{'via':>5}{'quant s':>9}{'transfer s':>12}{'receiver s':>12}"
          f"{'total s':>9}{'wire MB':>9}{'peak MB':>9}")
    for (k, tr), r in results.items():
        if "failed" in r:
            print(f"{k}) {LABELS[k]:<25}{tr:>5}  failed: {r['failed'][:80]}")
            continue
        print(f"{k}) {LABELS[k]:<25}{tr:>5}{r['quantize_s']:>9.3f}{r['transfer_s']:>12.3f}"
              f"{r['receiver_s']:>12.3f}{r['end_to_end_s']:>9.3f}{r['wire_bytes'] / 2**20:>9.1f}"
              f"{r['peak_extra_bytes'] / 2**20:>9.1f}")
    print(f"INT8 state after (c) and (d) equals (b)'s: {same}")
    ratios = {}
    for tr in ("shm", "ce"):
        b, c, d = results[("b", tr)], results[("c", tr)], results.get(("d", tr))
        if "failed" in b or "failed" in c:
            print(f"\n[{tr}] (b) or (c) failed: no ratios")
            continue
        if d is not None and "failed" in d:
            d = None
        ratios[tr] = {"bytes": b["wire_bytes"] / c["wire_bytes"],
                      "receiver_b_c": b["receiver_s"] / c["receiver_s"],
                      "end_to_end_b_c": b["end_to_end_s"] / c["end_to_end_s"]}
        if d is not None:
            ratios[tr]["layerwise_in_place"] = d["receiver_s"] / c["receiver_s"]
            ratios[tr]["layerwise_peak_minus_in_place_MB"] = (d["peak_extra_bytes"] -
                                                              c["peak_extra_bytes"]) / 2**20
        print(f"\n[{tr}]")
        print(f"bytes bf16/int8 = {ratios[tr]['bytes']:.3f}")
        print(f"receiver b/c = {ratios[tr]['receiver_b_c']:.2f}")
        if d is not None:
            print(f"layerwise/in-place = {ratios[tr]['layerwise_in_place']:.2f} "
                  f"(peak extra {d['peak_extra_bytes'] / 2**20:.1f} MB vs {c['peak_extra_bytes'] / 2**20:.1f} MB)")
        else:
            print("layerwise/in-place = - (this vLLM has no layerwise reload)")
        print(f"end-to-end b/c = {ratios[tr]['end_to_end_b_c']:.2f}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"results": {f"{k}/{tr}": r for (k, tr), r in results.items()},
                       "ratios": ratios, "same_int8_state_as_b": same,
                       "load": os.getloadavg(), "quantize_stats": stats}, f, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
