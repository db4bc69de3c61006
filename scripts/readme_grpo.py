#!/usr/bin/env python3
"""The README's `rehearse --grpo` figures, from a run's report.json: no figure typed by hand.

    python scripts/readme_grpo.py OUTPUT_DIR/report.json            # write docs/figures/grpo_readme.json + README block
    python scripts/readme_grpo.py --check                           # README block == the figures file's rendering
    python scripts/readme_grpo.py --print OUTPUT_DIR/report.json    # the block, to stdout (nothing written)

`extract(report)` takes the figures from report.json (the run's command, versions and CPU time, the
paired comparisons with bf16 and their power, the controls, the positive control when the run had
`--positive-control`); `render(figures)` writes the README block between `<!-- grpo:begin -->` and
`<!-- grpo:end -->`. The figures file (docs/figures/grpo_readme.json) keeps what the block was
rendered from, so a test holds the README to it (tests/rehearsal/test_rehearsal_grpo.py), and the same
test renders the report of its own `--quick` run through `extract` and `render`.
"""
from __future__ import annotations

import argparse
import json
import os
import re
import sys
from typing import Any, Dict, List

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
README = os.path.join(ROOT, "README.md")
FIGURES = os.path.join(ROOT, "docs", "figures", "grpo_readme.json")
BEGIN, END = "<!-- grpo:begin -->\n", "<!-- grpo:end -->"
MAIN = ("int8+tis", "int8+tis+fp32head", "int8")


def _cmp(p: Dict[str, Any]) -> Dict[str, Any]:
    keep = ("diff", "ci", "mdd", "se", "power_se", "power_se_source", "delta", "detected", "seeds", "level",
            "per_seed")
    return {k: p[k] for k in keep if k in p}


def command(report: Dict[str, Any]) -> str:
    a = report["settings"]
    parts = ["npu-flashrl rehearse --grpo"]
    if a.get("quick"):
        parts.append("--quick")
    for flag, key in (("--seeds", "seeds"), ("--steps", "steps")):
        if a.get(key) is not None:
            parts.append(f"{flag} {a[key]}")
    for flag, key in (("--no-controls", "no_controls"), ("--positive-control", "positive_control"),
                      ("--no-fp32-head", "no_fp32_head")):
        if a.get(key):
            parts.append(flag)
    return " ".join(parts)


def extract(report: Dict[str, Any]) -> Dict[str, Any]:
    """The README's figures, as the report has them (rounded only when rendered)."""
    g = report["grpo"]
    v, p = g["variants"], g["paired"]
    tis_rows = [r["tis_weights"] for r in g["rows"] if r["variant"] == "int8+tis" and r["tis_weights"]]
    tm = report["timings"]
    fig: Dict[str, Any] = {
        "command": command(report), "ok": report["ok"],
        "versions": {k: report["versions"].get(k) for k in ("vllm", "vllm-ascend", "verl", "torch")},
        "transport": (report.get("transport") or {}).get("name"),
        "size": {k: g["settings"][k] for k in ("seeds", "steps", "prompts", "group", "response_len")},
        "cpu_s": tm["cpu_s"], "own_cpu_s": tm["own_cpu_s"], "children_cpu_s": tm["children_cpu_s"],
        "bf16": {"first": v["bf16"]["first"], "final": v["bf16"]["final"], "heldout": v["bf16"]["heldout"]},
        "pretrained_heldout": g["heldout"]["pretrained"],
        "mismatch": {"bf16": v["bf16"]["mismatch_mean"], "int8": v["int8"]["mismatch_mean"]},
        "tis_weights": {"min": min(w["min"] for w in tis_rows), "max": max(w["max"] for w in tis_rows),
                        "clip_frac": max(w["clip_frac"] for w in tis_rows)} if tis_rows else None,
        "paired": {n: {k: _cmp(p[n][k]) for k in ("heldout", "curve") if k in p[n]}
                   for n in (*MAIN, "ctl:slow_learner", "probe:lr_x0.75") if n in p},
        "controls": {n: c["failed"] for n, c in g["controls"].items()},
        "positive_control": None,
    }
    pc = g["positive_control"]
    if pc.get("run"):
        fig["positive_control"] = {
            "quick": pc["quick"],
            "settings": {n: {"what": r["setting"]["what"], "seeds": r["seeds"], "steps": r["steps"],
                             "token_mult_prob_error": r["token_mult_prob_error"],
                             "heldout": {k: _cmp(c) for k, c in r["heldout"].items()},
                             "recovered_fraction": {k: r["recovered_fraction"][k]
                                                    for k in ("ratio", "ci", "bounded")},
                             "curve": {k: c["diff"] for k, c in r["curve"].items()},
                             "finding": r["finding"]["text"]}
                         for n, r in pc["settings"].items()}}
    return fig


def _ci(c: Dict[str, Any], nd: int = 3) -> str:
    lo, hi = c["ci"]
    return f"{c['diff']:+.{nd}f} [{lo:+.{nd}f}, {hi:+.{nd}f}]"


def render(fig: Dict[str, Any]) -> str:
    """The README block (markdown) of a figures dict."""
    sz, pa = fig["size"], fig["paired"]
    ver = fig["versions"]
    out: List[str] = []
    out.append(f"`{fig['command']}` ({sz['seeds']} seeds x {sz['steps']} steps per variant; vLLM {ver['vllm']}, "
               f"verl {ver['verl']}, transport {fig['transport']}; {fig['cpu_s']:.0f} s of CPU, "
               f"{fig['children_cpu_s']:.0f} s of it in child processes) "
               + ("passed" if fig["ok"] else "FAILED") + ":")
    out.append("")
    b = fig["bf16"]
    out.append(f"- bf16 reward {b['first']:.2f} -> {b['final']:.2f}; held-out score {fig['pretrained_heldout']:.2f} "
               f"(pre-trained) -> {b['heldout']:.2f}.")
    for n in ("int8+tis", "int8+tis+fp32head", "int8"):
        if n not in pa:
            continue
        h, c = pa[n].get("heldout"), pa[n].get("curve")
        text = f"- `{n}` - bf16, held-out {_ci(h)}"
        if n != "int8" and "power_se" in h:  # the tracked variants: MDD with the SE under an effect
            text += f" (smallest detectable {h['mdd']:.3f})"
        text += f"; whole curve (secondary) {_ci(c)}."
        out.append(text)
    h = pa.get("int8+tis", {}).get("heldout")
    if h and "power_se" in h:
        out.append(f"- Power of the held-out verdict: detectable = {h['delta']:.2f} (noncentral t, {h['seeds'] - 1} "
                   f"df, 80% power at {h['level']:.2%}) x SE {h['power_se']:.4f}, {h['power_se_source']}; "
                   f"`int8+tis`'s own SE {h['se']:.4f}.")
    for n, label in (("probe:lr_x0.75", "the power probe (`int8+tis` at 0.75x the learning rate)"),
                     ("ctl:slow_learner", "the slow learner (a quarter of the learning rate)")):
        if n in pa:
            h = pa[n]["heldout"]
            out.append(f"- {label[0].upper() + label[1:]}: held-out {_ci(h)}, "
                       + ("detected." if h["detected"] else "not detected."))
    ctl = fig["controls"]
    if ctl:
        failed = sum(1 for x in ctl.values() if x)
        out.append(f"- Negative controls: {failed} of {len(ctl)} fail their check as they must.")
    tw = fig["tis_weights"]
    mm = fig["mismatch"]
    out.append(f"- token_mult_prob_error {mm['bf16']:.4f} (bf16) / {mm['int8']:.4f} (INT8)"
               + (f"; TIS weights {tw['min']:.2f}-{tw['max']:.2f}, truncated fraction at most {tw['clip_frac']:.3f}."
                  if tw else "."))
    pc = fig["positive_control"]
    out.append("")
    if not pc:
        out.append("Positive control: not in this run (`--positive-control`).")
    else:
        out.append("Positive control (held-out score, 95% paired t intervals; the whole curve scores the rollout's "
                   "own samples, so it is shown as secondary):" + (" `--quick` size, nothing resolved."
                                                                 if pc["quick"] else ""))
        out.append("")
        for name, r in pc["settings"].items():
            h, rf = r["heldout"], r["recovered_fraction"]
            parts = [f"`int8` - bf16 {_ci(h['int8 - bf16'])}", f"`int8+tis` - `int8` {_ci(h['int8+tis - int8'])}"]
            if "int8+tis - int8+tis inverted" in h:
                parts.append(f"`int8+tis` - inverted TIS {_ci(h['int8+tis - int8+tis inverted'])}")
            rec = (f"recovered fraction {rf['ratio']:.2f} [{rf['ci'][0]:.2f}, {rf['ci'][1]:.2f}]" if rf["bounded"]
                   else f"recovered fraction {rf['ratio']:.2f}, interval unbounded")
            parts.append(rec)
            mm = r["token_mult_prob_error"]
            out.append(f"- **{name}** ({r['what']}; {r['seeds']} seeds x {r['steps']} steps; token_mult_prob_error "
                       f"{mm.get('int8', float('nan')):.3f}): " + "; ".join(parts)
                       + f"; whole curve `int8` - bf16 {r['curve']['int8 - bf16']:+.3f}. Shown: {r['finding']}.")
    return "\n".join(out) + "\n"


def block(text: str) -> str:
    m = re.search(re.escape(BEGIN) + r"(.*?)" + re.escape(END), text, re.S)
    if not m:
        raise SystemExit(f"{README}: no {BEGIN.strip()} ... {END} block")
    return m.group(1)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("report", nargs="?", help="report.json of a `npu-flashrl rehearse --grpo` run")
    ap.add_argument("--check", action="store_true", help="the README block equals the figures file's rendering")
    ap.add_argument("--print", dest="print_only", action="store_true", help="print the block, write nothing")
    ap.add_argument("--readme", default=README)
    ap.add_argument("--figures", default=FIGURES)
    a = ap.parse_args(argv)
    with open(a.readme) as f:
        text = f.read()
    if a.check:
        with open(a.figures) as f:
            want = render(json.load(f))
        if block(text) != want:
            print(f"{a.readme}: the GRPO block differs from {a.figures} rendered; run "
                  "scripts/readme_grpo.py REPORT.json", file=sys.stderr)
            return 1
        return 0
    if not a.report:
        ap.error("REPORT.json is needed unless --check")
    with open(a.report) as f:
        fig = extract(json.load(f))
    if a.print_only:
        print(render(fig), end="")
        return 0
    os.makedirs(os.path.dirname(a.figures), exist_ok=True)
    fig = json.loads(json.dumps(fig))  # rendered as the figures file will read back
    with open(a.figures, "w") as f:
        json.dump(fig, f, indent=1)
        f.write("\n")
    old = block(text)
    with open(a.readme, "w") as f:
        f.write(text.replace(BEGIN + old + END, BEGIN + render(fig) + END))
    return 0


if __name__ == "__main__":
    sys.exit(main())
