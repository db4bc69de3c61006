"""Output of `rehearse --grpo`: per-step means over seeds, the bounds of the checks, the table,
`grpo.png` and the printed summary."""
from __future__ import annotations

import math
import sys
from typing import Any, Dict, List, Optional

from npu_flashrl.rehearsal.grpo import positive, stats
from npu_flashrl.rehearsal.grpo.settings import (ALL, EFFECT_LEARNERS, TIS_PAIRS, TRACKED_REAL, VARIANT_BF16,
                                                 GrpoSettings)
from npu_flashrl.rehearsal.output import print_fault_and_checks
from npu_flashrl.rehearsal.plotting import pyplot, save_png

# The rise bf16 must show at least, whatever the noise estimate says (reward is a 0/1 rate).
MIN_RISE = 0.05
Z = 3.0  # bounds are Z standard errors: a run without the effect passes a check by chance < 0.2%
BAND_LEVEL = 0.95  # the plot's and the table's per-step intervals


def _binomial_se(p: float, n: int) -> float:
    """Standard error of a 0/1 rate p measured on n samples (p clamped into [0.05, 0.95] so that a
    run that happens to score 0 or 1 does not claim zero noise)."""
    p = min(max(p, 0.05), 0.95)
    return math.sqrt(p * (1 - p) / n)


def _ci_half(xs: List[float], level: float = BAND_LEVEL) -> float:
    """Half-width of the t interval of the mean of xs (0 for one value)."""
    if len(xs) < 2:
        return 0.0
    return stats.t_quantile(1 - (1 - level) / 2, len(xs) - 1) * stats.std(xs) / math.sqrt(len(xs))


def summarize(results: Dict[str, Dict[str, Any]], s: GrpoSettings,
              heldout: Optional[Dict[str, Any]] = None) -> Dict[str, Any]:
    """Per variant: per-step means over seeds with their 95% intervals, first / final rewards (means
    over the first / last `window` steps), each seed's whole-curve mean and held-out score; the
    margin of the learning check; the paired comparisons with bf16 (`stats.paired`)."""
    batch = s.prompts * s.group
    variants: Dict[str, Dict[str, Any]] = {}
    for name in [n for n in ALL if n in results]:
        rows = results[name]["rows"]
        seeds = sorted({r["seed"] for r in rows})
        steps = sorted({r["step"] for r in rows})
        at = {(r["seed"], r["step"]): r for r in rows}

        def per_step(key, sub=None):
            out = []
            for st in steps:
                vals = []
                for sd in seeds:
                    v = at[(sd, st)][key]
                    if sub is not None:
                        v = None if v is None else v[sub]
                    if v is not None:
                        vals.append(float(v))
                out.append(vals)
            return out

        reward = per_step("reward")
        mean = stats.mean
        first_seed = [mean([at[(sd, st)]["reward"] for st in steps[:s.window]]) for sd in seeds]
        final_seed = [mean([at[(sd, st)]["reward"] for st in steps[-s.window:]]) for sd in seeds]
        curve_seed = [mean([at[(sd, st)]["reward"] for st in steps]) for sd in seeds]
        tis_mean = per_step("tis_weights", "mean")
        variants[name] = {
            "reward": [mean(v) for v in reward], "reward_std": [stats.std(v) for v in reward],
            "reward_ci95": [_ci_half(v) for v in reward],
            "token_correct": [mean(v) for v in per_step("token_correct")],
            "token_mult_prob_error": [mean(v) for v in per_step("token_mult_prob_error")],
            "kl_k3": [mean(v) for v in per_step("kl_k3")],
            "tis_weight_mean": [mean(v) if v else None for v in tis_mean],
            "tis_clip_frac": [mean(v) if v else None for v in per_step("tis_weights", "clip_frac")],
            "sync_s": [mean(v) for v in per_step("sync_s")],
            "first_per_seed": first_seed, "final_per_seed": final_seed, "curve_per_seed": curve_seed,
            "first": mean(first_seed), "final": mean(final_seed), "final_std": stats.std(final_seed),
            "curve": mean(curve_seed),
            "heldout_per_seed": list(results[name].get("heldout") or []),
            "heldout": mean(results[name].get("heldout") or []),
            "mismatch_mean": mean([r["token_mult_prob_error"] for r in rows]),
            "seeds": len(seeds), "steps": len(steps),
        }
    bounds: Dict[str, Any] = {}
    base = variants.get(VARIANT_BF16)
    if base is not None:
        k = base["seeds"]
        n_window = batch * s.window * k
        se = math.hypot(_binomial_se(base["first"], n_window), _binomial_se(base["final"], n_window))
        bounds["bf16_rise"] = {
            "margin": max(MIN_RISE, Z * se), "z": Z, "min_rise": MIN_RISE, "noise_se": se,
            "rule": (f"bf16 final - first >= max({MIN_RISE}, {Z:g} x SE), SE = the binomial standard error of "
                     f"the difference of two means of {s.window} steps x {batch} responses x {k} seeds (what an "
                     "unchanged policy would show)")}
    paired, held = _paired(variants, results, s), {}
    if heldout is not None:
        held = dict(heldout)
        if base is not None and base["heldout_per_seed"]:
            pre = [heldout["pretrained"]] * len(base["heldout_per_seed"])
            held["bf16_vs_pretrained"] = stats.paired(base["heldout_per_seed"], pre, paired_level(s, results))
    return {"variants": variants, "bounds": bounds, "paired": paired, "heldout": held,
            "tis_effect": _tis_effect(variants)}


def _tis_effect(variants) -> Dict[str, Any]:
    """Each quantized rollout with TIS against itself without (`settings.TIS_PAIRS`: int8+tis - int8,
    w4a8+tis - w4a8), paired by seed, 95% t intervals; reported beside each other, not a verdict."""
    out: Dict[str, Any] = {}
    for with_tis, without in TIS_PAIRS:
        a, b = variants.get(with_tis), variants.get(without)
        if a is None or b is None or (a["seeds"], a["steps"]) != (b["seeds"], b["steps"]):
            continue
        entry = {"mismatch_mean": {without: b["mismatch_mean"], with_tis: a["mismatch_mean"]}}
        for k, col in (("heldout", "heldout_per_seed"), ("curve", "curve_per_seed")):
            if a[col] and b[col]:
                entry[k] = stats.paired(a[col], b[col], BAND_LEVEL)
        out[f"{with_tis} - {without}"] = entry
    return out


def paired_level(s: GrpoSettings, results) -> float:
    """Per-comparison confidence: the family level split (Bonferroni) over the verdicts on real
    variants (one per tracked variant: its held-out score, the primary outcome), so that a run with
    nothing wrong fails one of them by chance with probability at most 1 - s.confidence."""
    family = max(1, sum(1 for n in TRACKED_REAL if n in results))
    return 1 - (1 - s.confidence) / family


def _paired(variants, results, s: GrpoSettings) -> Dict[str, Any]:
    """Each full-size variant against bf16, seed by seed: held-out score (primary), whole-curve mean
    reward (secondary), and per step the reward difference with its 95% interval (the plot's band).

    The detectable difference of the tracked variants is computed with the SE under an effect: the
    largest paired SE among this comparison's own and the effect learners' (`settings.EFFECT_LEARNERS`:
    the slow learner and the 0.75x-lr probe) on the same outcome; a tracked variant's own samples nearly
    coincide with bf16's, and a real effect pulls them apart."""
    base = variants.get(VARIANT_BF16)
    if base is None or base["seeds"] < 1:
        return {}
    level = paired_level(s, results)
    out: Dict[str, Any] = {}
    b_rows = {(r["seed"], r["step"]): r["reward"] for r in results[VARIANT_BF16]["rows"]}
    full = {n: v for n, v in variants.items()
            if n != VARIANT_BF16 and (v["seeds"], v["steps"]) == (base["seeds"], base["steps"])}
    keys = {"curve": "curve_per_seed", "heldout": "heldout_per_seed"}
    under_effect: Dict[str, List[Any]] = {k: [] for k in keys}
    for n in EFFECT_LEARNERS:
        if n in full:
            for k, col in keys.items():
                if full[n][col] and base[col]:
                    se = stats.paired(full[n][col], base[col], level)["se"]
                    if math.isfinite(se):
                        under_effect[k].append((n, se))

    def power_se(k):
        if not under_effect[k]:
            return None, "this comparison's own SE (no effect learner ran: the MDD holds only when nothing is wrong)"
        n, se = max(under_effect[k], key=lambda x: x[1])
        listed = ", ".join(f"{a} {b:.4f}" for a, b in under_effect[k])
        return se, f"the SE under an effect, the largest of the effect learners' ({listed})"

    for name, v in full.items():
        per_step, band = [], []
        rows = {(r["seed"], r["step"]): r["reward"] for r in results[name]["rows"]}
        for st in range(1, v["steps"] + 1):
            d = [rows[(sd, st)] - b_rows[(sd, st)] for sd in range(v["seeds"])]
            per_step.append(stats.mean(d))
            band.append(_ci_half(d))
        entry: Dict[str, Any] = {"per_step": per_step, "per_step_ci95": band}
        for k, col in keys.items():
            if not (v[col] and base[col]):
                continue
            se_p, source = power_se(k) if name in TRACKED_REAL else (None, "")
            entry[k] = stats.paired(v[col], base[col], level, se_p, source)
        out[name] = entry
    return out


def _full_size(summary) -> Dict[str, Dict[str, Any]]:
    v = summary["variants"]
    steps = max((x["steps"] for x in v.values()), default=0)
    return {n: x for n, x in v.items() if x["steps"] == steps}


def format_table(summary: Dict[str, Any]) -> str:
    header = ("step", "variant", "reward", "+-95%", "token_mult_prob_error", "tis_w_mean", "tis_clip", "sync_s")
    body = []
    variants = _full_size(summary)
    steps = max((v["steps"] for v in variants.values()), default=0)
    for i in range(steps):
        for name, v in variants.items():
            tw, tc = v["tis_weight_mean"][i], v["tis_clip_frac"][i]
            body.append((str(i + 1), name, f"{v['reward'][i]:.3f}", f"{v['reward_ci95'][i]:.3f}",
                         f"{v['token_mult_prob_error'][i]:.5f}", "-" if tw is None else f"{tw:.4f}",
                         "-" if tc is None else f"{tc:.4f}", f"{v['sync_s'][i]:.3f}"))
    widths = [max(len(h), *(len(b[i]) for b in body)) if body else len(h) for i, h in enumerate(header)]
    lines = ["  ".join(h.ljust(w) if i == 1 else h.rjust(w) for i, (h, w) in enumerate(zip(header, widths)))]
    lines.append("  ".join("-" * w for w in widths))
    for b in body:
        lines.append("  ".join(c.ljust(w) if i == 1 else c.rjust(w) for i, (c, w) in enumerate(zip(b, widths))))
    return "\n".join(lines)


def write_plot(summary: Dict[str, Any], s: GrpoSettings, path: str) -> Optional[str]:
    """grpo.png: reward per step (mean over seeds, 95% interval band), the paired difference from bf16
    per step (95% band), the rollout / trainer mismatch per step."""
    plt = pyplot()
    if plt is None:
        return None
    fig, axes = plt.subplots(1, 3, figsize=(16, 4.5))
    colors = {}
    for name, v in _full_size(summary).items():
        steps = list(range(1, len(v["reward"]) + 1))
        lo = [m - d for m, d in zip(v["reward"], v["reward_ci95"])]
        hi = [m + d for m, d in zip(v["reward"], v["reward_ci95"])]
        style = "--" if ALL[name].control else "-"
        line, = axes[0].plot(steps, v["reward"], style, marker="o", label=name)
        colors[name] = line.get_color()
        axes[0].fill_between(steps, lo, hi, color=line.get_color(), alpha=0.12)
        axes[2].plot(steps, v["token_mult_prob_error"], style, marker="o", label=name, color=line.get_color())
    for name, p in summary["paired"].items():
        steps = list(range(1, len(p["per_step"]) + 1))
        c = colors.get(name)
        axes[1].plot(steps, p["per_step"], "--" if ALL[name].control else "-", marker="o", label=name, color=c)
        axes[1].fill_between(steps, [m - d for m, d in zip(p["per_step"], p["per_step_ci95"])],
                             [m + d for m, d in zip(p["per_step"], p["per_step_ci95"])], color=c, alpha=0.12)
    axes[1].axhline(0.0, color="black", linewidth=0.8)
    axes[0].set_title(f"GRPO reward (mean over {s.seeds} seeds, 95% interval)")
    axes[0].set_ylabel("reward (batch mean)")
    axes[1].set_title("reward - bf16's, paired by seed (95% interval)")
    axes[2].set_title("token_mult_prob_error, rollout vs trainer (1.0 = exact)")
    return save_png(plt, fig, axes, "GRPO step", path)


def _verdict_line(name: str, p: Dict[str, Any]) -> str:
    parts = []
    for label, key in (("held-out", "heldout"), ("curve (secondary)", "curve")):
        c = p.get(key)
        if c is None:
            continue
        lo, hi = c["ci"]
        parts.append(f"{label} {c['diff']:+.4f} [{lo:+.4f}, {hi:+.4f}] "
                     f"{'DIFFERENT' if c['detected'] else 'same'} (detectable >= {c['mdd']:.4f})")
    return f"{name:>22} - bf16: " + "; ".join(parts)


def print_summary(report: Dict[str, Any], summary: Dict[str, Any], checks, report_path: str) -> None:
    out = sys.stdout
    g = report["grpo"]
    st, tk = g["settings"], g["task"]
    dev = report["resolved"]
    tr = report.get("transport") or {}
    algo = next(iter(g["algorithm"].values()), {})
    print(f"npu-flashrl rehearse --grpo: tiny {report['model'].get('arch', 'qwen2')}; device {dev['device']}; fn {dev['fn']}; verl {algo.get('verl')}; "
          f"{st['steps']} steps x {st['seeds']} seeds per variant; {st['prompts']} prompts x {st['group']} responses "
          f"of {tk['response_len']} tokens per step (prompt {tk['prompt_len']} tokens); lr {st['lr']:g}, "
          f"{st['mini_batches']} mini-batches", file=out)
    print(f"task: {tk['reward']}", file=out)
    if tr:
        print(f"weight sync transport: {tr['name']} ({tr['reason']}): {tr['path']}", file=out)
    print("verl functions: " + "; ".join(algo.get("functions", [])), file=out)
    print("", file=out)
    print(format_table(summary), file=out)
    print("", file=out)
    for name, v in summary["variants"].items():
        print(f"{name:>22}: reward first {v['first']:.3f} -> final {v['final']:.3f} (per seed "
              f"{', '.join(f'{x:.3f}' for x in v['final_per_seed'])}); curve mean {v['curve']:.4f}; held-out "
              f"{v['heldout']:.4f}; token_mult_prob_error mean {v['mismatch_mean']:.5f}", file=out)
    h = summary["heldout"]
    if h:
        print(f"held-out: {h['prompts']} prompts never trained on ({h['dropped_as_seen_or_repeated']} drawn ones "
              f"dropped as seen); pre-trained policy {h['pretrained']:.4f}; {h['score']}", file=out)
    print("", file=out)
    if summary["paired"]:
        lvl = next(iter(summary["paired"].values()))["curve"]["level"]
        print(f"paired differences from bf16 (per seed, {lvl:.2%} t intervals: the family's "
              f"{st['confidence']:.0%} split over its comparisons; detectable = the smallest true difference "
              f"found with {stats.POWER:.0%} power):", file=out)
        for name, p in summary["paired"].items():
            print(_verdict_line(name, p), file=out)
        print("", file=out)
    if summary.get("tis_effect"):
        print(f"TIS effect (paired by seed, {BAND_LEVEL:.0%} t intervals; reported, not a verdict):", file=out)
        for label, e in summary["tis_effect"].items():
            parts = [f"{k} {e[k]['diff']:+.4f} [{e[k]['ci'][0]:+.4f}, {e[k]['ci'][1]:+.4f}]"
                     for k in ("heldout", "curve") if k in e]
            mm = ", ".join(f"{n} {m:.5f}" for n, m in e["mismatch_mean"].items())
            print(f"{label:>22}: " + "; ".join(parts) + f" (token_mult_prob_error {mm})", file=out)
        print("", file=out)
    if g["controls"]:
        print("negative controls (each must fail its check):", file=out)
        for name, c in g["controls"].items():
            print(f"  {'[fails as it must]' if c['failed'] else '[PASSED - the check cannot see it]'} {name} "
                  f"({c['control']}) -> {c['must_fail']}: {c['detail']}", file=out)
        print("", file=out)
    tracked = [(n, summary["paired"][n]["heldout"]) for n in TRACKED_REAL
               if "delta" in summary["paired"].get(n, {}).get("heldout", {})]  # one seed: no power
    for n, p in tracked:
        print(f"power of {n}'s held-out verdict: detectable >= {p['mdd']:.4f} = {p['delta']:.3f} (noncentral t, "
              f"{p['seeds'] - 1} df, {stats.POWER:.0%} power at {p['level']:.2%}) x SE {p['power_se']:.4f}: "
              f"{p['power_se_source']} (its own SE {p['se']:.4f})", file=out)
    if tracked:
        print("", file=out)
    for line in positive.lines(g["positive_control"]):
        print(line, file=out)
    print("", file=out)
    print_fault_and_checks(report, checks, out)
    tm = report["timings"]
    proc = f"; process wall time {tm['process_s']:.1f}s" if tm.get("process_s") else ""
    print(f"time: total {tm['total_s']:.1f}s{proc}; CPU {tm['cpu_s']:.1f}s ({tm['own_cpu_s']:.1f}s this process + "
          f"{tm['children_cpu_s']:.1f}s in child processes) (model {tm['model_s']:.1f}s, setup {tm['setup_s']:.1f}s, GRPO runs {tm['grpo_s']:.1f}s)",
          file=out)
    print(f"report: {report_path}" + (f"; plot: {report['plot']}" if report["plot"] else
                                      (f"; {report['plot_note']}" if report["plot_note"] else "")), file=out)
    print("rehearsal --grpo " + ("passed" if report["ok"] else "FAILED"), file=out)
