"""The verdict: the mismatch metric, the INT8 state after every sync and each layer's output error.

Every failing check names the layer(s) and the number. Which fault each check catches (proven by
tests/rehearsal/test_rehearsal_checks.py, faults from `npu_flashrl.sim.faults`):

* int8 weights equal the reference quantization: one layer's int8 transposed, a shard left stale
  after a sync, truncation instead of rounding (off by one);
* weight scales match the reference: scale x0.5, scale x1.1 (and a stale shard's scale rows);
* derived copies consistent: weight_scale_fp32 left stale;
* written in place: a weight re-allocated instead of written into the cold-load storage;
* per-layer output error: scale x0.5, scale x1.1, a transposed layer (not the ~1-2% of a stale
  shard or of truncation: those only the exact state check sees);
* the metric (token_mult_prob_error): none of them reliably (scale x0.5 gave 1.047 < 1.05).

MoE (--model Qwen3-MoE, tests/rehearsal/test_rehearsal_moe.py): the same checks cover each fused-MoE layer's
experts (`state_moe.py`); one expert's down_proj scale x0.5 fails the scale check naming the
expert, a stale expert the int8 check. MLA (--arch deepseek_v3): every variant's absorbed
W_UK_T / W_UV against kv_b_proj after each sync (`state_mla.py`).
"""
from __future__ import annotations

from typing import Any, Dict, List

from npu_flashrl.kernels.conformance import INT8_ABS_TOL
from npu_flashrl.rehearsal.common import VARIANT_BF16, VARIANT_INT8_FP32HEAD, VARIANT_ORDER, finite
from npu_flashrl.rehearsal.precisions import of_info
from npu_flashrl.rehearsal.state import NPU_MAX_TIE_FRACTION, by_type

STATE_CHECKS = {  # category (state.CATEGORIES) -> check name after the variant
    "int8": "state: int8 values equal the reference quantization",
    "scale": "state: weight scales match the reference",
    "derived": "state: derived copies consistent (weight_scale_fp32, weight_offset, static deq_scale/quant_bias)",
    "in_place": "state: written in place (data pointers unchanged since the cold load)",
    "output": "per-layer output error <= --max-layer-error",
}


W4A8_STATE_CHECKS = {  # the same categories for a W4A8_DYNAMIC variant (state_w4a8.py)
    "int8": "state: packed int4 weight equals a fresh W4A8 load",
    "scale": "state: weight_scale and weight_scale_second equal a fresh W4A8 load",
    "derived": "state: derived tensors consistent (weight_scale_bias, zero offsets)",
    "in_place": "state: written in place (data pointers unchanged since the cold load)",
    "output": "per-layer output error <= --max-layer-error",
    "forward": "each layer computes the W4A8 forward of its weights (bias included)",
}


def summaries(rows) -> Dict[str, Dict[str, float]]:
    out: Dict[str, Dict[str, float]] = {}
    for variant in sorted({r["variant"] for r in rows}, key=lambda v: VARIANT_ORDER.get(v, 9)):
        rs = [r for r in rows if r["variant"] == variant]
        tm = [r["metrics"]["token_mult_prob_error"] for r in rs]
        out[variant] = {
            "token_mult_prob_error_mean": sum(tm) / len(tm),
            "token_mult_prob_error_max": max(tm),
            "kl_k3_mean": sum(r["metrics"]["kl_k3"] for r in rs) / len(rs),
            "reload_s_mean": sum(r["reload_s"] for r in rs) / len(rs),
        }
    return out


def _first(failures: List[str], limit: int = 3) -> str:
    more = f"; (+{len(failures) - limit} more)" if len(failures) > limit else ""
    return "; ".join(failures[:limit]) + more


def state_checks(variant: str, results: List[Dict[str, Any]], device: str, max_layer_error: float,
                 titles: Dict[str, str] = STATE_CHECKS, values: str = "int8") -> List[Dict[str, Any]]:
    """The five state checks of one variant over all its syncs (`titles`, `values`: its precision's)."""
    out = []
    layers = len({r["layer"] for r in results})
    syncs = len({r["step"] for r in results})
    scope = f"{layers} layers x {syncs} syncs"
    for cat, title in titles.items():
        if cat == "output":
            bad = [r for r in results if not r["output_rel_error"] <= max_layer_error]
            for r in bad:
                ref = "the fp32 MoE from the pushed weights" if r.get("type") == "experts" else "the bf16 counterpart"
                note = f" ({r['output_note']})" if r.get("output_note") else ""
                r["problems"]["output"] = (f"output error {r['output_rel_error']:.4f} > {max_layer_error} "
                                           f"vs {ref}{note}")
        else:
            bad = [r for r in results if r["problems"][cat]]
        fails = [f"step {r['step']} {r['layer']}: {r['problems'][cat]}" for r in bad]
        if bad:
            detail = _first(fails)
        elif cat == "int8" and values != "int8":
            n = sum(r["int8_elements"] for r in results)
            detail = f"{scope}: 0/{n} {values} values differ from a fresh load (none allowed)"
        elif cat == "int8":
            n = sum(r["int8_elements"] for r in results)
            m = sum(r["int8_mismatches"] for r in results)
            # the NPU tolerance is Huawei's own for int8 op results (|difference| <= 1 in the
            # npu_dynamic_quant op test; kernels.conformance.INT8_ABS_TOL), the same as
            # `npu-flashrl verify --kernels`; the fraction bound is npu_flashrl's (rehearsal/state.py)
            rule = ("none allowed on the CPU reference" if device != "npu" else
                    f"NPU: |difference| <= {INT8_ABS_TOL} (Huawei's int8 op-test tolerance), "
                    f"<= {NPU_MAX_TIE_FRACTION:g} of a layer")
            detail = f"{scope}: {m}/{n} int8 values differ ({rule})"
        elif cat == "forward":
            detail = f"{scope}: max {max(r['forward_rel_error'] for r in results):.4f} from x @ dequantized(W)^T + b"
        elif cat == "scale":
            detail = f"{scope}: max relative difference {max(r['scale_max_rel_diff'] for r in results):.3g}"
        elif cat == "output":
            types = by_type(results)
            detail = (f"{scope}: max {max(r['output_rel_error'] for r in results):.4f} (limit {max_layer_error}); "
                      + ", ".join(f"{t} {v['output_rel_error_max']:.4f}" for t, v in types.items()))
        else:
            detail = f"{scope}: consistent" if cat == "derived" else f"{scope}: unchanged"
        out.append({"check": f"{variant} {title}", "ok": not bad, "detail": detail, "category": cat,
                    "failing_layers": sorted({r["layer"] for r in bad})})
    return out


def evaluate_checks(rows, infos, args, layer_results=None, device: str = "cpu") -> List[Dict[str, Any]]:
    checks = []
    layer_results = layer_results or {}

    def add(name, ok, detail):
        checks.append({"check": name, "ok": bool(ok), "detail": detail})

    bad = [(r["step"], r["variant"], k) for r in rows for k, v in r["metrics"].items() if not finite(v)]
    add("finite metrics", not bad, "all finite" if not bad else f"non-finite: {bad[:5]}")
    summ = summaries(rows)
    base = summ.get(VARIANT_BF16)
    if base is not None:
        limit = 1.0 + args.baseline_tol
        add("bf16 baseline ~ 1.0", base["token_mult_prob_error_max"] <= limit,
            f"max token_mult_prob_error {base['token_mult_prob_error_max']:.5f} (limit {limit:.4f})")
    for variant in sorted(infos, key=lambda v: VARIANT_ORDER.get(v, 9)):
        p, s, info = of_info(infos[variant]), summ.get(variant), infos[variant]
        if p is None or s is None:
            continue
        flag, limit = "--" + p.max_error.replace("_", "-"), getattr(args, p.max_error)
        add(f"{variant} error <= {flag}", s["token_mult_prob_error_max"] <= limit,
            f"max token_mult_prob_error {s['token_mult_prob_error_max']:.5f} (limit {limit})")
        if base is not None:
            add(f"{variant} above baseline (quantization in the path)",
                s["token_mult_prob_error_mean"] > base["token_mult_prob_error_mean"],
                f"mean {s['token_mult_prob_error_mean']:.5f} vs bf16 {base['token_mult_prob_error_mean']:.5f}")
        finer = summ.get(p.above) if p.above else None
        if finer is not None:
            add(f"{variant} above {p.above} (coarser {p.values} values)",
                s["token_mult_prob_error_mean"] > finer["token_mult_prob_error_mean"],
                f"mean {s['token_mult_prob_error_mean']:.5f} vs {p.above} {finer['token_mult_prob_error_mean']:.5f}")
        moe_ok = not info.get("moe") or (info.get("expert_layers", 0) > 0
                                          and info.get("layer0_w13_weight_dtype") == p.weight_dtype)
        kinds = "/".join(info.get("quant_types") or p.quant_types)
        add(f"{variant} rollout model is {p.name.upper()}", info.get("quantized_layers", 0) > 0
            and info.get("layer0_qkv_weight_dtype") == p.weight_dtype and moe_ok
            and set(info.get("quant_types") or ()) <= set(p.quant_types),
            f"{info.get('quantized_layers', 0)} vllm-ascend {kinds} layers, qkv weight "
            f"{info.get('layer0_qkv_weight_dtype')}, online quantizer {info.get('online_quantizer')}"
            + (f"; {info.get('expert_layers', 0)} {p.quant_types[0]} fused-MoE layers, w13 "
               f"{info.get('layer0_w13_weight_dtype')}" if info.get("moe") else ""))
        results = layer_results.get(variant) or []
        if not results:
            add(f"{variant} {p.name.upper()} state checked after every sync", False, "no quantized layer was checked")
        else:
            titles = STATE_CHECKS if p.values == "int8" else W4A8_STATE_CHECKS
            layer_flag = "--" + p.max_layer_error.replace("_", "-")
            titles = {c: t.replace("--max-layer-error", layer_flag) for c, t in titles.items()}
            checks.extend(state_checks(variant, results, device, getattr(args, p.max_layer_error), titles,
                                       p.values))
    for variant, info in infos.items():  # MLA models (state_mla.py), every variant
        if "mla" in info:
            steps = info["mla"]
            bad = [f"sync {s['step']}: {p}" for s in steps for p in s["problems"]]
            layers = steps[0]["layers"] if steps else 0
            add(f"{variant} MLA W_UK_T / W_UV re-derived from kv_b_proj in place", steps and not bad,
                f"{layers} MLA layers x {len(steps)} syncs: " + ("derived, unmoved" if steps and not bad else
                                                                 _first(bad) or "not checked"))
    fp = infos.get(VARIANT_INT8_FP32HEAD)
    if fp is not None:
        add("int8+fp32head lm_head is fp32", fp.get("lm_head_dtype") == "torch.float32",
            f"lm_head weight {fp.get('lm_head_dtype')}"
            + (" (tied with the input embedding: one fp32 weight for both)" if fp.get("lm_head_tied") else ""))
    return checks
