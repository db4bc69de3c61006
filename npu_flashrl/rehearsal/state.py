"""The INT8 state of the rollout model after every weight sync, checked against an independent
quantization of the weights that were pushed, and each quantized layer's output error.

The mismatch metric alone cannot judge an INT8 model: the RMSNorms absorb a uniform scale error,
so every weight scale at HALF its value still passed at token_mult_prob_error 1.047.
So after each sync, for every vllm-ascend W8A8 layer the INT8 loader targets:

* **int8 values**: the live weight read back (from the device, NZ cast to ND: `kernels.to_host_nd`)
  against `kernels.reference` applied on the CPU to the bf16 tensors that were pushed (per-channel:
  `quantize_weight_per_channel`; profile mode: `quantize_weight_with_scales` with the profile's
  scales), shard by shard of a fused layer. On the CPU the loader runs the same reference math, so
  the values must be EQUAL. On the NPU the loader uses `npu_dynamic_quant`, whose fp32 division
  (or reciprocal multiply) and rounding mode may differ from `torch.round` (half to even) near
  .5 ties of w / scale: there an element may be one step off. Allowed there: a difference of at
  most `INT8_ABS_TOL` (1, the tolerance Huawei's own op test of npu_dynamic_quant uses for its
  int8 output; `kernels.conformance`), on at most `NPU_MAX_TIE_FRACTION` of a layer's elements
  (npu_flashrl's bound: a device that rounds ties differently flips few elements, while a wrong
  scale, a transposed or stale shard or truncation instead of rounding changes far more).
* **scales**: `weight_scale` (held in the model dtype, bf16) within one ulp of that dtype of the
  reference scale (the NPU's fp32 scale may differ by an fp32 ulp before the cast); profile mode:
  unchanged since the cold load (a profile keeps the checkpoint's scales).
* **derived copies**: `weight_scale_fp32` equal to `weight_scale` in fp32, `weight_offset` zero;
  static W8A8: `deq_scale` = input_scale * weight_scale and `quant_bias` = round(bias / deq_scale)
  - input_offset * sum_k W_q, recomputed here from the live int8 weight.
* **in place**: the data pointer of every one of these tensors and the weight's storage format
  (NZ) unchanged since the cold load.
* **output error**: the layer's own forward (vllm-ascend's apply: npu_dynamic_quant +
  npu_quant_matmul, emulated on the CPU, the real kernels with --device npu) on fixed random
  activations, against the bf16 counterpart x @ W^T + b computed in fp32 from the pushed weights;
  relative Frobenius error. INT8 per-channel weights with per-token activations give about 1% here;
  a broken layer 10-100%.

Fused-MoE layers (W8A8_DYNAMIC experts, `loader.experts`): the same five categories per expert,
and the output error of the whole sparse MoE block, in `state_moe.py`.
"""
from __future__ import annotations

import dataclasses
from typing import Any, Dict, List, Optional

import torch

from npu_flashrl.kernels.conformance import INT8_ABS_TOL
from npu_flashrl.rehearsal.common import DEFAULT_MAX_LAYER_ERROR, LAYER_ERROR_TOKENS  # noqa: F401
from npu_flashrl.rehearsal.common import note_in_place

TIE_BAND = 1e-4  # |w/scale - (k + 0.5)| reported as a tie: ~13 fp32 ulps at |w/scale| = 127
NPU_MAX_TIE_FRACTION = 1e-3
_DERIVED = ("weight", "weight_scale", "weight_offset", "weight_scale_fp32", "deq_scale", "quant_bias",
            "input_scale", "input_offset")

CATEGORIES = ("int8", "scale", "derived", "in_place", "output")


@dataclasses.dataclass
class _Layer:
    path: str
    kind: str                 # qkv_proj, o_proj, gate_up_proj, down_proj
    layer: torch.nn.Module
    shards: List[str]         # HF weight names in fused order
    static: bool


def linear_layers(model, targets: Dict[str, Any]) -> List[_Layer]:
    """The loader's linear targets grouped by layer, each with its HF shard names in fused order."""
    packed = dict(getattr(model, "packed_modules_mapping", {}) or {})
    groups: Dict[str, List[str]] = {}
    layers: Dict[str, torch.nn.Module] = {}
    for hf_name, t in targets.items():
        groups.setdefault(t.path, []).append(hf_name)
        layers[t.path] = t.layer
    out: List[_Layer] = []
    for path, names in groups.items():
        prefix, short = path.rsplit(".", 1)
        fused = [f"{prefix}.{s}.weight" for s in packed.get(short, [short])]
        shards = fused if sorted(fused) == sorted(names) else sorted(names)
        layer = layers[path]
        static = hasattr(layer, "deq_scale") and hasattr(layer, "input_scale")
        out.append(_Layer(path, short, layer, shards, static))
    return out


def layer_output(layer, x: torch.Tensor) -> torch.Tensor:
    """The layer's own forward of `x` (moved to the layer's device), fp32 on the host."""
    y = layer(x.to(layer.weight.device))
    return (y[0] if isinstance(y, tuple) else y).float().cpu()


def pushed_bias(l: _Layer, weights, out_total: int) -> Optional[torch.Tensor]:
    """The layer's bias in fp32 [out]: the pushed one, else the layer's own; None without one."""
    names = [n[: -len("weight")] + "bias" for n in l.shards]
    if all(n in weights for n in names):
        return torch.cat([weights[n].float().cpu() for n in names])
    b = getattr(l.layer, "bias", None)
    if isinstance(b, torch.Tensor) and b.numel() == out_total:
        return _host(b).float()
    return None


def _tensors(layer) -> Dict[str, torch.Tensor]:
    out = {}
    for name in _DERIVED:
        t = getattr(layer, name, None)
        if isinstance(t, torch.Tensor):
            out[name] = t
    return out


def _host(t: torch.Tensor) -> torch.Tensor:
    from npu_flashrl import kernels

    return kernels.to_host_nd(t)


class Int8StateCheck:
    """Made right after the cold load (records pointers, formats, cold scales); `check(weights, step)`
    after each sync. `profile`: the FlashRL int8 profile (profile mode), None for per-channel."""

    def __init__(self, model, targets: Dict[str, Any], device: str, profile: Optional[Dict[str, dict]] = None,
                 seed: int = 0, experts: Optional[Dict[str, Any]] = None, moe_config: Optional[Dict[str, Any]] = None,
                 forward_context=None):
        """`experts`: the loader's fused-MoE targets (`loader.experts`); `moe_config`: the checkpoint's
        config.json (top-k, norm_topk_prob); `forward_context(num_tokens)`: vllm-ascend's forward
        context, which the MoE block's forward needs."""
        from npu_flashrl import kernels
        from npu_flashrl.rehearsal.state_moe import expert_checks

        self.device = device
        self.tie_tolerant = device == "npu"
        self.profile = profile
        self.layers: List[_Layer] = linear_layers(model, targets)
        self.cold_ptr = {l.path: {n: t.data_ptr() for n, t in _tensors(l.layer).items()} for l in self.layers}
        # Keep the cold-load tensors alive: a loader that re-allocates cannot have its new tensor land
        # on the freed address (the caching allocator reuses blocks) and so pass the pointer check.
        # Written in place, they share the live storage: no extra memory.
        self._cold_refs = {l.path: {n: t.data for n, t in _tensors(l.layer).items()} for l in self.layers}
        self.cold_format = {l.path: {"weight": kernels.storage_format(l.layer.weight)} for l in self.layers}
        self.cold_scale = {l.path: _host(l.layer.weight_scale).flatten().float() for l in self.layers}
        gen = torch.Generator().manual_seed(seed + 4242)
        self.acts = {}
        for l in self.layers:
            in_features = l.layer.weight.shape[0]  # processed [in, out]
            x = torch.randn(LAYER_ERROR_TOKENS, in_features, generator=gen)
            if l.static:  # inside the static activation range the layer was calibrated for
                x = x * float(_host(l.layer.input_scale).float().flatten()[0]) * 127 / 4
            self.acts[l.path] = x.to(torch.bfloat16)
        if experts and profile is not None:
            raise ValueError("a FlashRL int8 profile covers dense layers only; MoE experts are per-channel")
        self.experts = expert_checks(model, experts or {}, moe_config or {}, forward_context, seed)

    # ------------------------------------------------------------------ expected values
    def _expected(self, l: _Layer, name: str, w: torch.Tensor, rows: slice):
        """(int8 [out, in], scale [out] fp32, quotient [out, in] fp32, effective weight [out, in] fp32)."""
        from npu_flashrl.kernels import reference

        if self.profile is None:
            q, s = reference.quantize_weight_per_channel(w, torch.bfloat16)
            quot = w.to(torch.bfloat16).float() / s[:, None]
            return q, s, quot, w.to(torch.bfloat16).float()
        e = self.profile[name]
        wc = w.to(torch.bfloat16)
        q = reference.quantize_weight_with_scales(wc, e["output_scale"], e["input_scale"])
        quot = (wc * e["output_scale"]) * e["input_scale"]  # the kernel's fp32 order
        s = self.cold_scale[l.path][rows]
        return q, s, quot.float(), quot.float() * s[:, None]

    # ------------------------------------------------------------------ one sync
    @torch.no_grad()
    def check(self, weights: Dict[str, torch.Tensor], step: int) -> List[Dict[str, Any]]:
        out = [self._check_layer(l, weights, step) for l in self.layers]
        for e in self.experts:
            problems: Dict[str, Optional[str]] = {c: None for c in CATEGORIES}
            res = e.check(weights, step, problems, self.tie_tolerant, TIE_BAND, NPU_MAX_TIE_FRACTION)
            res["problems"] = problems
            out.append(res)
        return out

    def _check_layer(self, l: _Layer, weights: Dict[str, torch.Tensor], step: int) -> Dict[str, Any]:
        from npu_flashrl import kernels

        layer = l.layer
        problems: Dict[str, Optional[str]] = {c: None for c in CATEGORIES}
        res: Dict[str, Any] = {"step": step, "layer": l.path, "type": l.kind}
        live = _host(layer.weight)  # processed [in, out]
        pushed = [weights[n] for n in l.shards]
        out_total, in_features = sum(w.shape[0] for w in pushed), pushed[0].shape[1]
        q_live = live.t()
        scale_live = _host(layer.weight_scale).flatten().float()
        n_el = mism = off_tie = far = 0
        worst = 0
        bad_shards: List[str] = []
        scale_rel = 0.0
        w_eff: List[torch.Tensor] = []
        shape_ok = tuple(live.shape) == (in_features, out_total) and live.dtype == torch.int8 \
            and scale_live.numel() == out_total
        r0 = 0
        for name, w in zip(l.shards, pushed):
            rows = slice(r0, r0 + w.shape[0])
            r0 += w.shape[0]
            q_ref, s_ref, quot, eff = self._expected(l, name, w.cpu(), rows)
            w_eff.append(eff)
            if not shape_ok:
                continue
            d = q_live[rows].to(torch.int16) - q_ref.to(torch.int16)
            bad = d != 0
            n_bad = int(bad.sum())
            n_el += d.numel()
            if n_bad:
                tie = (quot - quot.floor() - 0.5).abs() <= TIE_BAND
                mism += n_bad
                off_tie += int((bad & ~tie).sum())
                far += int((d.abs() > INT8_ABS_TOL).sum())
                worst = max(worst, int(d.abs().max()))
                bad_shards.append(name.rsplit(".", 2)[-2])
            s_exp = s_ref.to(layer.weight_scale.dtype).float()
            rel = ((scale_live[rows] - s_exp).abs() / s_exp.abs().clamp_min(1e-30)).max()
            scale_rel = max(scale_rel, float(rel))
        res.update(int8_elements=n_el, int8_mismatches=mism, int8_mismatches_off_tie=off_tie,
                   int8_max_step_diff=worst, scale_max_rel_diff=scale_rel)
        if not shape_ok:
            problems["int8"] = (f"weight {tuple(live.shape)} {live.dtype}, scale {scale_live.numel()} values; "
                                f"expected int8 [in, out] = {(in_features, out_total)} (the processed layout)")
        elif mism:
            allowed = self.tie_tolerant and far == 0 and mism <= NPU_MAX_TIE_FRACTION * n_el
            if not allowed:
                problems["int8"] = (f"{mism}/{n_el} int8 values differ from the reference quantization "
                                    f"(max {worst} steps, {off_tie} not at a .5 tie; in {', '.join(bad_shards)})")
        ulp = torch.finfo(layer.weight_scale.dtype).eps
        if shape_ok and not scale_rel <= ulp:
            problems["scale"] = (f"weight_scale off by up to {scale_rel:.3g} relative (limit {ulp:.3g}, one "
                                 f"{str(layer.weight_scale.dtype).replace('torch.', '')} ulp)")
        problems["derived"] = self._derived(layer, l, live, scale_live)
        note_in_place(problems, res, layer, _tensors(layer), self.cold_ptr[l.path], self.cold_format[l.path])
        # output error: the layer's own forward against the bf16 counterpart
        x = self.acts[l.path]
        y = layer_output(layer, x)
        bias = self._bias(l, weights, out_total)
        y_ref = x.float() @ torch.cat(w_eff).t()
        if bias is not None:
            y_ref = y_ref + bias
        err = float((y - y_ref).norm() / y_ref.norm().clamp_min(1e-30))
        res["output_rel_error"] = err
        res["problems"] = problems
        return res

    def _bias(self, l: _Layer, weights, out_total: int) -> Optional[torch.Tensor]:
        return pushed_bias(l, weights, out_total)

    def _derived(self, layer, l: _Layer, live: torch.Tensor, scale_live: torch.Tensor) -> Optional[str]:
        from npu_flashrl.kernels import reference

        bad = []
        fp32 = getattr(layer, "weight_scale_fp32", None)
        if isinstance(fp32, torch.Tensor):
            f = _host(fp32).flatten()
            if f.dtype != torch.float32 or f.numel() != scale_live.numel() or not torch.equal(f, scale_live):
                n = int((f.float() != scale_live).sum()) if f.numel() == scale_live.numel() else f.numel()
                bad.append(f"weight_scale_fp32 differs from weight_scale in {n}/{scale_live.numel()} values")
        off = getattr(layer, "weight_offset", None)
        if isinstance(off, torch.Tensor) and bool((_host(off) != 0).any()):
            bad.append(f"weight_offset non-zero in {int((_host(off) != 0).sum())} values (symmetric int8)")
        if l.static:
            deq_live = reference.decode_deq_scale(_host(layer.deq_scale)).flatten()
            deq = (_host(layer.input_scale).float() * scale_live).flatten()
            rel = float(((deq_live - deq).abs() / deq.abs().clamp_min(1e-30)).max())
            if rel > 1e-6:
                bad.append(f"deq_scale off input_scale * weight_scale by {rel:.3g} relative")
            wsum = live.to(torch.int64).sum(dim=0)
            offset = int(_host(layer.input_offset).flatten()[0])
            b = getattr(layer, "bias", None)
            fb = torch.zeros_like(deq) if b is None else torch.round(_host(b).float() / deq)
            qb = (fb.to(torch.int64) - offset * wsum).to(torch.int32)
            qb_live = _host(layer.quant_bias).flatten()
            if not torch.equal(qb_live, qb):
                bad.append(f"quant_bias differs from round(bias / deq_scale) - input_offset * sum(W_q) in "
                           f"{int((qb_live != qb).sum())}/{qb.numel()} values")
        return "; ".join(bad) or None


# ---------------------------------------------------------------------- summaries

def summarize_step(results: List[Dict[str, Any]]) -> Dict[str, Any]:
    """One sync over all layers: the row's state column."""
    cats = dict.fromkeys(c for r in results for c in r["problems"])  # a scheme's check may add categories
    failing = {c: [r for r in results if r["problems"][c]] for c in cats}
    return {"layers": len(results),
            "ok": not any(failing.values()),
            "failing": {c: [r["layer"] for r in rs] for c, rs in failing.items() if rs},
            "int8_mismatches": sum(r["int8_mismatches"] for r in results),
            "int8_elements": sum(r["int8_elements"] for r in results),
            "scale_max_rel_diff": max((r["scale_max_rel_diff"] for r in results), default=0.0),
            "output_rel_error_max": max((r["output_rel_error"] for r in results), default=0.0)}


def by_type(results: List[Dict[str, Any]]) -> Dict[str, Dict[str, Any]]:
    """All syncs, grouped by layer type (qkv_proj, o_proj, ...)."""
    out: Dict[str, Dict[str, Any]] = {}
    for r in results:
        t = out.setdefault(r["type"], {"layers": set(), "syncs": set(), "int8_mismatches": 0, "int8_elements": 0,
                                       "scale_max_rel_diff": 0.0, "output_rel_error_max": 0.0,
                                       "output_rel_error_sum": 0.0, "n": 0})
        t["layers"].add(r["layer"])
        t["syncs"].add(r["step"])
        t["int8_mismatches"] += r["int8_mismatches"]
        t["int8_elements"] += r["int8_elements"]
        t["scale_max_rel_diff"] = max(t["scale_max_rel_diff"], r["scale_max_rel_diff"])
        t["output_rel_error_max"] = max(t["output_rel_error_max"], r["output_rel_error"])
        t["output_rel_error_sum"] += r["output_rel_error"]
        t["n"] += 1
    for t in out.values():
        t["layers"], t["syncs"] = len(t["layers"]), len(t["syncs"])
        t["output_rel_error_mean"] = t.pop("output_rel_error_sum") / t.pop("n")
    return out


def state_rules(device: str, max_layer_error: float) -> Dict[str, Any]:
    """The tolerances applied, for report.json."""
    return {"int8": ("equal to kernels.reference on the pushed weights" if device != "npu" else
                     f"equal, except one step at .5 ties (|w/scale - (k + 0.5)| <= {TIE_BAND:g}) on at most "
                     f"{NPU_MAX_TIE_FRACTION:g} of a layer's elements (npu_dynamic_quant's fp32 order / rounding)"),
            "scale": "within one ulp of weight_scale's dtype of the reference scale (profile mode: the cold-load "
                     "scale)",
            "derived": "weight_scale_fp32 == weight_scale in fp32; weight_offset == 0; static: deq_scale = "
                       "input_scale * weight_scale (1e-6 relative), quant_bias exact",
            "in_place": "data_ptr of weight, weight_scale, weight_offset, weight_scale_fp32 (and static "
                        "deq_scale, quant_bias, input_scale, input_offset) and the weight's storage format "
                        "unchanged since the cold load",
            "output": f"relative Frobenius error of the layer's forward on {LAYER_ERROR_TOKENS} random tokens vs "
                      f"x @ W^T + b in fp32 from the pushed bf16 weights <= {max_layer_error}",
            "experts": "fused-MoE layers (state_moe.py): per expert, int8 and scales of gate | up (w13) and down "
                       "(w2) as above; w13_weight_scale_fp32 == w13_weight_scale in fp32, offsets 0, fused_mc2 "
                       "scales decode to the scales; data_ptr of every expert tensor and the w13/w2 storage "
                       "format unchanged; output: the sparse MoE block (bf16 router + INT8 experts) on pool "
                       "tokens with a clear top-k (every expert reached) vs an fp32 MoE from the pushed weights "
                       f"<= {max_layer_error}"}
