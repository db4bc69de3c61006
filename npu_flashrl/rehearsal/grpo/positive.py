"""The positive control of `rehearse --grpo --positive-control`: settings where the rollout / trainer
mismatch is large enough that `int8` without TIS measurably trains worse than bf16, run in the same
run, so that what the rehearsal says about TIS is what this run measured.

A setting (`SETTINGS`, one entry each) names the rollout model its quantized variants sample from
(a kind of `run._setup`'s builders: "int8", or "w4a8" with `--w4a8`: `W4A8_SETTINGS`, added by
`table_for`; `loop.RolloutHandle` checks each kind's state with its precision's check, from the
kind's config fn; an entry whose kind has no builder is refused before any run), how
its sampling departs from the trainer (`logit_scale`: the rollout samples from its logits x the scale,
`sampling.py`), the answer length, its seeds and steps, and the hypothesis it was put in the table
for. Each setting runs `<rollout>` (no TIS) and `<rollout>+tis` on that rollout ("int8" below; "w4a8"
for the W4A8 setting, its comparisons named so), and where TIS is expected to
help also `int8+tis` with the inverted ratio (`CONTROL_EFFECTS["tis_inverted"]`), so that correct TIS
is told from inverted TIS where it matters. `bf16` (on-policy: the bf16 rollout at temperature 1) runs
once per task size (answer length, steps) with the largest seed count of its settings; a setting
pairs its first seeds with it (prompts and sampling stream depend on (seed, step) only).

Reported per setting on the held-out score (the primary outcome: the whole-curve reward scores the
rollout's own samples, which a sharper rollout makes look better): `int8 - bf16`, `int8+tis - int8`,
`int8+tis - inverted`, each a paired t interval at `LEVEL` with per-seed values, and the recovered
fraction (int8+tis - int8) / (bf16 - int8) with Fieller's interval (`stats.fieller`). What the run
shows is stated from the intervals, not from the hypothesis.
"""
from __future__ import annotations

import dataclasses
from typing import Any, Dict, List, Optional, Tuple

from npu_flashrl.rehearsal.grpo import stats
from npu_flashrl.rehearsal.grpo.settings import CONTROL_EFFECTS, GrpoSettings, Variant

LEVEL = 0.95  # per comparison (each setting's few comparisons are read one by one, not as a family)
HYPOTHESES = {"tis_helps": "int8 without TIS degrades and TIS recovers part of the gap",
              "tis_hurts": "TIS makes int8 worse"}


@dataclasses.dataclass(frozen=True)
class Setting:
    name: str
    what: str
    hypothesis: str          # a key of HYPOTHESES: why the setting is in the table
    rollout: str = "int8"    # the rollout model of its quantized variants (a builder kind of run.py)
    logit_scale: float = 1.0
    response_len: int = 6
    seeds: int = 10
    steps: int = 6
    inverted: bool = False   # also run inverted TIS (correct and inverted TIS told apart)

    def to_dict(self) -> Dict[str, Any]:
        return dataclasses.asdict(self)


SETTINGS = (
    Setting("sharper_rollout",
            "the INT8 rollout samples at temperature 0.5 (its logits x2) against the trainer's 1, "
            "6-token answers", "tis_helps", logit_scale=2.0, seeds=10, inverted=True),
    Setting("flatter_rollout",
            "the INT8 rollout samples at temperature 2 (its logits x0.5) against the trainer's 1, "
            "3-token answers (at 6 a flatter rollout almost never samples the whole answer: no reward, no "
            "gradient)", "tis_hurts", logit_scale=0.5, response_len=3, seeds=5),
)
# `--w4a8 --positive-control`: the W4A8 rollout as it is (temperature 1): int4 in groups departs from
# the trainer more than INT8 does, the place where TIS has something to correct (issue 39)
W4A8_SETTINGS = (
    Setting("w4a8_rollout", "the W4A8 rollout (int4 weights in groups) samples at temperature 1 like the "
            "trainer, 6-token answers", "tis_helps", rollout="w4a8", seeds=10),
)
QUICK_SIZE = (2, 2)  # (seeds, steps) under --quick: the machinery only, nothing resolved


def table_for(s: GrpoSettings) -> Tuple[Setting, ...]:
    """The settings a run's positive control runs: `SETTINGS`, and with --w4a8 `W4A8_SETTINGS`."""
    return SETTINGS + (W4A8_SETTINGS if s.w4a8 else ())


def size(setting: Setting, s: GrpoSettings) -> Tuple[int, int]:
    return QUICK_SIZE if s.quick else (setting.seeds, setting.steps)


@dataclasses.dataclass
class Job:
    """One variant of the positive control: on which rollout kind, at which size, on which task."""
    variant: Variant
    setting: Optional[str]   # None: the bf16 reference of its task size
    task_key: Tuple[int, int]
    settings: GrpoSettings


def bf16_name(task_key: Tuple[int, int]) -> str:
    return f"pc:bf16 ({task_key[0]}-token answers, {task_key[1]} steps)"


def jobs(s: GrpoSettings, table=SETTINGS) -> List[Job]:
    """The runs of the positive control: per task size one bf16 reference, per setting its variants."""
    out: List[Job] = []
    seeds_of: Dict[Tuple[int, int], int] = {}
    for st in table:
        seeds, steps = size(st, s)
        key = (st.response_len, steps)
        seeds_of[key] = max(seeds_of.get(key, 0), seeds)
    for key, seeds in seeds_of.items():
        sized = dataclasses.replace(s, seeds=seeds, steps=key[1], response_len=key[0], window=max(1, key[1] // 2))
        out.append(Job(Variant(bf16_name(key), "bf16", tis=False), None, key, sized))
    for st in table:
        seeds, steps = size(st, s)
        key = (st.response_len, steps)
        sized = dataclasses.replace(s, seeds=seeds, steps=steps, response_len=st.response_len,
                                    window=max(1, steps // 2))
        q = st.rollout
        names = [(q, False, None), (f"{q}+tis", True, None)]
        if st.inverted:
            names.append((f"{q}+tis inverted", True, "tis_inverted"))
        for label, tis, control in names:
            out.append(Job(Variant(f"pc:{st.name}/{label}", st.rollout, tis=tis, control=control,
                                   logit_scale=st.logit_scale), st.name, key, sized))
    return out


def _heldout(results: Dict[str, Any], name: str, k: Optional[int] = None) -> List[float]:
    xs = list(results[name]["heldout"])
    return xs if k is None else xs[:k]


def _curve(results: Dict[str, Any], name: str, k: Optional[int] = None) -> List[float]:
    rows = results[name]["rows"]
    seeds = sorted({r["seed"] for r in rows})[:k]
    return [stats.mean([r["reward"] for r in rows if r["seed"] == sd]) for sd in seeds]


def _mismatch(results: Dict[str, Any], name: str) -> float:
    return stats.mean([r["token_mult_prob_error"] for r in results[name]["rows"]])


def summarize(results: Dict[str, Any], s: GrpoSettings, pretrained: Dict[Tuple[int, int], float],
              table=SETTINGS) -> Dict[str, Any]:
    """Per setting: the paired comparisons on the held-out score, the recovered fraction, the curve
    differences (secondary), the mismatch, and the finding stated from the intervals."""
    out: Dict[str, Any] = {}
    for st in table:
        seeds, steps = size(st, s)
        key = (st.response_len, steps)
        ref = bf16_name(key)
        r, rt, ri = st.rollout, f"{st.rollout}+tis", f"{st.rollout}+tis inverted"  # "int8", "int8+tis", ...
        names = {lbl: f"pc:{st.name}/{lbl}" for lbl in (r, rt, ri)}
        if not all(n in results for n in (ref, names[r], names[rt])):
            continue
        b, q, t = _heldout(results, ref, seeds), _heldout(results, names[r]), _heldout(results, names[rt])
        cmp = {f"{r} - bf16": stats.paired(q, b, LEVEL), f"{rt} - {r}": stats.paired(t, q, LEVEL),
               f"{rt} - bf16": stats.paired(t, b, LEVEL)}
        inv = names[ri] if st.inverted else None
        if inv in results:
            iv = _heldout(results, inv)
            cmp[f"{ri} - {r}"] = stats.paired(iv, q, LEVEL)
            cmp[f"{rt} - {ri}"] = stats.paired(t, iv, LEVEL)
        recovered = stats.fieller([a - c for a, c in zip(t, q)], [a - c for a, c in zip(b, q)], LEVEL)
        cb, cq, ct = _curve(results, ref, seeds), _curve(results, names[r]), _curve(results, names[rt])
        curve = {f"{r} - bf16": stats.paired(cq, cb, LEVEL), f"{rt} - {r}": stats.paired(ct, cq, LEVEL)}
        mism = {lbl: _mismatch(results, n) for lbl, n in names.items() if n in results}
        mism["bf16"] = _mismatch(results, ref)
        heldout = {"bf16": b, r: q, rt: t}
        if inv in results:
            heldout[ri] = _heldout(results, inv)
        out[st.name] = {"setting": st.to_dict(), "seeds": seeds, "steps": steps, "level": LEVEL,
                        "pretrained_heldout": pretrained.get(key), "heldout_per_seed": heldout,
                        "heldout": cmp, "recovered_fraction": recovered, "curve": curve,
                        "token_mult_prob_error": mism, "finding": finding(cmp, recovered, r),
                        "hypothesis": HYPOTHESES[st.hypothesis]}
    return out


def _sign(p: Dict[str, Any]) -> int:
    """+1 / -1 when the interval excludes 0 above / below, 0 when not resolved."""
    lo, hi = p["ci"]
    return 1 if lo > 0 else (-1 if hi < 0 else 0)


def finding(cmp: Dict[str, Any], recovered: Dict[str, Any], rollout: str = "int8") -> Dict[str, Any]:
    """What the intervals show, in words and as flags (`rollout`: the quantized rollout's name;
    the flag keeps its name `int8_degrades` whatever the rollout)."""
    r = rollout
    degrades, tis = _sign(cmp[f"{r} - bf16"]), _sign(cmp[f"{r}+tis - {r}"])
    told = cmp.get(f"{r}+tis - {r}+tis inverted")
    apart = None if told is None else _sign(told)
    words = [{-1: f"{r} without TIS trains worse than bf16", 1: f"{r} without TIS scores above bf16",
              0: f"{r} without TIS not resolved from bf16"}[degrades],
             {1: "TIS helps", -1: "TIS hurts", 0: "TIS's effect not resolved"}[tis]]
    if degrades == -1 and tis == 1 and recovered.get("bounded"):
        lo, hi = recovered["ci"]
        words.append(f"recovering {recovered['ratio']:.0%} of the gap [{lo:.0%}, {hi:.0%}]")
    if apart is not None:
        words.append({1: "correct TIS beats inverted TIS", -1: "inverted TIS beats correct TIS",
                      0: "correct and inverted TIS not told apart"}[apart])
    return {"int8_degrades": degrades == -1, "tis_helps": tis == 1, "tis_hurts": tis == -1,
            "inverted_told_apart": None if apart is None else apart == 1, "text": "; ".join(words)}


def _fmt(p: Dict[str, Any]) -> str:
    lo, hi = p["ci"]
    return (f"{p['diff']:+.4f} [{lo:+.4f}, {hi:+.4f}] (per seed "
            + ", ".join(f"{x:+.3f}" for x in p["per_seed"]) + ")")


def lines(pc: Dict[str, Any]) -> List[str]:
    """The printed summary of the positive control."""
    if not pc.get("run"):
        return [f"positive control: not run ({pc.get('note', '')})"]
    out = [f"positive control (held-out score, {LEVEL:.0%} paired t intervals per comparison; "
           "the settings of npu_flashrl/rehearsal/grpo/positive.py):"]
    for name, r in pc["settings"].items():
        st = r["setting"]
        mm = r["token_mult_prob_error"]
        out.append(f"  {name}: {st['what']}; {r['seeds']} seeds x {r['steps']} steps; token_mult_prob_error "
                   + ", ".join(f"{k} {v:.4f}" for k, v in mm.items()))
        for label, p in r["heldout"].items():
            out.append(f"    {label:>28}: {_fmt(p)}")
        rf = r["recovered_fraction"]
        ci = (f"[{rf['ci'][0]:+.2f}, {rf['ci'][1]:+.2f}]" if rf.get("bounded") else
              "interval unbounded (the gap bf16 - int8 not resolved)")
        out.append(f"    {'recovered fraction':>28}: {rf['ratio']:+.2f} {ci}")
        c = r["curve"]
        out.append(f"    {'(whole curve, secondary)':>28}: "
                   + ", ".join(f"{k} {p['diff']:+.4f}" for k, p in c.items()) + " (the rollout's own samples)")
        out.append(f"    shown: {r['finding']['text']} (put in the table for: {r['hypothesis']})")
    return out


def not_run(note: str) -> Dict[str, Any]:
    return {"run": False, "note": note, "settings": {}}


def describe_table(table=SETTINGS) -> List[Dict[str, Any]]:
    return [dict(st.to_dict(), inverted_what=CONTROL_EFFECTS["tis_inverted"] if st.inverted else None)
            for st in table]
