"""The verdict of `rehearse --grpo` (exit code 1 when a check fails).

* learning: the bf16 reference's reward starts neither near 0 nor near 1 and rises by at least the
  margin of `report.summarize` (3 binomial standard errors of an unchanged policy, >= 0.05);
* tracking: `int8+tis`'s final reward within the seed-spread bound of bf16's (`report.summarize`);
* TIS in the loss: in every step of a TIS variant verl's loss got `rollout_is_weights`, not all 1,
  and the loss with them differs from verl's loss on the same tensors without them; the variants
  without TIS passed none;
* the INT8 rollout: its mismatch above bf16's (quantization in the path), its layers INT8, the fp32
  head fp32, and the default rehearsal's INT8 state checks (`rehearsal.checks.state_checks`) over
  every sync of every INT8 run (each run's initial push included).
"""
from __future__ import annotations

from typing import Any, Dict, List

from npu_flashrl.rehearsal.common import finite
from npu_flashrl.rehearsal.grpo.settings import (VARIANT_BF16, VARIANT_INT8_TIS, VARIANT_INT8_TIS_FP32HEAD,
                                                 VARIANT_SPEC, GrpoSettings)

START_RANGE = (0.05, 0.95)
LOSS_DIFF_MIN = 1e-7


def evaluate(results, summary, infos, layer_results, s: GrpoSettings, device: str,
             max_layer_error: float) -> List[Dict[str, Any]]:
    from npu_flashrl.rehearsal.checks import state_checks

    checks: List[Dict[str, Any]] = []

    def add(name, ok, detail):
        checks.append({"check": name, "ok": bool(ok), "detail": detail})

    rows = [r for res in results.values() for r in res["rows"]]
    keys = ("reward", "token_mult_prob_error", "kl_k3", "loss")
    bad = [(r["variant"], r["seed"], r["step"], k) for r in rows for k in keys if not finite(r[k])]
    add("finite rewards, mismatch and losses", not bad, "all finite" if not bad else f"non-finite: {bad[:5]}")

    v = summary["variants"]
    base = v.get(VARIANT_BF16)
    if base is not None:
        lo, hi = START_RANGE
        add("task starts neither solved nor hopeless (bf16 first reward)", lo <= base["first"] <= hi,
            f"{base['first']:.3f} over the first {s.window} steps (expected within [{lo}, {hi}])")
        b = summary["bounds"]["bf16_rise"]
        rise = base["final"] - base["first"]
        add("bf16 GRPO learns (final - first reward >= margin)", rise >= b["margin"],
            f"{base['first']:.3f} -> {base['final']:.3f}: +{rise:.3f} (margin {b['margin']:.3f}: {b['rule']})"
            if rise >= 0 else f"{base['first']:.3f} -> {base['final']:.3f}: {rise:.3f} (margin {b['margin']:.3f})")
        tb = summary["bounds"].get(f"{VARIANT_INT8_TIS}_vs_bf16")
        if tb is not None:
            t = v[VARIANT_INT8_TIS]
            add("int8+tis final reward within the seed-spread bound of bf16", abs(tb["diff"]) <= tb["bound"],
                f"{t['final']:.3f} vs bf16 {base['final']:.3f}: {tb['diff']:+.3f} (bound +-{tb['bound']:.3f}: "
                f"{tb['rule']})")

    for name, res in results.items():
        _, tis, _ = VARIANT_SPEC[name]
        rs = res["rows"]
        if tis:
            missing = [(r["seed"], r["step"]) for r in rs if r["tis_weights"] is None]
            ones = [(r["seed"], r["step"]) for r in rs if r["tis_weights"] and r["tis_weights"]["frac_not_1"] <= 0]
            diffs = [abs(r["loss"] - r["loss_without_tis"]) for r in rs if "loss_without_tis" in r]
            differ = sum(d > LOSS_DIFF_MIN for d in diffs)
            ok = not missing and not ones and len(diffs) == len(rs) and differ > 0
            w = [r["tis_weights"] for r in rs if r["tis_weights"]]
            detail = (f"{len(rs)} steps: weights passed in {len(rs) - len(missing)}, not all 1 in "
                      f"{len(rs) - len(missing) - len(ones)} (tokens with w != 1: mean "
                      f"{sum(x['frac_not_1'] for x in w) / max(1, len(w)):.3f}; w in "
                      f"[{min((x['min'] for x in w), default=float('nan')):.3f}, "
                      f"{max((x['max'] for x in w), default=float('nan')):.3f}]); loss with vs without the weights "
                      f"differs in {differ}/{len(diffs)} steps (max |diff| {max(diffs, default=0.0):.2e})")
            add(f"{name}: TIS weights in the loss", ok, detail)
        else:
            passed = [(r["seed"], r["step"]) for r in rs if r["tis_weights"] is not None]
            add(f"{name}: no TIS weights in the loss", not passed,
                "none passed" if not passed else f"weights passed at (seed, step) {passed[:5]}")

    for name, info in infos.items():
        if VARIANT_SPEC[name][0] == "bf16":
            continue
        add(f"{name}: rollout model is INT8", info.get("quantized_layers", 0) > 0
            and info.get("layer0_qkv_weight_dtype") == "torch.int8",
            f"{info.get('quantized_layers', 0)} vllm-ascend W8A8 layers, qkv weight "
            f"{info.get('layer0_qkv_weight_dtype')}, online quantizer {info.get('online_quantizer')}")
        if base is not None and name in v:
            add(f"{name}: mismatch above bf16 (quantization in the path)",
                v[name]["mismatch_mean"] > base["mismatch_mean"],
                f"token_mult_prob_error mean {v[name]['mismatch_mean']:.5f} vs bf16 {base['mismatch_mean']:.5f}")
        results_ = layer_results.get(name) or []
        expected = s.seeds * (s.steps + 1)
        syncs = len({r["step"] for r in results_})
        add(f"{name}: INT8 state checked after every sync", syncs == expected,
            f"{syncs} syncs checked, {expected} expected ({s.seeds} runs x ({s.steps} steps + the initial push))")
        if results_:
            checks.extend(state_checks(name, results_, device, max_layer_error))
    fp = infos.get(VARIANT_INT8_TIS_FP32HEAD)
    if fp is not None:
        add(f"{VARIANT_INT8_TIS_FP32HEAD}: lm_head is fp32", fp.get("lm_head_dtype") == "torch.float32",
            f"lm_head weight {fp.get('lm_head_dtype')}")
    return checks
