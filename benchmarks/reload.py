"""Weight-sync benchmark on Qwen2.5-7B layer shapes (`--moe`: Qwen3-30B-A3B, see
benchmarks/_reload_moe.py), CPU with emulated torch_npu, side by side:

  (a) plain bf16 vLLM `load_weights` of the same weights (the floor users already pay)
  (b) npu_flashrl's INT8 reload (online quantization, in place into the processed W8A8 layers)
  (c) a FlashRL-style INT8 reload with the same quantization kernel: re-allocate every parameter,
      run vLLM's loaders, re-run `process_weights_after_loading`, copy back into the old storages
  (d) where vLLM has it (0.23 line): vLLM's own layerwise reload (`initialize_layerwise_reload` /
      the model's vLLM `load_weights` / `finalize_layerwise_reload`) fed the checkpoint-format
      int8 + weight_scale + weight_offset that the same kernel produces, as a user would have to

Prints seconds (best of `--repeats`) and peak extra heap memory of each (glibc mallinfo2,
sampled), then each variant's machine-independent costs of one more sync (dense mode;
`npu_flashrl.sim.costs`: operator launches, bytes read + written, bytes allocated and their peak)
with the lines `traffic flashrl-style / in-place = Z` (c/b, target >= 2.5),
`traffic layerwise / in-place = W` (d/b, target > 1) and `launches flashrl-style / in-place = V`
(c/b, target >= 2.5), each marked target met / NOT met; then the ratios
b/a, c/a, c/b (and d/b), and the quantization kernel's throughput next to this machine's plain
copy bandwidth measured in the same run. Then the peak extra memory of one full streamed sync of fp32
masters (embedding and lm_head included) next to its target: one fused layer's bf16 weights plus
the largest single non-projection tensor (dense mode only).

    .venv/bin/python benchmarks/reload.py --layers 4 --repeats 2
    .venv/bin/python benchmarks/reload.py --moe              # 2 layers of Qwen3-30B-A3B shapes
    .venv/bin/python benchmarks/reload.py --moe --tiny --repeats 1   # smoke run, seconds
    .venv/bin/python benchmarks/reload.py --tiny --layers 1 --repeats 1 --fp32-vocab 0  # dense smoke
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import tempfile

os.environ.setdefault("TORCH_DEVICE_BACKEND_AUTOLOAD", "0")
os.environ.setdefault("VLLM_PLUGINS", "none")
os.environ.setdefault("VLLM_LOGGING_LEVEL", "WARNING")

import torch  # noqa: E402

# the shared pieces sit next to this script (it is run as a file, not imported as a package)
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from _reload_common import (H_ALLOWS, PeakMemory, check_json_output, check_positive,  # noqa: E402
                            counted, device_counted, flashrl_style_reload, has_layerwise_reload,
                            kernel_throughput, limit_bytes, load_line, print_throughput,
                            print_variants, same_state, syncs_per_layer, timed, verdict,
                            vllm_layerwise_reload)

QWEN25_7B = dict(hidden_size=3584, intermediate_size=18944, num_attention_heads=28,
                 num_key_value_heads=4, vocab_size=1024, max_position_embeddings=4096,
                 rms_norm_eps=1e-6, rope_theta=1000000.0, tie_word_embeddings=False,
                 hidden_act="silu", architectures=["Qwen2ForCausalLM"], model_type="qwen2",
                 torch_dtype="bfloat16")
# --tiny (dense): the same architecture at hidden 256, for a smoke run and the cost tests
TINY_DENSE = dict(hidden_size=256, intermediate_size=704, num_attention_heads=4, num_key_value_heads=2)


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


def streamed_fp32_sync(cfg, weights, args):
    """One full sync streamed as fp32 masters (a generator, as verl's FSDP worker yields them):
    the decoder layers of `weights` plus an embedding and lm_head of vocab `--fp32-vocab`.
    Returns the peak extra heap bytes and the target (largest fused layer in bf16 + the largest
    single non-projection tensor, fp32)."""
    from npu_flashrl.adapters import vllm_ascend
    from npu_flashrl.sim import cpu_vllm

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
    try:
        floats, peak = _streamed(model_dir, bf16, cpu_vllm, vllm_ascend)
    finally:
        shutil.rmtree(model_dir, ignore_errors=True)
    layer_bf16 = 2 * cfg["hidden_size"] * 2 * cfg["intermediate_size"]
    return {"peak": peak, "target": layer_bf16 + max(floats), "largest": max(floats),
            "all_float": sum(floats), "vocab": args.fp32_vocab}


def _streamed(model_dir, bf16, cpu_vllm, vllm_ascend):
    with cpu_vllm.CpuVllm(model_dir, quantization="ascend", load_format="dummy",
                          choice=cpu_vllm.int8()) as v:
        m = v.model
        targets = m._npu_flashrl_loader.targets
        floats = [t.numel() * 4 for n, t in bf16 if n not in targets]

        def stream():
            for n, t in bf16:
                yield n, t.float()  # fresh fp32 master per item; the generator keeps none

        with PeakMemory() as mem:
            m.load_weights(stream())
            vllm_ascend.end_weight_sync(m)
    return floats, mem.extra


def print_costs(costs, weight_bytes):
    """Each variant's counted costs of one sync and the ratio lines against (b); returns them."""
    from _reload_common import LABELS

    print(f"\nmachine-independent costs of one sync ({weight_bytes / 2**20:.1f} MB of bf16 weights; "
          f"limit: each weight byte read once, its int8 written once):")
    print(f"{'variant':<36}{'launches':>10}{'read MB':>10}{'written MB':>11}{'alloc MB':>10}"
          f"{'peak MB':>9}")
    for k, c in sorted(costs.items()):
        print(f"{k}) {LABELS[k]:<33}{c.launches:>10}{c.read_bytes / 2**20:>10.1f}"
              f"{c.written_bytes / 2**20:>11.1f}{c.allocated_bytes / 2**20:>10.1f}"
              f"{c.peak_extra_bytes / 2**20:>9.1f}")
    b = costs["b"]
    out = {"traffic_c_b": costs["c"].traffic_bytes / b.traffic_bytes,
           "launches_c_b": costs["c"].launches / b.launches}
    print(f"traffic flashrl-style / in-place = {out['traffic_c_b']:.2f} "
          f"(target >= 2.5: {verdict(out['traffic_c_b'] >= 2.5)})")
    if "d" in costs:
        out["traffic_d_b"] = costs["d"].traffic_bytes / b.traffic_bytes
        out["launches_d_b"] = costs["d"].launches / b.launches
        print(f"traffic layerwise / in-place = {out['traffic_d_b']:.2f} "
              f"(target > 1: {verdict(out['traffic_d_b'] > 1)})")
    else:
        print("traffic layerwise / in-place = - (this vLLM has no layerwise reload)")
    print(f"launches flashrl-style / in-place = {out['launches_c_b']:.2f} "
          f"(target >= 2.5: {verdict(out['launches_c_b'] >= 2.5)})")
    if "d" in costs:
        print(f"launches layerwise / in-place = {out['launches_d_b']:.2f} "
              f"(target > 1: {verdict(out['launches_d_b'] > 1)})")
    return out


# the layer counts of `peak extra 4 layers / 1 layer`
PEAK_LAYERS = (1, 4)


def device_peaks(cfg, layers, vllm_ascend, cpu_vllm):
    """Device peak extra bytes of (b) and (c) on a model of `layers` decoder layers, same shapes."""
    cfg = dict(cfg, num_hidden_layers=layers)
    weights = make_weights(cfg, layers)
    model_dir = tempfile.mkdtemp(prefix="npu_flashrl_bench_")
    try:
        with open(os.path.join(model_dir, "config.json"), "w") as f:
            json.dump(cfg, f)
        with cpu_vllm.CpuVllm(model_dir, quantization="ascend", load_format="dummy",
                              choice=cpu_vllm.int8()) as v:
            m = v.model
            m._bench_model_config = v.vllm_config.model_config

            def ours():
                m.load_weights(iter(weights))
                vllm_ascend.end_weight_sync(m)

            ours()  # the first sync after a dummy load
            return {"b": device_counted(ours).peak_extra_bytes,
                    "c": device_counted(lambda: flashrl_style_reload(m, iter(weights))).peak_extra_bytes}
    finally:
        shutil.rmtree(model_dir, ignore_errors=True)


def print_device_costs(dcosts, weights, layers, peaks):
    """Each variant's costs of one sync in the NPU's units (`sim.device_costs`) and the lines
    A (traffic / limit), P (peak extra 4 layers / 1 layer) and H (host syncs per layer)."""
    from _reload_common import LABELS
    from npu_flashrl.quant.wire import is_projection

    limit = limit_bytes(weights, is_projection)
    print(f"\ndevice costs of one sync (NPU kernels: kernels/npu.py's mix on the emulated torch_npu, "
          f"each op one launch; limit = each projection read once in bf16 and written once in "
          f"int8 with its scales, every other tensor copied once = {limit / 2**20:.1f} MB):")
    print(f"{'variant':<36}{'launches':>10}{'read MB':>10}{'written MB':>11}{'traffic/limit':>14}"
          f"{'peak MB':>9}{'host syncs':>11}")
    for k, c in sorted(dcosts.items()):
        print(f"{k}) {LABELS[k]:<33}{c.launches:>10}{c.read_bytes / 2**20:>10.1f}"
              f"{c.written_bytes / 2**20:>11.1f}{c.traffic_bytes / limit:>14.2f}"
              f"{c.peak_extra_bytes / 2**20:>9.1f}{c.host_syncs:>11}")
    a = dcosts["b"].traffic_bytes / limit
    lo, hi = PEAK_LAYERS
    p = {k: peaks[hi][k] / peaks[lo][k] if peaks[lo][k] else float("inf") for k in "bc"}
    h = {k: syncs_per_layer(c, layers, streamed=True) for k, c in dcosts.items()}  # iter(weights)
    worst = max(h, key=h.get)
    print(f"device traffic in-place / limit = {a:.2f} (target <= 2.5: {verdict(a <= 2.5)})")
    print(f"peak extra {hi} layers / {lo} layer in-place = {p['b']:.2f} (target <= 1.05: "
          f"{verdict(p['b'] <= 1.05)}; {peaks[lo]['b'] / 2**20:.1f} -> {peaks[hi]['b'] / 2**20:.1f} MB); "
          f"flashrl-style = {p['c']:.2f} ({peaks[lo]['c'] / 2**20:.1f} -> {peaks[hi]['c'] / 2**20:.1f} MB)")
    print(f"host syncs per layer, max over receivers = {h[worst]:.1f} (target 0: "
          f"{verdict(h[worst] == 0)}; {H_ALLOWS}; "
          + ", ".join(f"{k}) {v:.1f}" for k, v in sorted(h.items())) + ")")
    return {"limit_bytes": limit, "traffic_over_limit": a, "peak_ratio": p,
            "peaks": {str(n): v for n, v in peaks.items()}, "host_syncs_per_layer": h,
            "host_syncs_rule": H_ALLOWS}


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--moe", action="store_true",
                    help="Qwen3-30B-A3B layer shapes (fused-MoE experts) instead of Qwen2.5-7B")
    ap.add_argument("--tiny", action="store_true",
                    help="a tiny model of the same architecture (hidden 256; with --moe 8 experts) "
                         "for a smoke run")
    ap.add_argument("--layers", type=int, default=None,
                    help="decoder layers (default: 4 of Qwen2.5-7B shape, 2 with --moe)")
    ap.add_argument("--repeats", type=int, default=2, help="best of N for each variant")
    ap.add_argument("--threads", type=int, default=None,
                    help="torch threads (default: torch's); with other load on the machine, 1 avoids "
                         "OpenMP oversubscription stalls that swamp the comparison")
    ap.add_argument("--fp32-vocab", type=int, default=32768,
                    help="vocab of the streamed fp32 sync (fp32 masters incl. embedding and lm_head); "
                         "Qwen2.5-7B has 152064 (~4.4 GB of fp32 embedding + lm_head); 0 skips it "
                         "(dense mode only)")
    ap.add_argument("--json", help="also write the results here")
    args = ap.parse_args(argv)
    check_positive(ap, args, "layers", "repeats", "threads", "fp32_vocab", allow_zero=("fp32_vocab",))
    check_json_output(ap, args)
    if args.moe and args.fp32_vocab != ap.get_default("fp32_vocab"):
        ap.error("--fp32-vocab applies to the dense mode only (the streamed fp32 sync), not --moe")
    print(load_line("start"), flush=True)
    if args.threads:
        torch.set_num_threads(args.threads)

    from npu_flashrl import patches
    from npu_flashrl.sim import cpu_vllm

    cpu_vllm.prepare_process()
    from npu_flashrl.adapters import vllm_ascend

    patches.apply_patches(list(vllm_ascend.PATCHES))
    if args.moe:
        import _reload_moe

        rc = _reload_moe.run(args)
    else:
        rc = run_dense(args, vllm_ascend, cpu_vllm)
    print(load_line("end"), flush=True)
    return rc


def run_dense(args, vllm_ascend, cpu_vllm):
    layers = args.layers or 4
    cfg = dict(QWEN25_7B, num_hidden_layers=layers, **(TINY_DENSE if args.tiny else {}))
    model_dir = tempfile.mkdtemp(prefix="npu_flashrl_bench_")
    try:
        return _run_dense(args, vllm_ascend, cpu_vllm, cfg, layers, model_dir)
    finally:
        shutil.rmtree(model_dir, ignore_errors=True)


def _run_dense(args, vllm_ascend, cpu_vllm, cfg, layers, model_dir):
    with open(os.path.join(model_dir, "config.json"), "w") as f:
        json.dump(cfg, f)
    weights = make_weights(cfg, layers)
    print(f"Qwen2.5-7B {'(tiny) ' if args.tiny else ''}shapes, {layers} decoder layers: {nbytes(weights) / 1e9:.2f} GB of bf16 "
          f"weights per sync; torch threads={torch.get_num_threads()}")
    layer_bf16 = 2 * cfg["hidden_size"] * 2 * cfg["intermediate_size"]  # gate_up, the largest fused layer

    results, costs, dcosts = {}, {}, {}
    with cpu_vllm.CpuVllm(model_dir, quantization=None, load_format="dummy") as v:
        results["a"] = timed(lambda: v.model.load_weights(iter(weights)), args.repeats)
        costs["a"] = counted(lambda: v.model.load_weights(iter(weights)))
    with cpu_vllm.CpuVllm(model_dir, quantization="ascend", load_format="dummy",
                          choice=cpu_vllm.int8()) as v:
        m = v.model
        m._bench_model_config = v.vllm_config.model_config

        def ours():
            m.load_weights(iter(weights))
            vllm_ascend.end_weight_sync(m)

        results["b"] = timed(ours, args.repeats)
        costs["b"] = counted(ours)
        state_b = {n: p.detach().clone() for n, p in m.named_parameters()}
        ptrs = {n: p.data_ptr() for n, p in m.named_parameters()}
        dcosts["b"] = device_counted(ours)
        results["c"] = timed(lambda: flashrl_style_reload(m, iter(weights)), args.repeats)
        costs["c"] = counted(lambda: flashrl_style_reload(m, iter(weights)))
        dcosts["c"] = device_counted(lambda: flashrl_style_reload(m, iter(weights)))
        same, kept = same_state(m, state_b, ptrs)
        if has_layerwise_reload():
            results["d"] = timed(lambda: vllm_layerwise_reload(m, weights), args.repeats)
            costs["d"] = counted(lambda: vllm_layerwise_reload(m, weights))
            dcosts["d"] = device_counted(lambda: vllm_layerwise_reload(m, weights))
            same_d, kept_d = same_state(m, state_b, ptrs)
    del m, v
    fp32 = streamed_fp32_sync(cfg, weights, args) if args.fp32_vocab else None

    peaks = {layers: {k: dcosts[k].peak_extra_bytes for k in "bc"}}
    for n in PEAK_LAYERS:
        if n not in peaks:
            peaks[n] = device_peaks(cfg, n, vllm_ascend, cpu_vllm)
    ratios = print_variants(results)
    count_ratios = print_costs(costs, nbytes(weights))
    device = print_device_costs(dcosts, weights, layers, peaks)
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
    tp = kernel_throughput((2 * cfg["intermediate_size"], cfg["hidden_size"]), args.repeats)
    print_throughput(tp, "gate_up-sized")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"seconds": {k: v[0] for k, v in results.items()},
                       "peak_extra_bytes": {k: v[1] for k, v in results.items()},
                       "ratios": ratios, "throughput_GBps": tp,
                       "counts": {k: dict(c.as_dict(), by_op=dict(c.by_op), bytes_by_op=dict(c.bytes_by_op))
                                  for k, c in costs.items()},
                       "count_ratios": count_ratios, "weight_bytes": nbytes(weights),
                       "device_counts": {k: dict(c.as_dict(), by_op=dict(c.by_op),
                                                 bytes_by_op=dict(c.bytes_by_op))
                                         for k, c in dcosts.items()},
                       "device": device, "layers": layers, "config": cfg,
                       "streamed_fp32_sync": fp32}, f, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
