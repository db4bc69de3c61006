"""Output: the per-step table, the per-layer-type table, the plot and the printed summary."""
from __future__ import annotations

import sys
from typing import Any, Dict, List, Optional

from npu_flashrl.rehearsal.common import LAYER_ERROR_TOKENS, VARIANT_BF16, VARIANT_ORDER, VARIANT_W4A8
from npu_flashrl.rehearsal.plotting import pyplot, save_png
from npu_flashrl.rehearsal.state import by_type
from npu_flashrl.sim.faults import FAULT_ENV

TABLE_COLUMNS = ("step", "variant", "token_mult_prob_error", "kl_k1", "kl_k3", "prob_diff_max", "rollout_state",
                 "layer_err_max", "reload_s")


def format_table(rows: List[Dict[str, Any]]) -> str:
    """Per step and variant: the metric, the rollout's state check after that sync (INT8 or W4A8:
    `rollout_state`) and its worst layer error."""
    header = TABLE_COLUMNS
    body = []
    for r in sorted(rows, key=lambda r: (r["step"], VARIANT_ORDER.get(r["variant"], 9))):
        m = r["metrics"]
        st = r.get("rollout_state")
        state = "-" if st is None else ("exact" if st["ok"] else "FAIL:" + ",".join(st["failing"]))
        err = "-" if st is None else f"{st['output_rel_error_max']:.4f}"
        body.append((str(r["step"]), r["variant"], f"{m['token_mult_prob_error']:.5f}", f"{m['kl_k1']:+.2e}",
                     f"{m['kl_k3']:.2e}", f"{m['prob_diff_max']:.4f}", state, err, f"{r['reload_s']:.4f}"))
    widths = [max(len(h), *(len(b[i]) for b in body)) if body else len(h) for i, h in enumerate(header)]
    left = (1, 6)
    lines = ["  ".join(h.ljust(w) if i in left else h.rjust(w) for i, (h, w) in enumerate(zip(header, widths)))]
    lines.append("  ".join("-" * w for w in widths))
    for b in body:
        lines.append("  ".join(c.ljust(w) if i in left else c.rjust(w) for i, (c, w) in enumerate(zip(b, widths))))
    return "\n".join(lines)

def format_layer_table(layer_results: Dict[str, List[Dict[str, Any]]]) -> str:
    """Per quantized variant and layer type, over all syncs: int8 / int4 values off the reference, the worst scale
    difference and the output error against the bf16 counterpart (mean / max)."""
    values = "int8/int4" if any(r.get("variant") == VARIANT_W4A8 for rs in layer_results.values() for r in rs) \
        else "int8"
    header = ("variant", "layer type", "layers", "syncs", f"{values} values off", "scale rel diff",
              "out err mean", "out err max")
    body = []
    for variant in sorted(layer_results, key=lambda v: VARIANT_ORDER.get(v, 9)):
        for kind, t in by_type(layer_results[variant]).items():
            body.append((variant, kind, str(t["layers"]), str(t["syncs"]),
                         f"{t['int8_mismatches']}/{t['int8_elements']}", f"{t['scale_max_rel_diff']:.1e}",
                         f"{t['output_rel_error_mean']:.4f}", f"{t['output_rel_error_max']:.4f}"))
    widths = [max(len(h), *(len(b[i]) for b in body)) if body else len(h) for i, h in enumerate(header)]
    lines = ["  ".join(h.ljust(w) if i < 2 else h.rjust(w) for i, (h, w) in enumerate(zip(header, widths)))]
    lines.append("  ".join("-" * w for w in widths))
    for b in body:
        lines.append("  ".join(c.ljust(w) if i < 2 else c.rjust(w) for i, (c, w) in enumerate(zip(b, widths))))
    return "\n".join(lines)


def write_plot(rows, path: str) -> Optional[str]:
    """mismatch.png: token_mult_prob_error and KL (k3) per step and variant. None when matplotlib is missing."""
    plt = pyplot()
    if plt is None:
        return None
    fig, axes = plt.subplots(1, 2, figsize=(10, 4))
    for variant in sorted({r["variant"] for r in rows}, key=lambda v: VARIANT_ORDER.get(v, 9)):
        rs = sorted((r for r in rows if r["variant"] == variant), key=lambda r: r["step"])
        steps = [r["step"] for r in rs]
        axes[0].plot(steps, [r["metrics"]["token_mult_prob_error"] for r in rs], marker="o", label=variant)
        axes[1].plot(steps, [max(r["metrics"]["kl_k3"], 1e-12) for r in rs], marker="o", label=variant)
    axes[0].set_title("token_mult_prob_error (1.0 = exact)")
    axes[1].set_title("KL(rollout || trainer), k3")
    axes[1].set_yscale("log")
    return save_png(plt, fig, axes, "training step (weight sync)", path)


def print_fault_and_checks(report: Dict[str, Any], checks, out) -> None:
    """The injected fault (if any) and one [OK]/[FAIL] line per check: both rehearsals' summaries."""
    if report.get("fault_injected"):
        print(f"FAULT INJECTED (test seam {FAULT_ENV}): {report['fault_injected']}", file=out)
    for c in checks:
        print(f"[{'OK' if c['ok'] else 'FAIL'}] {c['check']}: {c['detail']}", file=out)


def print_summary(rows, summary, checks, applied_names, report, report_path, layer_results) -> None:
    out = sys.stdout
    model = report["model"]
    dev = report["device"]
    src = ("tiny Qwen2 " + ("(cached, not retrained)" if model.get("cache_hit") else
                            f"(pre-trained this run in {report['timings']['pretrain_s']:.1f}s)")
           if model["source"] == "tiny" else f"local model {model['dir']}")
    tr = report.get("transport") or {}
    per_sync = sorted({r["buckets"] for r in rows})
    buckets = "/".join(str(b) for b in per_sync) if per_sync else str(report["settings"]["buckets"])
    print(f"npu-flashrl rehearse: {src}; device {dev['device']} ({dev['note']}); fn {report['resolved']['fn']}; "
          f"{len({r['step'] for r in rows})} steps x {buckets} buckets; "
          f"{report['eval']['scored_tokens']} scored tokens", file=out)
    if tr:
        print(f"weight sync transport: {tr['name']} ({tr['reason']}): {tr['path']}", file=out)
    print("", file=out)
    print(format_table(rows), file=out)
    print("", file=out)
    if layer_results:
        moe = any(r.get("type") == "experts" for rs in layer_results.values() for r in rs)
        what = "INT8 / W4A8" if VARIANT_W4A8 in layer_results else "INT8"
        print(f"{what} state and per-layer output error ({LAYER_ERROR_TOKENS} random tokens per layer, "
              "vs the bf16 counterpart" + ("; experts: the MoE block on clearly-routed tokens vs an fp32 MoE"
                                           if moe else "") + "), all syncs:", file=out)
        print(format_layer_table(layer_results), file=out)
        print("", file=out)
    b = summary.get(VARIANT_BF16, {})
    for v, s in summary.items():
        ratio = ""
        if v != VARIANT_BF16 and b.get("reload_s_mean"):
            ratio = f" ({s['reload_s_mean'] / b['reload_s_mean']:.1f}x the bf16 reload)"
        print(f"{v:>14}: token_mult_prob_error mean {s['token_mult_prob_error_mean']:.5f} max "
              f"{s['token_mult_prob_error_max']:.5f}; reload mean {s['reload_s_mean'] * 1e3:.1f} ms{ratio}",
              file=out)
    print("", file=out)
    print(f"patches applied ({len(applied_names)}): {', '.join(applied_names) or '(none)'}", file=out)
    print_fault_and_checks(report, checks, out)
    tm = report["timings"]
    proc = f"; process wall time {tm['process_s']:.1f}s" if tm.get("process_s") else ""
    print(f"time: total {tm['total_s']:.1f}s{proc} (model {tm['model_s']:.1f}s, trainer {tm['trainer_s']:.1f}s, "
          f"setup {tm['setup_s']:.1f}s, rollout {tm['rollout_s']:.1f}s)", file=out)
    upd = report.get("step_weight_update_rel") or []
    if upd:
        print("relative weight change per step: " + ", ".join(f"{u:.2e}" for u in upd), file=out)
    print(f"report: {report_path}" + (f"; plot: {report['plot']}" if report["plot"] else
                                      (f"; {report['plot_note']}" if report["plot_note"] else "")), file=out)
    print("rehearsal " + ("passed" if report["ok"] else "FAILED"), file=out)
