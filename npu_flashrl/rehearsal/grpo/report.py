"""Output of `rehearse --grpo`: per-step means over seeds, the bounds of the checks, the table,
`grpo.png` and the printed summary."""
from __future__ import annotations

import math
import sys
from typing import Any, Dict, List, Optional

from npu_flashrl.rehearsal.grpo.settings import VARIANT_BF16, VARIANTS, GrpoSettings
from npu_flashrl.rehearsal.output import print_fault_and_checks
from npu_flashrl.rehearsal.plotting import pyplot, save_png

# The rise bf16 must show at least, whatever the noise estimate says (reward is a 0/1 rate).
MIN_RISE = 0.05
Z = 3.0  # bounds are Z standard errors: a run without the effect passes a check by chance < 0.2%


def _mean(xs: List[float]) -> float:
    return sum(xs) / len(xs) if xs else float("nan")


def _std(xs: List[float]) -> float:
    """Sample std (n - 1); 0 for one value."""
    if len(xs) < 2:
        return 0.0
    m = _mean(xs)
    return math.sqrt(sum((x - m) ** 2 for x in xs) / (len(xs) - 1))


def _binomial_se(p: float, n: int) -> float:
    """Standard error of a 0/1 rate p measured on n samples (p clamped into [0.05, 0.95] so that a
    run that happens to score 0 or 1 does not claim zero noise)."""
    p = min(max(p, 0.05), 0.95)
    return math.sqrt(p * (1 - p) / n)


def summarize(results: Dict[str, Dict[str, Any]], s: GrpoSettings) -> Dict[str, Any]:
    """Per variant: per-step means / stds over seeds, first and final rewards (means over the first /
    last `window` steps, per seed and over seeds); the bounds of the learning and tracking checks."""
    batch = s.prompts * s.group
    variants: Dict[str, Dict[str, Any]] = {}
    for name in [v for v in VARIANTS if v in results]:
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
        first_seed = [_mean([at[(sd, st)]["reward"] for st in steps[:s.window]]) for sd in seeds]
        final_seed = [_mean([at[(sd, st)]["reward"] for st in steps[-s.window:]]) for sd in seeds]
        tis_mean = per_step("tis_weights", "mean")
        variants[name] = {
            "reward": [_mean(v) for v in reward], "reward_std": [_std(v) for v in reward],
            "token_correct": [_mean(v) for v in per_step("token_correct")],
            "token_mult_prob_error": [_mean(v) for v in per_step("token_mult_prob_error")],
            "kl_k3": [_mean(v) for v in per_step("kl_k3")],
            "tis_weight_mean": [_mean(v) if v else None for v in tis_mean],
            "tis_clip_frac": [_mean(v) if v else None for v in per_step("tis_weights", "clip_frac")],
            "sync_s": [_mean(v) for v in per_step("sync_s")],
            "first_per_seed": first_seed, "final_per_seed": final_seed,
            "first": _mean(first_seed), "final": _mean(final_seed), "final_std": _std(final_seed),
            "mismatch_mean": _mean([r["token_mult_prob_error"] for r in rows]),
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
        for name, v in variants.items():
            if name == VARIANT_BF16:
                continue

            def spread(var):
                return max(var["final_std"], _binomial_se(var["final"], batch * s.window))
            kk = min(v["seeds"], base["seeds"])
            se = math.sqrt((spread(base) ** 2 + spread(v) ** 2) / kk)
            bounds[f"{name}_vs_bf16"] = {
                "bound": Z * se, "diff": v["final"] - base["final"], "se": se, "z": Z,
                "spread_bf16": spread(base), "spread": spread(v),
                "rule": (f"|final - bf16 final| <= {Z:g} x sqrt((s_bf16^2 + s^2) / K), s = the std over the K seeds "
                         f"of a variant's final reward, at least the binomial SE of one seed's final "
                         f"({s.window} steps x {batch} responses)")}
    return {"variants": variants, "bounds": bounds}


def format_table(summary: Dict[str, Any]) -> str:
    header = ("step", "variant", "reward", "+-std", "token_mult_prob_error", "tis_w_mean", "tis_clip", "sync_s")
    body = []
    variants = summary["variants"]
    steps = max((v["steps"] for v in variants.values()), default=0)
    for i in range(steps):
        for name, v in variants.items():
            tw, tc = v["tis_weight_mean"][i], v["tis_clip_frac"][i]
            body.append((str(i + 1), name, f"{v['reward'][i]:.3f}", f"{v['reward_std'][i]:.3f}",
                         f"{v['token_mult_prob_error'][i]:.5f}", "-" if tw is None else f"{tw:.4f}",
                         "-" if tc is None else f"{tc:.4f}", f"{v['sync_s'][i]:.3f}"))
    widths = [max(len(h), *(len(b[i]) for b in body)) if body else len(h) for i, h in enumerate(header)]
    lines = ["  ".join(h.ljust(w) if i == 1 else h.rjust(w) for i, (h, w) in enumerate(zip(header, widths)))]
    lines.append("  ".join("-" * w for w in widths))
    for b in body:
        lines.append("  ".join(c.ljust(w) if i == 1 else c.rjust(w) for i, (c, w) in enumerate(zip(b, widths))))
    return "\n".join(lines)


def write_plot(summary: Dict[str, Any], s: GrpoSettings, path: str) -> Optional[str]:
    """grpo.png: reward vs step per variant (mean over seeds, band +-1 std), mismatch vs step."""
    plt = pyplot()
    if plt is None:
        return None
    fig, axes = plt.subplots(1, 2, figsize=(11, 4))
    for name, v in summary["variants"].items():
        steps = list(range(1, len(v["reward"]) + 1))
        lo = [m - d for m, d in zip(v["reward"], v["reward_std"])]
        hi = [m + d for m, d in zip(v["reward"], v["reward_std"])]
        line, = axes[0].plot(steps, v["reward"], marker="o", label=name)
        axes[0].fill_between(steps, lo, hi, color=line.get_color(), alpha=0.15)
        axes[1].plot(steps, v["token_mult_prob_error"], marker="o", label=name)
    axes[0].set_title(f"GRPO reward (mean over {s.seeds} seeds, band +-1 std)")
    axes[0].set_ylabel("reward (batch mean)")
    axes[1].set_title("token_mult_prob_error, rollout vs trainer (1.0 = exact)")
    return save_png(plt, fig, axes, "GRPO step", path)


def print_summary(report: Dict[str, Any], summary: Dict[str, Any], checks, report_path: str) -> None:
    out = sys.stdout
    g = report["grpo"]
    st, tk = g["settings"], g["task"]
    dev = report["resolved"]
    tr = report.get("transport") or {}
    algo = next(iter(g["algorithm"].values()), {})
    print(f"npu-flashrl rehearse --grpo: tiny Qwen2; device {dev['device']}; fn {dev['fn']}; verl {algo.get('verl')}; "
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
    bounds = summary["bounds"]
    for name, v in summary["variants"].items():
        extra = ""
        b = bounds.get(f"{name}_vs_bf16")
        if b:
            extra = f"; vs bf16 {b['diff']:+.3f} (bound +-{b['bound']:.3f})"
        print(f"{name:>18}: reward first {v['first']:.3f} -> final {v['final']:.3f} +- {v['final_std']:.3f} "
              f"(per seed {', '.join(f'{x:.3f}' for x in v['final_per_seed'])}); token_mult_prob_error mean "
              f"{v['mismatch_mean']:.5f}{extra}", file=out)
    print("", file=out)
    print_fault_and_checks(report, checks, out)
    tm = report["timings"]
    proc = f"; process wall time {tm['process_s']:.1f}s" if tm.get("process_s") else ""
    print(f"time: total {tm['total_s']:.1f}s{proc} (model {tm['model_s']:.1f}s, setup {tm['setup_s']:.1f}s, "
          f"GRPO runs {tm['grpo_s']:.1f}s)", file=out)
    print(f"report: {report_path}" + (f"; plot: {report['plot']}" if report["plot"] else
                                      (f"; {report['plot_note']}" if report["plot_note"] else "")), file=out)
    print("rehearsal --grpo " + ("passed" if report["ok"] else "FAILED"), file=out)
