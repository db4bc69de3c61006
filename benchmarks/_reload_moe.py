"""`benchmarks/reload.py --moe`: the weight-sync benchmark on Qwen3-30B-A3B layer shapes (hidden
2048, 128 experts, top-8, moe_intermediate_size 768, 32 heads, 4 KV heads, head_dim 128; a small
vocab and few layers), CPU with emulated torch_npu. Same variants as the dense mode:

  (a) bf16 vLLM `load_weights` into the unquantized model (the floor)
  (b) npu_flashrl's INT8 in-place reload (experts staged per layer through FusedMoE's own
      weight_loader, committed in place)
  (c) FlashRL 1.0.3's reload shape for the same model: FlashRL has no MoE-specific code; its
      patch re-allocates every `named_parameters()` entry in its creation shape (the fused
      experts' w13_weight [E, 2I, H] / w2_weight [E, H, I] and [E, n, 1] scales included), runs
      vLLM's loaders, re-runs `process_weights_after_loading` and copies back. Its own int8
      function quantizes profile names only (no expert entries), so the quantization here is
      npu_flashrl's kernel, as in the dense mode
  (d) vLLM's layerwise reload fed checkpoint-format int8 experts, where vLLM has it and it runs
      for the fused-MoE layers (otherwise the table says why)

The checkpoint (random bf16) is written shard by shard into a temporary directory and every
sync streams it back one tensor at a time, as a trainer's bucketed sync would, so the
benchmark never holds the weights twice. Then npu_flashrl's peak staging during (b) next to its
documented bound, one layer's experts in int8, and that bound for the real Qwen3-30B-A3B (48
layers) at TP=1/EP=1, and per rank at TP=2 and at EP=4.
"""
from __future__ import annotations

import contextlib
import json
import os
import shutil
import tempfile

import torch

from _reload_common import (flashrl_style_reload, has_layerwise_reload, kernel_throughput,
                            print_throughput, print_variants, same_state, timed,
                            vllm_layerwise_reload)

QWEN3_30B_A3B = dict(hidden_size=2048, intermediate_size=6144, moe_intermediate_size=768,
                     num_experts=128, num_experts_per_tok=8, num_attention_heads=32,
                     num_key_value_heads=4, head_dim=128, decoder_sparse_step=1, mlp_only_layers=[],
                     norm_topk_prob=True, vocab_size=1024, max_position_embeddings=4096,
                     rms_norm_eps=1e-6, rope_theta=1000000.0, tie_word_embeddings=False,
                     attention_bias=False, hidden_act="silu",
                     architectures=["Qwen3MoeForCausalLM"], model_type="qwen3_moe",
                     torch_dtype="bfloat16")
REAL_LAYERS = 48  # Qwen3-30B-A3B's num_hidden_layers
# --tiny: the same architecture small enough for a smoke run in seconds
TINY = dict(hidden_size=256, intermediate_size=512, moe_intermediate_size=96, num_experts=8,
            num_experts_per_tok=2, num_attention_heads=4, num_key_value_heads=2, head_dim=64)


# --------------------------------------------------------------------------- checkpoint

def layer_shapes(cfg):
    """HF tensor shapes of one decoder layer: (non-expert, per-expert)."""
    h, hd = cfg["hidden_size"], cfg["head_dim"]
    q, kv, i = cfg["num_attention_heads"] * hd, cfg["num_key_value_heads"] * hd, cfg["moe_intermediate_size"]
    attn = {"self_attn.q_proj.weight": (q, h), "self_attn.k_proj.weight": (kv, h),
            "self_attn.v_proj.weight": (kv, h), "self_attn.o_proj.weight": (h, q),
            "self_attn.q_norm.weight": (hd,), "self_attn.k_norm.weight": (hd,),
            "input_layernorm.weight": (h,), "post_attention_layernorm.weight": (h,),
            "mlp.gate.weight": (cfg["num_experts"], h)}
    expert = {"gate_proj.weight": (i, h), "up_proj.weight": (i, h), "down_proj.weight": (h, i)}
    return attn, expert


class Checkpoint:
    """Random bf16 weights in safetensors files of at most ~`shard_bytes` (a layer's attention,
    then its experts in chunks) plus the index; `stream()` yields them back one tensor at a time
    in file order (layer by layer, as a trainer sends them)."""

    def __init__(self, cfg, layers, shard_bytes=256 << 20, seed=0):
        self.dir = tempfile.mkdtemp(prefix="npu_flashrl_bench_moe_")
        self.files, self.nbytes, self.names = [], 0, []
        with open(os.path.join(self.dir, "config.json"), "w") as f:
            json.dump(dict(cfg, num_hidden_layers=layers), f)
        g = torch.Generator().manual_seed(seed)
        attn, expert = layer_shapes(cfg)
        h, vocab = cfg["hidden_size"], cfg["vocab_size"]
        per_expert = sum(a * b for a, b in expert.values()) * 2
        chunk = max(1, shard_bytes // per_expert)
        self._write({"model.embed_tokens.weight": (vocab, h)}, g)
        for layer in range(layers):
            p = f"model.layers.{layer}."
            self._write({p + n: s for n, s in attn.items()}, g)
            for e0 in range(0, cfg["num_experts"], chunk):
                self._write({f"{p}mlp.experts.{e}.{n}": s for e in range(e0, min(e0 + chunk, cfg["num_experts"]))
                             for n, s in expert.items()}, g)
        self._write({"model.norm.weight": (h,), "lm_head.weight": (vocab, h)}, g)
        with open(os.path.join(self.dir, "model.safetensors.index.json"), "w") as f:
            json.dump({"metadata": {"total_size": self.nbytes},
                       "weight_map": {n: os.path.basename(fn) for fn, ns in self.names for n in ns}}, f)

    def _write(self, shapes, g):
        from safetensors.torch import save_file

        tensors = {}
        for name, shape in shapes.items():
            t = torch.empty(shape, dtype=torch.bfloat16)
            if name.endswith("norm.weight"):
                t.fill_(1.0)
            else:
                t.normal_(0, 0.02, generator=g)
            tensors[name] = t
        path = os.path.join(self.dir, f"model-{len(self.files):05d}.safetensors")
        save_file(tensors, path)
        self.files.append(path)
        self.names.append((path, list(tensors)))
        self.nbytes += sum(t.numel() * t.element_size() for t in tensors.values())

    def stream(self):
        from safetensors import safe_open

        for path, names in self.names:
            with safe_open(path, framework="pt") as f:
                for name in names:
                    yield name, f.get_tensor(name)

    def remove(self):
        shutil.rmtree(self.dir, ignore_errors=True)


# --------------------------------------------------------------------------- staging

def expert_staging_bytes(cfg, tp=1, ep=1):
    """One layer's experts as npu_flashrl stages them on one rank: int8 w13 [E/ep, H, 2I/tp] and
    w2 [E/ep, I/tp, H] plus fp32 scales [E/ep, 2I/tp] and [E/ep, H] (ExpertStaging's buffers).
    With EP, vLLM's FusedMoE does not also split I (its moe tp size is 1)."""
    e, h, i = cfg["num_experts"] // ep, cfg["hidden_size"], cfg["moe_intermediate_size"] // tp
    return e * (h * 2 * i + i * h) + e * (2 * i + h) * 4


@contextlib.contextmanager
def sample_staging(loader):
    """Record `loader.staging_bytes()` after every expert shard staged (the last shard of a
    layer is sampled before its commit frees the buffer): the peak of a sync."""
    from npu_flashrl.adapters.vllm_ascend import experts

    seen = {"peak": 0, "layers": 0}
    original = experts.ExpertStaging.stage

    def stage(self, *args, **kwargs):
        out = original(self, *args, **kwargs)
        seen["peak"] = max(seen["peak"], loader.staging_bytes())
        seen["layers"] = max(seen["layers"], len(loader._pending))
        return out

    experts.ExpertStaging.stage = stage
    try:
        yield seen
    finally:
        experts.ExpertStaging.stage = original


def _mib(n):
    return f"{n / 2**20:.1f} MiB ({n} bytes)"


# --------------------------------------------------------------------------- run

def run(args):
    from npu_flashrl.adapters import vllm_ascend
    from npu_flashrl.sim import cpu_vllm

    layers = args.layers or 2
    cfg = dict(QWEN3_30B_A3B, **(TINY if args.tiny else {}))
    shape = "tiny Qwen3-MoE" if args.tiny else "Qwen3-30B-A3B"
    ckpt = Checkpoint(cfg, layers)
    try:
        return _run(args, cfg, layers, shape, ckpt, vllm_ascend, cpu_vllm)
    finally:
        ckpt.remove()


def _run(args, cfg, layers, shape, ckpt, vllm_ascend, cpu_vllm):
    _, expert = layer_shapes(cfg)
    experts_bf16 = cfg["num_experts"] * sum(a * b for a, b in expert.values()) * 2
    print(f"{shape} shapes, {layers} decoder layers ({cfg['num_experts']} experts, top-"
          f"{cfg['num_experts_per_tok']}, moe_intermediate_size {cfg['moe_intermediate_size']}): "
          f"{ckpt.nbytes / 1e9:.2f} GB of bf16 weights per sync ({experts_bf16 / 2**20:.0f} MiB of "
          f"experts per layer), streamed from a safetensors checkpoint; torch threads="
          f"{torch.get_num_threads()}")

    results, notes = {}, []
    try:
        with cpu_vllm.CpuVllm(ckpt.dir, quantization=None, load_format="dummy") as v:
            # what verl does for an unquantized MoE rollout every sync: its MoE weight-loader
            # patch (vllm-ascend's unquantized method re-created w13 / w2 without a loader),
            # vLLM's load_weights, then post-processing once (it re-transposes the experts)
            from npu_flashrl.adapters.verl.moe_names import moe_weight_loader_patch
            from npu_flashrl.sim.sync import post_sync

            patch = moe_weight_loader_patch()

            def bf16_sync():
                patch(v.model)
                v.model.load_weights(ckpt.stream())
                post_sync(v)

            results["a"] = timed(bf16_sync, args.repeats)
        del v
    except ImportError as exc:
        # vLLM 0.11's unquantized FusedMoE post-processing on a CPU platform builds
        # IPEXFusedMOE (intel_extension_for_pytorch), which this CPU stack does not have
        results["a"] = (f"the unquantized model does not build here: {type(exc).__name__}: "
                        f"{str(exc).splitlines()[0][:200]}")
    with cpu_vllm.CpuVllm(ckpt.dir, quantization="ascend", load_format="dummy",
                          choice=cpu_vllm.int8()) as v:
        m = v.model
        m._bench_model_config = v.vllm_config.model_config
        loader = m._npu_flashrl_loader
        if not loader.experts:
            raise RuntimeError(f"{type(m).__name__}: npu_flashrl found no W8A8_DYNAMIC fused-MoE "
                               "layers; the MoE benchmark has nothing to measure")

        def ours():
            m.load_weights(ckpt.stream())
            vllm_ascend.end_weight_sync(m)

        with sample_staging(loader) as staging:
            results["b"] = timed(ours, args.repeats)
        state_b = {n: p.detach().clone() for n, p in m.named_parameters()}
        ptrs = {n: p.data_ptr() for n, p in m.named_parameters()}
        results["c"] = timed(lambda: flashrl_style_reload(m, ckpt.stream()), args.repeats)
        same_c, kept_c = same_state(m, state_b, ptrs)
        if not has_layerwise_reload():
            results["d"] = "this vLLM has no layerwise reload (vllm.model_executor.model_loader.reload)"
        else:
            try:
                results["d"] = timed(lambda: vllm_layerwise_reload(m, ckpt.stream()), args.repeats)
                notes.append(same_state(m, state_b, ptrs))
            except Exception as exc:  # reported, not fatal: (d) is upstream's path, not ours
                results["d"] = f"{type(exc).__name__}: {str(exc).splitlines()[0][:300]}"
        del state_b
    del m, v, loader

    ratios = print_variants(results, width=40)
    target = expert_staging_bytes(cfg)
    print(f"peak extra memory: b = {results['b'][1] / 2**20:.0f} MB vs one layer's experts in int8 "
          f"(the staging bound) = {target / 2**20:.0f} MB; c = {results['c'][1] / 2**20:.0f} MB"
          + ("" if isinstance(results["d"], str) else f"; d = {results['d'][1] / 2**20:.0f} MB"))
    print(f"(b) and (c) give the same INT8 state: {same_c}; (c) keeps data pointers: {kept_c}")
    if isinstance(results["a"], str):
        print(f"(a) did not run: {results['a']}")
    if isinstance(results["d"], str):
        print(f"(d) did not run: {results['d']}")
    else:
        same_d, kept_d = notes[0]
        print(f"(d) gives (b)'s INT8 state: {same_d}; keeps data pointers: {kept_d}")

    print(f"\nnpu_flashrl staging during (b): peak {_mib(staging['peak'])}, at most "
          f"{staging['layers']} layer(s) staged at once; bound (one layer's experts in int8 + fp32 "
          f"scales) at this shape {_mib(target)}; within bound: {staging['peak'] <= target}")
    real = QWEN3_30B_A3B
    whole = REAL_LAYERS * expert_staging_bytes(real)
    print(f"Qwen3-30B-A3B ({REAL_LAYERS} layers), bound per rank:")
    for label, tp, ep in (("TP=1, EP=1", 1, 1), ("TP=2", 2, 1), ("EP=4", 1, 4)):
        one = expert_staging_bytes(real, tp, ep)
        print(f"  {label:<11}{_mib(one):>32}  (all {REAL_LAYERS} layers' experts: "
              f"{REAL_LAYERS * one / 2**30:.2f} GiB)")
    print(f"  (what (c) re-allocates per sync at TP=1: every layer's experts, {whole / 2**30:.2f} GiB "
          "of int8 plus scales, on top of the live model)")

    tp = kernel_throughput(expert["gate_proj.weight"], args.repeats)
    print_throughput(tp, "gate_proj-sized expert " + "x".join(map(str, expert["gate_proj.weight"])))
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"shape": shape, "layers": layers,
                       "seconds": {k: v[0] for k, v in results.items() if not isinstance(v, str)},
                       "peak_extra_bytes": {k: v[1] for k, v in results.items() if not isinstance(v, str)},
                       "not_run": {k: v for k, v in results.items() if isinstance(v, str)},
                       "ratios": ratios, "throughput_GBps": tp,
                       "same_int8_state_as_b": {"c": same_c, "d": notes[0][0] if notes else None},
                       "keeps_data_pointers": {"c": kept_c, "d": notes[0][1] if notes else None},
                       "staging": {"peak_bytes": staging["peak"], "bound_bytes": target,
                                   "qwen3_30b_a3b_bound_bytes": {
                                       "tp1_ep1": expert_staging_bytes(real),
                                       "tp2": expert_staging_bytes(real, 2, 1),
                                       "ep4": expert_staging_bytes(real, 1, 4)}}}, f, indent=1)
    return 0

