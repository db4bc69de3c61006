"""The verdict of `rehearse --grpo` (exit code 1 when a check fails).

On the real variants:
* learning: bf16's reward starts neither near 0 nor near 1 and rises by at least the margin of
  `report.summarize`; bf16's trained policies beat the pre-trained one on the held-out prompts
  (paired interval above 0);
* tracking: each TIS variant trains like bf16: the paired difference of the held-out score (the
  primary outcome) is not detected (its confidence interval, level split over the tracked variants,
  contains 0); the minimum detectable difference is printed beside it, and the whole-curve difference
  as secondary (it scores the rollout's own samples);
* power: the 0.75x-lr probe is caught, or its held-out effect is within each tracked variant's
  printed detectable difference;
* TIS: in every step of a TIS variant verl's loss got `rollout_is_weights`, not all 1, changing the
  loss; the weights are min(pi_trainer / pi_rollout, 2) of the two models' own log-probs; the
  variants without TIS passed none;
* the rollout log-probs verl is handed are the rollout model's own (a replay of sampled rows);
* the INT8 rollout: its mismatch above bf16's, its layers INT8, the fp32 head fp32, and the default
  rehearsal's INT8 state checks (`rehearsal.checks.state_checks`) after every sync of every run.

Negative controls (`settings.CONTROLS`) get the same checks; the run passes only when each fails the
check it names (one line per control), whatever their other checks say.
"""
from __future__ import annotations

from typing import Any, Dict, List, Tuple

from npu_flashrl.rehearsal.common import finite
from npu_flashrl.rehearsal.grpo.settings import (ALL, CHECK_OWN_LOGP, CHECK_POWER, CHECK_TIS_IN_LOSS,
                                                 CHECK_TIS_RATIO, CHECK_TRACKS, TRACKED, TRACKED_REAL,
                                                 VARIANT_BF16, GrpoSettings)

PROBE = "probe:lr_x0.75"

START_RANGE = (0.05, 0.95)
LOSS_DIFF_MIN = 1e-7
# |w - min(exp(old - rollout), 2)|: float32 arithmetic in verl against float64 here
TIS_RATIO_TOL = 1e-5
# replayed vs handed rollout log-probs: the same model, the same forwards (a smaller batch)
OWN_LOGP_TOL = 1e-3


def _fmt_cmp(label: str, p: Dict[str, Any]) -> str:
    lo, hi = p["ci"]
    return (f"{label} {p['diff']:+.4f} [{lo:+.4f}, {hi:+.4f}] ({p['level']:.2%} CI, {p['seeds']} seeds; "
            f"smallest detectable {p['mdd']:.4f}, SE {p.get('power_se', p['se']):.4f}: "
            f"{p.get('power_se_source', 'own')})")


def _limit(max_layer_error, precision) -> float:
    """The per-layer output error limit of `precision`: a number (every precision's, as before) or a
    dict by precision name ("int8", "w4a8")."""
    return max_layer_error[precision.name] if isinstance(max_layer_error, dict) else max_layer_error


def _variant_checks(name: str, res: Dict[str, Any], summary, info, layer_results, device: str,
                    max_layer_error, variant=None) -> List[Dict[str, Any]]:
    from npu_flashrl.rehearsal.checks import STATE_CHECKS, W4A8_STATE_CHECKS, state_checks
    from npu_flashrl.rehearsal.precisions import INT8, of_info

    v = variant if variant is not None else ALL[name]
    out: List[Dict[str, Any]] = []

    def add(check, ok, detail):
        out.append({"check": f"{name}: {check}", "ok": bool(ok), "detail": detail, "subject": name})

    rs = res["rows"]
    keys = ("reward", "token_mult_prob_error", "kl_k3", "loss")
    bad = [(r["seed"], r["step"], k) for r in rs for k in keys if not finite(r[k])]
    add("finite rewards, mismatch and losses", not bad, "all finite" if not bad else f"non-finite: {bad[:5]}")

    own = [r["own_logp_max_diff"] for r in rs]
    add(CHECK_OWN_LOGP, max(own) <= OWN_LOGP_TOL,
        f"{rs[0]['own_logp_rows']} sampled rows per step replayed through the rollout model: max |replayed - "
        f"handed to verl| {max(own):.2e} over {len(rs)} steps (limit {OWN_LOGP_TOL:g})")

    if v.tis:
        missing = [(r["seed"], r["step"]) for r in rs if r["tis_weights"] is None]
        ones = [(r["seed"], r["step"]) for r in rs if r["tis_weights"] and r["tis_weights"]["frac_not_1"] <= 0]
        diffs = [abs(r["loss"] - r["loss_without_tis"]) for r in rs if "loss_without_tis" in r]
        differ = sum(d > LOSS_DIFF_MIN for d in diffs)
        w = [r["tis_weights"] for r in rs if r["tis_weights"]]
        add(CHECK_TIS_IN_LOSS, not missing and not ones and len(diffs) == len(rs) and differ > 0,
            f"{len(rs)} steps: weights passed in {len(rs) - len(missing)}, not all 1 in "
            f"{len(rs) - len(missing) - len(ones)} (tokens with w != 1: mean "
            f"{sum(x['frac_not_1'] for x in w) / max(1, len(w)):.3f}; w in "
            f"[{min((x['min'] for x in w), default=float('nan')):.3f}, "
            f"{max((x['max'] for x in w), default=float('nan')):.3f}]); loss with vs without the weights "
            f"differs in {differ}/{len(diffs)} steps (max |diff| {max(diffs, default=0.0):.2e})")
        errs = [r["tis_ratio_max_err"] for r in rs if r.get("tis_ratio_max_err") is not None]
        # the positive control's inverted TIS is wrong on purpose (ctl:tis_inverted shows this check failing)
        if variant is None or v.control != "tis_inverted":
            add(CHECK_TIS_RATIO, len(errs) == len(rs) and max(errs) <= TIS_RATIO_TOL,
                f"max |w - min(pi_trainer / pi_rollout, 2)| {max(errs, default=float('nan')):.2e} over "
                f"{len(errs)}/{len(rs)} steps (limit {TIS_RATIO_TOL:g}; from the trainer's and the rollout's own "
                "log-probs)")
    else:
        passed = [(r["seed"], r["step"]) for r in rs if r["tis_weights"] is not None]
        add("no TIS weights in the loss", not passed,
            "none passed" if not passed else f"weights passed at (seed, step) {passed[:5]}")

    p = summary["paired"].get(name)
    if name in TRACKED and p is not None and "heldout" in p:
        curve, held = p["curve"], p["heldout"]
        add(CHECK_TRACKS, not held["detected"],
            ("difference detected: " if held["detected"] else "no difference detected: ")
            + _fmt_cmp("held-out score", held) + "; secondary, not a verdict: "
            + _fmt_cmp("mean reward over the curve", curve))

    if not v.int8 or not info:  # info: the rollout model's (constructed results in tests have none)
        return out
    p = of_info(info) if info.get("fn") else INT8  # a rollout's precision, from its config fn
    kinds = "/".join(info.get("quant_types") or p.quant_types)
    add(f"rollout model is {p.name.upper()}", info.get("quantized_layers", 0) > 0
        and info.get("layer0_qkv_weight_dtype") == p.weight_dtype,
        f"{info.get('quantized_layers', 0)} vllm-ascend {kinds} layers, qkv weight "
        f"{info.get('layer0_qkv_weight_dtype')}, online quantizer {info.get('online_quantizer')}")
    var, base = summary["variants"].get(name), summary["variants"].get(VARIANT_BF16)
    if base is not None and var is not None:
        add("mismatch above bf16 (quantization in the path)", var["mismatch_mean"] > base["mismatch_mean"],
            f"token_mult_prob_error mean {var['mismatch_mean']:.5f} vs bf16 {base['mismatch_mean']:.5f}")
    finer = summary["variants"].get(p.above) if p.above else None
    if finer is not None and var is not None and not v.control:
        add(f"mismatch above {p.above}'s (coarser {p.values} values)", var["mismatch_mean"] > finer["mismatch_mean"],
            f"token_mult_prob_error mean {var['mismatch_mean']:.5f} vs {p.above} {finer['mismatch_mean']:.5f}")
    expected = res["seeds"] * (res["steps"] + 1)
    syncs = len({r["step"] for r in layer_results})
    add(f"{p.name.upper()} state checked after every sync", syncs == expected,
        f"{syncs} syncs checked, {expected} expected ({res['seeds']} runs x ({res['steps']} steps + the initial push))")
    if layer_results:
        limit = _limit(max_layer_error, p)
        titles = STATE_CHECKS if p.values == "int8" else {
            c: t.replace("--max-layer-error", "--max-w4a8-layer-error") for c, t in W4A8_STATE_CHECKS.items()}
        for c in state_checks(name, layer_results, device, limit, titles, p.values):
            out.append(dict(c, subject=name))
    if v.fp32_head:
        add("lm_head is fp32", info.get("lm_head_dtype") == "torch.float32",
            f"lm_head weight {info.get('lm_head_dtype')}")
    return out


def _learning_checks(summary, s: GrpoSettings) -> List[Dict[str, Any]]:
    out: List[Dict[str, Any]] = []

    def add(check, ok, detail):
        out.append({"check": check, "ok": bool(ok), "detail": detail, "subject": VARIANT_BF16})

    base = summary["variants"].get(VARIANT_BF16)
    if base is None:
        return out
    lo, hi = START_RANGE
    add("task starts neither solved nor hopeless (bf16 first reward)", lo <= base["first"] <= hi,
        f"{base['first']:.3f} over the first {s.window} steps (expected within [{lo}, {hi}])")
    b = summary["bounds"]["bf16_rise"]
    rise = base["final"] - base["first"]
    add("bf16 GRPO learns (final - first reward >= margin)", rise >= b["margin"],
        f"{base['first']:.3f} -> {base['final']:.3f}: {rise:+.3f} (margin {b['margin']:.3f}: {b['rule']})")
    h = summary["heldout"].get("bf16_vs_pretrained")
    if h is not None:
        add("bf16 trained policy beats the pre-trained one on held-out prompts", h["ci"][0] > 0,
            f"pre-trained {summary['heldout']['pretrained']:.4f}; " + _fmt_cmp("trained - pre-trained", h))
    return out


def _power_checks(summary) -> List[Dict[str, Any]]:
    """The power probe (int8+tis at 0.75x lr): caught by the run, or its held-out effect within the
    detectable difference printed for each tracked variant."""
    out: List[Dict[str, Any]] = []
    probe = summary["paired"].get(PROBE, {}).get("heldout")
    if probe is None:
        return out
    for name in TRACKED_REAL:
        p = summary["paired"].get(name, {}).get("heldout")
        if p is None:
            continue
        covered = abs(probe["diff"]) <= p["mdd"]
        ok = probe["detected"] or covered
        how = ("caught: " if probe["detected"] else ("not caught, within the printed detectable difference: "
                                                      if covered else "NOT caught and beyond the printed "
                                                      "detectable difference: "))
        out.append({"check": f"{name}: {CHECK_POWER}", "ok": bool(ok), "subject": name,
                    "detail": how + _fmt_cmp(f"{PROBE} - bf16 held-out", probe) + f"; {name}'s detectable "
                              f"difference {p['mdd']:.4f}"})
    return out


def positive_checks(results, infos, layer_results, device: str, max_layer_error) -> List[Dict[str, Any]]:
    """The positive control's runs get the same per-variant checks (own log-probs, TIS in the loss, the
    INT8 state after every sync); what they measure is reported, not checked (`positive.finding`)."""
    out: List[Dict[str, Any]] = []
    for name, res in results.items():
        v = res["variant"]
        out.extend(_variant_checks(name, res, {"paired": {}, "variants": {}}, infos.get(name, {}),
                                   layer_results.get(name) or [], device, max_layer_error, variant=v))
    return out


def evaluate(results, summary, infos, layer_results, s: GrpoSettings, device: str,
             max_layer_error) -> Tuple[List[Dict[str, Any]], Dict[str, Dict[str, Any]]]:
    """(the run's checks, each control's outcome). The run's checks are the real variants' checks plus
    one per control: "it failed the check it must fail". `max_layer_error`: one limit, or one per
    precision name ({"int8": ..., "w4a8": ...})."""
    checks = _learning_checks(summary, s) + _power_checks(summary)
    controls: Dict[str, Dict[str, Any]] = {}
    for name, res in results.items():
        own = _variant_checks(name, res, summary, infos.get(name, {}), layer_results.get(name) or [], device,
                              max_layer_error)
        v = ALL[name]
        if v.control is None:
            checks.extend(own)
            continue
        target = next((c for c in own if c["check"].startswith(name) and c["check"].endswith(v.fails)), None)
        failed = target is not None and not target["ok"]
        controls[name] = {"control": v.control, "must_fail": v.fails, "failed": failed,
                          "detail": target["detail"] if target else "the check did not run",
                          "also_failed": [c["check"] for c in own if not c["ok"] and c is not target],
                          "checks": own}
        checks.append({"check": f"negative control {name} fails '{v.fails}'", "ok": failed, "subject": name,
                       "detail": (target["detail"] if target else "the check did not run")})
    return checks, controls
