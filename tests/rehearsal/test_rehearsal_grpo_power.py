"""`rehearse --grpo`'s statistics, power and positive control, on constructed numbers (no model):

* t quantiles against published values; the paired comparison detecting a consistent shift and not
  noise (moved here from test_rehearsal_grpo.py, unchanged);
* the noncentral t (`stats.noncentral_t_cdf`) against an independent high-precision quadrature of its
  defining integral (mpmath, in the stack through sympy), a seeded Monte Carlo of T = (Z + delta) /
  sqrt(V / df), and the central t at delta = 0; the detectable noncentrality against the power it
  must give;
* the smallest detectable difference of a tracked variant computed with the SE under an effect (the
  effect learners' SE when larger than its own), and the power check failing when a 0.75x-lr learner
  is neither caught nor covered;
* Fieller's interval of the recovered fraction: bounded exactly when the gap is resolved, its ends
  where the paired t test of num - R den sits at the critical value;
* the positive control's summary: the findings follow the intervals (degrades / helps / hurts /
  inverted told apart), the settings are a table (one entry adds a setting);
* the report's CPU time counts a child process still running;
* the README block is `scripts/readme_grpo.py`'s rendering of docs/figures/grpo_readme.json, and no
  typed positive control remains in the rehearsal's code.

Stand-ins: none (pure statistics and text).
"""
import importlib.util
import json
import math
import os

import pytest
import torch

from helpers import ROOT

from npu_flashrl.rehearsal.grpo import stats


def test_t_quantiles_match_published_values():
    t_quantile = stats.t_quantile

    # Student's t table: (p, df) -> quantile
    for (p, df), q in {(0.975, 1): 12.706, (0.975, 4): 2.776, (0.995, 2): 9.925, (0.8, 4): 0.941,
                       (0.975, 30): 2.042, (0.9, 10): 1.372}.items():
        assert t_quantile(p, df) == pytest.approx(q, abs=1e-3), (p, df)
    with pytest.raises(ValueError):
        t_quantile(0.4, 3)


def test_paired_detects_a_consistent_shift_and_not_noise():
    paired = stats.paired

    ref = [0.40, 0.55, 0.47, 0.62, 0.50]
    shifted = paired([x - 0.05 + d for x, d in zip(ref, (0.004, -0.003, 0.002, -0.001, 0.0))], ref, 0.99)
    assert shifted["detected"] and shifted["ci"][1] < 0 and shifted["mdd"] < 0.05
    noise = paired([x + d for x, d in zip(ref, (0.03, -0.02, 0.01, -0.03, 0.02))], ref, 0.99)
    assert not noise["detected"] and noise["ci"][0] < 0 < noise["ci"][1]
    # a larger spread of the differences: a larger smallest detectable difference
    wide = paired([x + 3 * d for x, d in zip(ref, (0.03, -0.02, 0.01, -0.03, 0.02))], ref, 0.99)
    assert wide["mdd"] == pytest.approx(3 * noise["mdd"])
    with pytest.raises(ValueError):
        paired([1.0, 2.0], [1.0], 0.95)


def _mp_ref(t, df, delta):
    import mpmath

    mpmath.mp.dps = 30
    nu = mpmath.mpf(df)
    c = 2 * (nu / 2) ** (nu / 2) / mpmath.gamma(nu / 2)
    f = lambda u: c * u ** (nu - 1) * mpmath.exp(-nu * u * u / 2) * mpmath.ncdf(t * u - delta)  # noqa: E731
    return float(mpmath.quad(f, [0, 1, 2, 5, mpmath.inf]))


@pytest.mark.parametrize("t,df,delta", [(2.0, 4, 1.0), (-1.0, 1, 0.5), (2.776, 4, 3.0), (1.5, 30, 2.0),
                                        (0.3, 2, -1.0), (5.0, 3, 4.0), (-3.0, 9, -2.5)])
def test_noncentral_t_cdf_matches_high_precision_quadrature(t, df, delta):
    assert stats.noncentral_t_cdf(t, df, delta) == pytest.approx(_mp_ref(t, df, delta), abs=1e-9)


def test_noncentral_t_cdf_matches_monte_carlo_and_the_central_t():
    g = torch.Generator().manual_seed(0)
    n = 1_000_000
    for df, delta, t in ((4, 3.0, 2.776), (9, 2.0, 1.0)):
        z = torch.randn(n, generator=g, dtype=torch.float64)
        v = torch.randn(n, df, generator=g, dtype=torch.float64).pow(2).sum(1)
        mc = float(((z + delta) / torch.sqrt(v / df) <= t).double().mean())
        # binomial SE of the estimate <= 0.0005: 5 SE
        assert stats.noncentral_t_cdf(t, df, delta) == pytest.approx(mc, abs=2.5e-3)
    for t, df in ((2.776, 4), (-1.372, 10), (0.941, 4)):
        assert stats.noncentral_t_cdf(t, df, 0.0) == pytest.approx(stats.t_cdf(t, df), abs=1e-9)


def test_detectable_delta_gives_the_power_and_exceeds_the_central_approximation():
    for df, level in ((4, 0.95), (4, 0.975), (9, 0.95), (3, 0.99)):
        d = stats.detectable_delta(df, level)
        assert stats.power_two_sided(d, df, level) == pytest.approx(stats.POWER, abs=1e-6)
        central = stats.t_quantile(1 - (1 - level) / 2, df) + stats.t_quantile(stats.POWER, df)
        assert d > central  # the central-t shortcut understates the detectable difference
    # many degrees of freedom: the normal value z_0.975 + z_0.8 = 2.8016
    assert stats.detectable_delta(2000, 0.95) == pytest.approx(2.8016, abs=2e-3)


def test_paired_mdd_uses_the_larger_se_and_says_which():
    ref = [0.40, 0.55, 0.47, 0.62, 0.50]
    var = [x + d for x, d in zip(ref, (0.003, -0.002, 0.001, -0.003, 0.002))]
    own = stats.paired(var, ref, 0.975)
    assert own["power_se"] == own["se"] and own["power_se_source"] == "this comparison's own SE"
    assert own["mdd"] == pytest.approx(own["delta"] * own["se"])
    wide = stats.paired(var, ref, 0.975, power_se=10 * own["se"], power_se_source="the slow learner's")
    assert wide["mdd"] == pytest.approx(10 * own["mdd"]) and wide["power_se_source"] == "the slow learner's"
    assert wide["ci"] == own["ci"]  # the interval stays the comparison's own
    smaller = stats.paired(var, ref, 0.975, power_se=own["se"] / 2, power_se_source="x")
    assert smaller["mdd"] == pytest.approx(own["mdd"]) and smaller["power_se_source"].startswith("this comparison")


def _t_stat(num, den, r):
    d = [a - r * b for a, b in zip(num, den)]
    return stats.mean(d) / (stats.std(d) / math.sqrt(len(d)))


def test_fieller_interval_bounded_when_the_gap_is_resolved():
    den = [0.10, 0.12, 0.09, 0.11, 0.13, 0.10]       # bf16 - int8: clearly positive
    num = [0.03, 0.05, 0.02, 0.04, 0.05, 0.03]       # int8+tis - int8
    f = stats.fieller(num, den, 0.95)
    lo, hi = f["ci"]
    assert f["bounded"] and lo < f["ratio"] < hi
    assert f["ratio"] == pytest.approx(stats.mean(num) / stats.mean(den))
    tc = stats.t_quantile(0.975, len(num) - 1)
    assert abs(_t_stat(num, den, lo)) == pytest.approx(tc, rel=1e-6)
    assert abs(_t_stat(num, den, hi)) == pytest.approx(tc, rel=1e-6)
    # a gap not resolved from 0: no bounded interval
    g = stats.fieller(num, [0.10, -0.12, 0.09, -0.11, 0.13, -0.10], 0.95)
    assert not g["bounded"] and g["ci"] == [float("-inf"), float("inf")]


# ------------------------------------------------------------------------------- the power check

def _power_summary(probe_diff, probe_ci, mdd):
    from npu_flashrl.rehearsal.grpo import checks

    probe = {"diff": probe_diff, "ci": probe_ci, "detected": probe_ci[0] > 0 or probe_ci[1] < 0, "mdd": 0.01,
             "level": 0.975, "seeds": 5, "se": 0.003, "power_se": 0.003, "power_se_source": "own"}
    tracked = dict(probe, diff=0.0, ci=[-0.01, 0.01], detected=False, mdd=mdd)
    summary = {"paired": {"probe:lr_x0.75": {"heldout": probe}, "int8+tis": {"heldout": tracked}}}
    return {c["check"]: c for c in checks._power_checks(summary)}


def test_power_check_fails_when_the_probe_is_neither_caught_nor_covered():
    from npu_flashrl.rehearsal.grpo.settings import CHECK_POWER

    name = f"int8+tis: {CHECK_POWER}"
    assert _power_summary(-0.013, [-0.02, -0.006], 0.005)[name]["ok"]        # caught
    assert _power_summary(-0.013, [-0.03, 0.004], 0.02)[name]["ok"]          # covered by the printed MDD
    bad = _power_summary(-0.013, [-0.03, 0.004], 0.011)[name]
    assert not bad["ok"] and "NOT caught" in bad["detail"]


def test_tracked_mdd_takes_the_effect_learners_se():
    """report._paired: int8+tis's held-out MDD is computed with the slow learner's larger SE."""
    import dataclasses

    from npu_flashrl.rehearsal.grpo import report
    from npu_flashrl.rehearsal.grpo.settings import PRESETS

    def res(heldout):
        rows = [{"variant": "x", "seed": sd, "step": st, "reward": 0.5, "token_correct": 0.5,
                 "token_mult_prob_error": 1.0, "kl_k3": 0.0, "tis_weights": None, "sync_s": 0.0}
                for sd in range(5) for st in (1, 2)]
        return {"rows": rows, "heldout": heldout, "seeds": 5, "steps": 2}

    base = [0.60, 0.65, 0.58, 0.70, 0.62]
    results = {"bf16": res(base), "int8+tis": res([x + d for x, d in zip(base, (1e-3, -1e-3, 2e-3, 0, -2e-3))]),
               "ctl:slow_learner": res([x - 0.1 + d for x, d in zip(base, (0.03, -0.02, 0.01, -0.03, 0.02))])}
    s = dataclasses.replace(PRESETS["default"], steps=2, seeds=5, window=1)
    p = report.summarize(results, s)["paired"]
    h = p["int8+tis"]["heldout"]
    slow_se = p["ctl:slow_learner"]["heldout"]["se"]
    assert h["power_se"] == pytest.approx(slow_se) and slow_se > 5 * h["se"]
    assert "ctl:slow_learner" in h["power_se_source"] and h["mdd"] == pytest.approx(h["delta"] * slow_se)
    # without an effect learner: its own SE, and the source says what that means
    del results["ctl:slow_learner"]
    h = report.summarize(results, s)["paired"]["int8+tis"]["heldout"]
    assert h["power_se"] == h["se"] and "nothing is wrong" in h["power_se_source"]


# ------------------------------------------------------------------------------- the positive control

def _pc_results(b, q, t, inv=None):
    def res(h):
        return {"heldout": h, "rows": [{"seed": sd, "step": 1, "reward": 0.5, "token_mult_prob_error": 1.2}
                                       for sd in range(len(h))]}

    from npu_flashrl.rehearsal.grpo import positive

    out = {positive.bf16_name((6, 6)): res(b), "pc:sharper_rollout/int8": res(q), "pc:sharper_rollout/int8+tis": res(t)}
    if inv is not None:
        out["pc:sharper_rollout/int8+tis inverted"] = res(inv)
    return out


def test_positive_control_findings_follow_the_intervals():
    import dataclasses

    from npu_flashrl.rehearsal.grpo import positive
    from npu_flashrl.rehearsal.grpo.settings import PRESETS

    table = (positive.Setting("sharper_rollout", "test", "tis_helps", logit_scale=2.0, seeds=6, inverted=True),)
    s = dataclasses.replace(PRESETS["default"], positive_control=True)
    b = [0.70, 0.72, 0.68, 0.75, 0.71, 0.69, 0.9, 0.9]          # more seeds than the setting: its first 6 pair
    q = [x - 0.11 + d for x, d in zip(b, (0.01, -0.01, 0.02, -0.02, 0.0, 0.005))]
    t = [x + 0.035 + d for x, d in zip(q, (0.005, -0.004, 0.003, -0.002, 0.001, 0.0))]
    inv = [x - 0.05 + d for x, d in zip(q, (0.01, -0.01, 0.0, 0.02, -0.02, 0.0))]
    r = positive.summarize(_pc_results(b, q, t, inv), s, {(6, 6): 0.3}, table)["sharper_rollout"]
    f = r["finding"]
    assert f["int8_degrades"] and f["tis_helps"] and not f["tis_hurts"] and f["inverted_told_apart"]
    assert r["heldout"]["int8 - bf16"]["per_seed"] == pytest.approx([a - c for a, c in zip(q, b[:6])])
    assert r["recovered_fraction"]["bounded"] and 0 < r["recovered_fraction"]["ratio"] < 1
    assert "TIS helps" in f["text"] and "correct TIS beats inverted TIS" in f["text"]
    # TIS that does nothing: not resolved, and inverted TIS equal to it is not told apart
    r = positive.summarize(_pc_results(b, q, [x + d for x, d in zip(q, (0.01, -0.01, 0.0, 0.005, -0.005, 0.0))],
                                       [x + d for x, d in zip(q, (-0.01, 0.01, 0.0, -0.005, 0.005, 0.0))]),
                           s, {}, table)["sharper_rollout"]
    assert not r["finding"]["tis_helps"] and r["finding"]["inverted_told_apart"] is False
    assert "not resolved" in r["finding"]["text"]


def test_positive_control_settings_are_a_table():
    """Each setting is one entry; the jobs follow from the table (a W4A8 rollout: one more entry)."""
    import dataclasses

    from npu_flashrl.rehearsal.grpo import positive
    from npu_flashrl.rehearsal.grpo.settings import PRESETS

    s = dataclasses.replace(PRESETS["default"], positive_control=True)
    names = [j.variant.name for j in positive.jobs(s)]
    helps = [st for st in positive.SETTINGS if st.hypothesis == "tis_helps"]
    hurts = [st for st in positive.SETTINGS if st.hypothesis == "tis_hurts"]
    assert helps and hurts and all(st.inverted for st in helps)
    for st in positive.SETTINGS:
        assert f"pc:{st.name}/int8" in names and f"pc:{st.name}/int8+tis" in names
    extra = positive.SETTINGS + (positive.Setting("w4a8", "a W4A8 rollout", "tis_helps", rollout="w4a8",
                                                  response_len=6, seeds=4),)
    jobs = positive.jobs(s, extra)
    assert {j.variant.rollout for j in jobs if j.setting == "w4a8"} == {"w4a8"}
    assert len(jobs) == len(positive.jobs(s)) + 2
    # one bf16 reference per task size, with the most seeds of its settings
    refs = [j for j in jobs if j.setting is None]
    assert len({j.task_key for j in refs}) == len(refs)
    quick = dataclasses.replace(s, quick=True)
    assert all((j.settings.seeds, j.settings.steps) == positive.QUICK_SIZE for j in positive.jobs(quick))


# ------------------------------------------------------------------------------- figures from runs

def _readme_script():
    spec = importlib.util.spec_from_file_location("readme_grpo", os.path.join(ROOT, "scripts", "readme_grpo.py"))
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_readme_grpo_block_is_the_figures_file_rendered():
    """Every GRPO figure in the README comes from docs/figures/grpo_readme.json through the script;
    the figures file was extracted from a full-size run with the positive control (it names it)."""
    mod = _readme_script()
    with open(mod.FIGURES) as f:
        fig = json.load(f)
    with open(mod.README) as f:
        assert mod.block(f.read()) == mod.render(fig)
    assert "--quick" not in fig["command"] and "--positive-control" in fig["command"]
    assert fig["positive_control"] and not fig["positive_control"]["quick"]
    assert mod.main(["--check"]) == 0


def test_no_typed_positive_control_in_the_rehearsal():
    from npu_flashrl.rehearsal.grpo import report

    assert not hasattr(report, "POSITIVE_CONTROL")
    text = open(os.path.join(ROOT, "npu_flashrl", "rehearsal", "grpo", "report.py")).read()
    assert "detectable 0.021" not in text and "tried" not in text


def test_cpu_time_counts_a_child_still_running():
    """The report's CPU time includes child processes that are still alive when it is written (the
    verl transport's sender stays up until exit, where RUSAGE_CHILDREN cannot see it)."""
    import importlib
    import subprocess
    import sys

    run = importlib.import_module("npu_flashrl.rehearsal.grpo.run")
    child = subprocess.Popen([sys.executable, "-c", "import sys, time\nx = 0\nwhile time.process_time() < 0.3:\n"
                              "    x += 1\nprint(time.process_time(), flush=True)\nsys.stdin.read()"],
                             stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    try:
        burnt = float(child.stdout.readline())
        t = run._cpu_seconds()
        # /proc counts CPU time in clock ticks (10 ms)
        assert t["live_children"] >= 1 and t["live_children_cpu_s"] >= burnt - 0.02
        assert t["cpu_s"] == pytest.approx(t["own_cpu_s"] + t["children_cpu_s"])
        assert t["children_cpu_s"] == pytest.approx(t["finished_children_cpu_s"] + t["live_children_cpu_s"])
    finally:
        child.stdin.close()
        child.wait(timeout=60)
