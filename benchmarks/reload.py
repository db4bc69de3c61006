"""Weight-sync benchmark on Qwen2.5-7B layer shapes, CPU with emulated torch_npu, side by side:

  (a) plain bf16 vLLM `load_weights` of the same weights (the floor users already pay)
  (b) npu_flashrl's INT8 reload (online quantization, in place into the processed W8A8 layers)
  (c) a FlashRL-style INT8 reload with the same quantization kernel: re-allocate every parameter,
      run vLLM's loaders, re-run `process_weights_after_loading`, copy back into the old storages
  (d) where vLLM has it (0.23 line): vLLM's own layerwise reload (`initialize_layerwise_reload` /
      the model's vLLM `load_weights` / `finalize_layerwise_reload`) fed the checkpoint-format
      int8 + weight_scale + weight_offset that the same kernel produces, as a user would have to

Prints seconds and peak extra heap memory of each (glibc mallinfo2, sampled), the ratios
b/a, c/a, c/b (and d/b), and the quantization kernel's throughput next to this machine's plain
copy bandwidth measured in the same run. Then the peak extra memory of one full streamed sync of fp32
masters (embedding and lm_head included) next to its target: one fused layer's bf16 weights plus
the largest single non-projection tensor.

    .venv/bin/python benchmarks/reload.py --layers 4 --repeats 2
"""
from __future__ import annotations

import argparse
import ctypes
import json
import os
import tempfile
import threading
import time

os.environ.setdefault("TORCH_DEVICE_BACKEND_AUTOLOAD", "0")
os.environ.setdefault("VLLM_PLUGINS", "none")
os.environ.setdefault("VLLM_LOGGING_LEVEL", "WARNING")

import torch  # noqa: E402

QWEN25_7B = dict(hidden_size=3584, intermediate_size=18944, num_attention_heads=28,
                 num_key_value_heads=4, vocab_size=1024, max_position_embeddings=4096,
                 rms_norm_eps=1e-6, rope_theta=1000000.0, tie_word_embeddings=False,
                 hidden_act="silu", architectures=["Qwen2ForCausalLM"], model_type="qwen2",
                 torch_dtype="bfloat16")


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


# --------------------------------------------------------------------------- weights

def make_weights(cfg, layers, seed=0):
    g = torch.Generator().manual_seed(seed)
    h, i = cfg["hidden_size"], cfg["intermediate_size"]
    hd = h // cfg["num_attention_heads"]
    kv = cfg["num_key_value_heads"] * hd
    shapes = {"self_attn.q_proj.weight": (h, h), "self_attn.k_proj.weight": (kv, h),
              "self_attn.v_proj.weight": (kv, h), "self_attn.o_proj.weight": (h, h),
              "self_attn.q_proj.bias": (h,), "self_attn.k_proj.bias": (kv,), "self_attn.v_proj.bias": (kv,),
              "mlp.gate_proj.weight": (i, h), "mlp.up_proj.weight": (i, h), "mlp.down_proj.weight": (h, i),
              "input_layernorm.weight": (h,), "post_attention_layernorm.weight": (h,)}
    out = [("model.embed_tokens.weight", torch.randn(cfg["vocab_size"], h, generator=g).to(torch.bfloat16) * 0.02)]
    for layer in range(layers):
        for name, shape in shapes.items():
            t = torch.empty(shape, dtype=torch.bfloat16)
            t.normal_(0, 0.02, generator=g)
            out.append((f"model.layers.{layer}.{name}", t))
    out += [("model.norm.weight", torch.ones(h, dtype=torch.bfloat16)),
            ("lm_head.weight", torch.randn(cfg["vocab_size"], h, generator=g).to(torch.bfloat16) * 0.02)]
    return out


def nbytes(weights):
    return sum(t.numel() * t.element_size() for _, t in weights)


# --------------------------------------------------------------------------- variants

def flashrl_style_reload(model, weights):
    """FlashRL 1.0.3's reload shape, with our quantization kernel: fresh unprocessed parameters
    for the whole model, vLLM's loaders, post-processing again, copy back into the old storages."""
    from vllm.model_executor.model_loader.utils import process_weights_after_loading

    loader = model._npu_flashrl_loader
    quantized = {id(t.layer) for t in loader.targets.values()}
    saved = {}
    for mname, module in model.named_modules():
        for pname, p in list(module.named_parameters(recurse=False)):
            saved[(mname, pname)] = p
            if id(module) in quantized and pname in ("weight", "weight_scale", "weight_offset"):
                shape = (p.shape[1], p.shape[0]) if pname == "weight" else (p.shape[0], 1)
                data = torch.empty(shape, dtype=p.dtype)
            else:
                data = torch.empty_like(p.data)
            new = torch.nn.Parameter(data, requires_grad=False)
            new.__dict__.update({k: v for k, v in p.__dict__.items() if not k.startswith("_")})
            module.register_parameter(pname, new)
        if id(module) in quantized:
            module._npu_flashrl_processed = False
            saved[(mname, "weight_scale_fp32")] = module.weight_scale_fp32
    loader._original(loader._cold_stream(weights))
    process_weights_after_loading(model, model._bench_model_config, torch.device("cpu"))
    with torch.no_grad():
        for (mname, pname), old in saved.items():
            module = model.get_submodule(mname) if mname else model
            if pname == "weight_scale_fp32":
                old.copy_(module.weight_scale_fp32)
                module.weight_scale_fp32 = old
                continue
            old.data.copy_(getattr(module, pname).data)
            module.register_parameter(pname, old)


def checkpoint_format_stream(weights):
    """What a user feeding vLLM's layerwise reload must send: each projection quantized by the
    same kernel into checkpoint format (int8 [out, in], weight_scale / weight_offset [out, 1])."""
    from npu_flashrl import kernels

    for name, t in weights:
        if name.endswith("_proj.weight"):
            q, s = kernels.quantize_weight_per_channel(t, torch.bfloat16)
            base = name[: -len("weight")]
            yield name, q
            yield base + "weight_scale", s.to(t.dtype).unsqueeze(1)
            yield base + "weight_offset", torch.zeros(s.shape[0], 1, dtype=t.dtype)
        else:
            yield name, t


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
def streamed_fp32_sync(cfg, weights, args):
    """One full sync streamed as fp32 masters (a generator, as verl's FSDP worker yields them):
    the decoder layers of `weights` plus an embedding and lm_head of vocab `--fp32-vocab`.
    Returns the peak extra heap bytes and the target (largest fused layer in bf16 + the largest
    single non-projection tensor, fp32)."""
    from npu_flashrl.adapters import vllm_ascend
    from npu_flashrl.testing import cpu_vllm

    cfg32 = dict(cfg, vocab_size=args.fp32_vocab)
    model_dir = tempfile.mkdtemp(prefix="npu_flashrl_bench_fp32_")
    with open(os.path.join(model_dir, "config.json"), "w") as f:
        json.dump(cfg32, f)
    g = torch.Generator().manual_seed(1)
    h = cfg["hidden_size"]
    emb = (torch.randn(args.fp32_vocab, h, generator=g) * 0.02).to(torch.bfloat16)
    head = (torch.randn(args.fp32_vocab, h, generator=g) * 0.02).to(torch.bfloat16)
    # make_weights order: embedding first, lm_head last; the decoder layers are shared
    bf16 = [("model.embed_tokens.weight", emb)] + weights[1:-1] + [("lm_head.weight", head)]
    vllm_ascend.configure_online_quantization("int8_profile_free")
    with cpu_vllm.CpuVllm(model_dir, quantization="ascend", load_format="dummy") as v:
        m = v.model
        targets = m._npu_flashrl_loader.targets
        floats = [t.numel() * 4 for n, t in bf16 if n not in targets]

        def stream():
            for n, t in bf16:
                yield n, t.float()  # fresh fp32 master per item; the generator keeps none

        with PeakMemory() as mem:
            m.load_weights(stream())
            vllm_ascend.end_weight_sync(m)
    layer_bf16 = 2 * cfg["hidden_size"] * 2 * cfg["intermediate_size"]
    return {"peak": mem.extra, "target": layer_bf16 + max(floats), "largest": max(floats),
            "all_float": sum(floats), "vocab": args.fp32_vocab}


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


def kernel_throughput(cfg, repeats):
    from npu_flashrl import kernels

    w = torch.randn(2 * cfg["intermediate_size"], cfg["hidden_size"]).to(torch.bfloat16)
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


def _once(fn):
    t0 = time.perf_counter()
    fn()
    return time.perf_counter() - t0


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--layers", type=int, default=4, help="decoder layers of Qwen2.5-7B shape")
    ap.add_argument("--repeats", type=int, default=2, help="best of N for each variant")
    ap.add_argument("--threads", type=int, default=None,
                    help="torch threads (default: torch's); with other load on the machine, 1 avoids "
                         "OpenMP oversubscription stalls that swamp the comparison")
    ap.add_argument("--fp32-vocab", type=int, default=32768,
                    help="vocab of the streamed fp32 sync (fp32 masters incl. embedding and lm_head); "
                         "Qwen2.5-7B has 152064 (~4.4 GB of fp32 embedding + lm_head); 0 skips it")
    ap.add_argument("--json", help="also write the results here")
    args = ap.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)

    from npu_flashrl import patches
    from npu_flashrl.testing import cpu_vllm

    cpu_vllm.prepare_process()
    from npu_flashrl.adapters import vllm_ascend

    patches.apply_patches(list(vllm_ascend.PATCHES))
    cfg = dict(QWEN25_7B, num_hidden_layers=args.layers)
    model_dir = tempfile.mkdtemp(prefix="npu_flashrl_bench_")
    with open(os.path.join(model_dir, "config.json"), "w") as f:
        json.dump(cfg, f)
    weights = make_weights(cfg, args.layers)
    print(f"Qwen2.5-7B shapes, {args.layers} decoder layers: {nbytes(weights) / 1e9:.2f} GB of bf16 "
          f"weights per sync; torch threads={torch.get_num_threads()}")
    layer_bf16 = 2 * cfg["hidden_size"] * 2 * cfg["intermediate_size"]  # gate_up, the largest fused layer

    results = {}
    vllm_ascend.configure_online_quantization(None)
    with cpu_vllm.CpuVllm(model_dir, quantization=None, load_format="dummy") as v:
        results["a"] = timed(lambda: v.model.load_weights(iter(weights)), args.repeats)
    vllm_ascend.configure_online_quantization("int8_profile_free")
    with cpu_vllm.CpuVllm(model_dir, quantization="ascend", load_format="dummy") as v:
        m = v.model
        m._bench_model_config = v.vllm_config.model_config

        def ours():
            m.load_weights(iter(weights))
            vllm_ascend.end_weight_sync(m)

        results["b"] = timed(ours, args.repeats)
        state_b = {n: p.detach().clone() for n, p in m.named_parameters()}
        ptrs = {n: p.data_ptr() for n, p in m.named_parameters()}
        results["c"] = timed(lambda: flashrl_style_reload(m, iter(weights)), args.repeats)
        same = all(torch.equal(p, state_b[n]) for n, p in m.named_parameters())
        kept = all(p.data_ptr() == ptrs[n] for n, p in m.named_parameters())
        if has_layerwise_reload():
            results["d"] = timed(lambda: vllm_layerwise_reload(m, weights), args.repeats)
            same_d = all(torch.equal(p, state_b[n]) for n, p in m.named_parameters())
            kept_d = all(p.data_ptr() == ptrs[n] for n, p in m.named_parameters())
    del m, v
    fp32 = streamed_fp32_sync(cfg, weights, args) if args.fp32_vocab else None
    vllm_ascend.configure_online_quantization(None)

    labels = {"a": "bf16 load_weights (floor)", "b": "npu_flashrl INT8 in-place reload",
              "c": "FlashRL-style INT8 reload", "d": "vLLM layerwise reload (int8 ckpt)"}
    print(f"\n{'variant':<36}{'seconds':>10}{'peak extra MB':>16}")
    for k in sorted(results):
        s, mem = results[k]
        print(f"{k}) {labels[k]:<33}{s:>10.3f}{mem / 2**20:>16.1f}")
    ra = results["b"][0] / results["a"][0]
    rc = results["c"][0] / results["a"][0]
    cb = results["c"][0] / results["b"][0]
    ratios = {"b/a": ra, "c/a": rc, "c/b": cb}
    print(f"\nb/a = {ra:.2f}\nc/a = {rc:.2f}\nc/b = {cb:.2f}")
    if "d" in results:
        ratios["d/b"] = results["d"][0] / results["b"][0]
        print(f"d/b = {ratios['d/b']:.2f}")
    print(f"peak extra memory: b = {results['b'][1] / 2**20:.0f} MB vs one fused layer's bf16 weights "
          f"(gate_up) = {layer_bf16 / 2**20:.0f} MB; c = {results['c'][1] / 2**20:.0f} MB")
    print(f"(b) and (c) give the same INT8 state: {same}; (c) keeps data pointers: {kept}")
    if "d" in results:
        print(f"d = {results['d'][1] / 2**20:.0f} MB; (d) gives (b)'s INT8 state: {same_d}; "
              f"keeps data pointers: {kept_d}")
    else:
        print("(d) skipped: this vLLM has no layerwise reload (vllm.model_executor.model_loader.reload)")
    if fp32 is not None:
        print(f"\nstreamed fp32 sync (fp32 masters, vocab {args.fp32_vocab}, embedding and lm_head "
              f"included): peak extra {fp32['peak'] / 2**20:.0f} MB vs target {fp32['target'] / 2**20:.0f} MB "
              f"(one fused layer's bf16 weights {layer_bf16 / 2**20:.0f} MB + largest non-projection "
              f"tensor {fp32['largest'] / 2**20:.0f} MB); all non-projection tensors of the stream "
              f"(held to the end before) = {fp32['all_float'] / 2**20:.0f} MB; "
              f"within target: {fp32['peak'] <= fp32['target']}")
    tp = kernel_throughput(cfg, args.repeats)
    print("\nthroughput on a gate_up-sized bf16 tensor (GB/s of bf16 input):")
    for name, gbs in tp.items():
        print(f"  {name:<28}{gbs:>8.2f}")
    print(f"  quantize / copy = {tp['per-channel int8 quantize'] / tp['bf16 copy']:.2f}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"seconds": {k: v[0] for k, v in results.items()},
                       "peak_extra_bytes": {k: v[1] for k, v in results.items()},
                       "ratios": ratios, "throughput_GBps": tp,
                       "streamed_fp32_sync": fp32}, f, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
