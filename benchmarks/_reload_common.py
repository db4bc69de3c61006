"""Pieces both modes of `benchmarks/reload.py` share (dense Qwen2.5-7B, `--moe` Qwen3-30B-A3B):
peak-memory sampling, timing, the variants (c) and (d) built from upstream's own steps, the
kernel throughput probe and the side-by-side table."""
from __future__ import annotations

import ctypes
import threading
import time

import torch

LABELS = {"a": "bf16 load_weights (floor)", "b": "npu_flashrl INT8 in-place reload",
          "c": "FlashRL-style INT8 reload", "d": "vLLM layerwise reload (int8 ckpt)"}


# --------------------------------------------------------------------------- memory

class _Mallinfo2(ctypes.Structure):
    _fields_ = [(n, ctypes.c_size_t) for n in ("arena", "ordblks", "smblks", "hblks", "hblkhd",
                                                "usmblks", "fsmblks", "uordblks", "fordblks",
                                                "keepcost")]


def _heap_in_use():
    """Bytes the C heap has handed out right now (freed memory does not count, unlike RSS)."""
    libc = ctypes.CDLL("libc.so.6")
    libc.mallinfo2.restype = _Mallinfo2
    return lambda: (lambda m: m.uordblks + m.hblkhd)(libc.mallinfo2())


class PeakMemory:
    def __init__(self, interval=0.001):
        self.read = _heap_in_use()
        self.interval = interval

    def __enter__(self):
        self.base = self.read()
        self.peak = self.base
        self._stop = threading.Event()
        self._t = threading.Thread(target=self._run, daemon=True)
        self._t.start()
        return self

    def _run(self):
        while not self._stop.is_set():
            self.peak = max(self.peak, self.read())
            time.sleep(self.interval)

    def __exit__(self, *exc):
        self._stop.set()
        self._t.join()
        self.peak = max(self.peak, self.read())
        self.extra = self.peak - self.base


def timed(fn, repeats):
    best, peak = float("inf"), 0
    for _ in range(repeats):
        with PeakMemory() as mem:
            t0 = time.perf_counter()
            fn()
            dt = time.perf_counter() - t0
        best = min(best, dt)
        peak = max(peak, mem.extra)
    return best, peak


def _once(fn):
    t0 = time.perf_counter()
    fn()
    return time.perf_counter() - t0


# --------------------------------------------------------------------------- variants

# Tensors vllm-ascend's post-processing assigns as plain attributes (not parameters) on
# quantized layers: (c) keeps their old storages too, as FlashRL's
# `flash_rl_module_attribute_to_preserve` does for the attributes it is told about.
DERIVED_ATTRS = ("weight_scale_fp32", "w13_weight_scale_fp32", "fused_w1_scale", "fused_w2_scale")


def _checkpoint_shape(module, pname, p, moe):
    """The shape a processed W8A8 parameter had when vLLM created it (what FlashRL 1.0.3 records
    as `hacked_original_weights_rebuild_keys` before the first post-processing)."""
    if moe:  # W8A8_DYNAMIC fused MoE: [E, H, 2I] -> [E, 2I, H]; scales [E, n] -> [E, n, 1]
        if pname in ("w13_weight", "w2_weight"):
            return (p.shape[0], p.shape[2], p.shape[1])
        if pname.endswith(("_weight_scale", "_weight_offset")):
            return tuple(p.shape) + (1,)
        return None
    if pname == "weight":
        return (p.shape[1], p.shape[0])
    if pname in ("weight_scale", "weight_offset"):
        return (p.shape[0], 1)
    return None


def flashrl_style_reload(model, weights):
    """FlashRL 1.0.3's reload shape, with our quantization kernel: fresh unprocessed parameters
    for the whole model (fused-MoE experts included: FlashRL's patch is model-agnostic, it
    re-allocates every `named_parameters()` entry), vLLM's loaders, post-processing again, copy
    back into the old storages."""
    from vllm.model_executor.model_loader.utils import process_weights_after_loading

    loader = model._npu_flashrl_loader
    dense = {id(t.layer) for t in loader.targets.values()}
    moe = {id(t.layer) for t in getattr(loader, "experts", {}).values()}
    saved = {}
    for mname, module in model.named_modules():
        quantized = id(module) in dense or id(module) in moe
        for pname, p in list(module.named_parameters(recurse=False)):
            saved[(mname, pname)] = p
            shape = _checkpoint_shape(module, pname, p, id(module) in moe) if quantized else None
            data = torch.empty(shape, dtype=p.dtype) if shape is not None else torch.empty_like(p.data)
            new = torch.nn.Parameter(data, requires_grad=False)
            new.__dict__.update({k: v for k, v in p.__dict__.items() if not k.startswith("_")})
            module.register_parameter(pname, new)
        if quantized:
            module._npu_flashrl_processed = False
            for attr in DERIVED_ATTRS:
                if isinstance(getattr(module, attr, None), torch.Tensor):
                    saved[(mname, attr)] = getattr(module, attr)
    loader._original(loader.cold.stream(weights, loader.quantizer))
    process_weights_after_loading(model, model._bench_model_config, torch.device("cpu"))
    with torch.no_grad():
        for (mname, pname), old in saved.items():
            module = model.get_submodule(mname) if mname else model
            if pname in DERIVED_ATTRS:
                old.copy_(getattr(module, pname))
                setattr(module, pname, old)
                continue
            old.data.copy_(getattr(module, pname).data)
            module.register_parameter(pname, old)


def checkpoint_format_stream(weights):
    """What a user feeding vLLM's layerwise reload must send: each projection (expert shards
    included) quantized by the same kernel into checkpoint format (int8 [out, in],
    weight_scale / weight_offset [out, 1]), its NaN / Inf refusal read back once at the end (as
    npu_flashrl's receivers do: no host synchronisation per projection)."""
    from npu_flashrl import kernels

    finite: list = []
    for name, t in weights:
        if name.endswith("_proj.weight"):
            q, s = kernels.quantize_weight_per_channel(t, torch.bfloat16, finite=finite)
            base = name[: -len("weight")]
            yield name, q
            yield base + "weight_scale", s.to(t.dtype).unsqueeze(1)
            yield base + "weight_offset", torch.zeros(s.shape[0], 1, dtype=t.dtype)
        else:
            yield name, t
    if finite and not bool(torch.stack([f.reshape(()) for f in finite]).all()):
        raise ValueError("checkpoint_format_stream: a projection contains NaN or Inf")


def vllm_layerwise_reload(model, weights):
    """vLLM's RL reload: restore each layer to its checkpoint layout, buffer its loads, rerun
    post-processing, copy into the old storages. The model's vLLM loader is called directly."""
    from vllm.model_executor.model_loader import reload

    reload.initialize_layerwise_reload(model)
    model._npu_flashrl_loader._original(checkpoint_format_stream(weights))
    reload.finalize_layerwise_reload(model, model._bench_model_config)


def has_layerwise_reload() -> bool:
    import importlib.util

    return importlib.util.find_spec("vllm.model_executor.model_loader.reload") is not None


def same_state(model, state, ptrs):
    """(every parameter equals `state`, every data pointer is the one in `ptrs`)."""
    params = dict(model.named_parameters())
    return (all(torch.equal(p, state[n]) for n, p in params.items()),
            all(p.data_ptr() == ptrs[n] for n, p in params.items()))


# --------------------------------------------------------------------------- kernel, output

def kernel_throughput(shape, repeats):
    """GB/s of bf16 input on one `shape` ([out, in]) tensor: a copy, the kernel in both layouts
    and the transposed int8 write."""
    from npu_flashrl import kernels

    w = torch.randn(*shape).to(torch.bfloat16)
    dst = torch.empty_like(w)
    dst_t = torch.empty(w.shape[1], w.shape[0], dtype=torch.int8)
    q, _ = kernels.quantize_weight_per_channel(w)
    res = {}
    for name, fn in (("bf16 copy", lambda: dst.copy_(w)),
                     ("per-channel int8 quantize", lambda: kernels.quantize_weight_per_channel(w)),
                     # (b)'s path: the int8 produced in the processed [in, out] memory
                     ("per-channel into [in, out]", lambda: kernels.quantize_weight_per_channel(
                         w, transposed=True)),
                     ("transposed int8 write", lambda: dst_t.copy_(q.t()))):
        best = min(_once(fn) for _ in range(repeats + 1))
        res[name] = w.numel() * w.element_size() / best / 1e9
    return res


def print_throughput(tp, what):
    print(f"\nthroughput on a {what} bf16 tensor (GB/s of bf16 input):")
    for name, gbs in tp.items():
        print(f"  {name:<28}{gbs:>8.2f}")
    print(f"  quantize / copy = {tp['per-channel int8 quantize'] / tp['bf16 copy']:.2f}")


def print_variants(results, width=36):
    """The seconds / peak-memory table and the ratios b/a, c/a, c/b (d/b); returns the ratios.
    `results[k]` is (seconds, peak extra bytes) or a string saying why it did not run."""
    ran = {k: v for k, v in results.items() if not isinstance(v, str)}
    print(f"\n{'variant':<{width}}{'seconds':>10}{'peak extra MB':>16}")
    for k in sorted(results):
        if k not in ran:
            print(f"{k}) {LABELS[k]:<{width - 3}}{'-':>10}{'-':>16}")
            continue
        s, mem = ran[k]
        print(f"{k}) {LABELS[k]:<{width - 3}}{s:>10.3f}{mem / 2**20:>16.1f}")
    ratios = {}
    for num, den in (("b", "a"), ("c", "a"), ("c", "b"), ("d", "b")):
        if num in ran and den in ran:
            ratios[f"{num}/{den}"] = ran[num][0] / ran[den][0]
    print("\n" + "\n".join(f"{k} = {v:.2f}" for k, v in ratios.items() if k != "d/b"))
    if "d/b" in ratios:
        print(f"d/b = {ratios['d/b']:.2f}")
    return ratios


# --------------------------------------------------------------------------- harness

def check_positive(ap, args, *names, allow_zero=()):
    """Refuse a non-positive count by its flag (`--layers 0` ran the default before, `--repeats 0`
    printed inf/nan) and a thread count past what torch can start (`--threads 100000` crashed)."""
    import os

    for name in names:
        v = getattr(args, name)
        if v is None:
            continue
        low = 0 if name in allow_zero else 1
        if v < low:
            ap.error(f"--{name.replace('_', '-')} must be at least {low}, got {v}")
    threads = getattr(args, "threads", None)
    cpus = os.cpu_count() or 1
    if threads is not None and not 1 <= threads <= 4 * cpus:
        ap.error(f"--threads must be between 1 and {4 * cpus} (4x this machine's {cpus} CPUs), "
                 f"got {threads}")


def check_json_output(ap, args):
    """Refuse a `--json` the results could not be written to, before the run (a missing directory
    ran the whole benchmark, then lost its result in a traceback)."""
    import os

    path = getattr(args, "json", None)
    if not path:
        return
    directory = os.path.dirname(os.path.abspath(path))
    if os.path.isdir(path):
        ap.error(f"--json {path}: is a directory; expected a file path")
    if not os.path.isdir(directory):
        ap.error(f"--json {path}: the directory {directory} does not exist (create it first)")
    if not os.access(directory, os.W_OK | os.X_OK) or (os.path.exists(path) and not os.access(path, os.W_OK)):
        ap.error(f"--json {path}: not writable")


def median_spread(xs):
    """(median, min, max) of repeated measurements."""
    s = sorted(xs)
    n = len(s)
    med = s[n // 2] if n % 2 else (s[n // 2 - 1] + s[n // 2]) / 2
    return med, s[0], s[-1]


def fmt_spread(xs, digits=3):
    med, lo, hi = median_spread(xs)
    return f"{med:.{digits}f} [{lo:.{digits}f}-{hi:.{digits}f}]"


def load_line(when):
    import os

    return f"machine load ({when}): {' '.join(f'{x:.2f}' for x in os.getloadavg())} on {os.cpu_count()} CPUs"


def counted(fn):
    """`fn()` under `npu_flashrl.sim.costs.CostCounter`: its machine-independent costs."""
    from npu_flashrl.sim.costs import CostCounter

    with CostCounter() as c:
        fn()
    return c.costs


def device_counted(fn):
    """`fn()` under `npu_flashrl.sim.device_costs.DeviceCounter`: its costs in the NPU's units."""
    from npu_flashrl.sim.device_costs import DeviceCounter

    with DeviceCounter() as c:
        fn()
    return c.costs


def limit_bytes(weights, projection):
    """The device traffic a rollout-side quantizing reload cannot go below: each projection read
    once in bf16, its int8 written once with one fp32 scale per row; every other tensor read and
    written once."""
    total = 0
    for name, t in weights:
        if projection(name) and t.dim() == 2:
            total += t.numel() * t.element_size() + t.numel() + 4 * t.shape[0]
        else:
            total += 2 * t.numel() * t.element_size()
    return total


# what H allows: one read-back per load_weights call (a bucket) and, for a sync whose first write
# comes in a streamed call, one more (its checks read back before that write, so that a stream
# refused before then leaves the model as it was): a few per sync, none per layer
H_ALLOWS = ("beyond one per load_weights call and one per streamed sync (its read-back before "
            "its first write)")


def syncs_per_layer(costs, layers, calls=1, streamed=False):
    """Host synchronisations per decoder layer beyond what `H_ALLOWS` (`streamed`: the sync
    came as a streamed call)."""
    return max(0, costs.host_syncs - calls - int(streamed)) / layers


def verdict(ok):
    return "met" if ok else "NOT met"
