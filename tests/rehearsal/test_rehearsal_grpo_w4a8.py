"""`npu-flashrl rehearse --grpo --w4a8`: the W4A8 rollout's GRPO variants `w4a8` and `w4a8+tis`
beside the INT8 ones, each paired with bf16, the TIS effect of both quantized rollouts side by
side, the W4A8 state checked after every sync of every run, and the positive control's W4A8
setting reported as `w4a8 - bf16` / `w4a8+tis - w4a8`.

One subprocess, a small run: the tiny Llama (no linear bias: vllm-ascend's W4A8 linear apply drops
a bias, docs/w4a8.md), `--quick` sizes cut to 1 seed x 2 steps, no negative controls, the positive
control at its --quick size. At this size the learning verdicts are not what is tested (the full
GRPO checks: tests/rehearsal/test_rehearsal_grpo.py); the W4A8 variants' own checks are, and the
comparisons they report. The settings and the report's pairing on constructed values, in process.

Real code: vLLM, vllm-ascend (W8A8 and W4A8 methods), verl's GRPO advantage, rollout correction
and policy loss, verl's bucketed transfer on the current line. Stand-ins (named): torch_npu
(emulated by `kernels`), vLLM attention (plain causal attention) and its sampler, the trainer
(transformers under bf16 autocast in place of verl's FSDP actor).
"""
import argparse
import json
import subprocess
import sys

import pytest

from helpers import ROOT, needs_grpo_line, rehearsal_env

needs_line = needs_grpo_line()
ARGV = ["rehearse", "--grpo", "--quick", "--seeds", "1", "--steps", "2", "--no-controls", "--positive-control",
        "--w4a8", "--arch", "llama", "--train-iters", "120", "--no-progress", "--no-plot"]
W4A8 = ("w4a8", "w4a8+tis")


@pytest.fixture(scope="module")
def run(tmp_path_factory, rehearsal_cache):
    out = tmp_path_factory.mktemp("rehearsal-grpo-w4a8")
    code = ("import sys; from npu_flashrl import cli; "
            f"sys.exit(cli.main({ARGV!r} + ['--cache-dir', sys.argv[1], '--output-dir', sys.argv[2]]))")
    p = subprocess.run([sys.executable, "-c", code, str(rehearsal_cache), str(out)], capture_output=True,
                       text=True, timeout=1200, env=rehearsal_env(), cwd=ROOT)
    assert (out / "report.json").exists(), f"run failed ({p.returncode}):\n{p.stdout[-4000:]}\n{p.stderr[-6000:]}"
    with open(out / "report.json") as f:
        return json.load(f), p.stdout


@pytest.mark.every_line
@needs_line
def test_w4a8_variants_run_beside_int8_with_their_own_checks(run):
    r, stdout = run
    g = r["grpo"]
    assert set(W4A8) <= set(g["variants"]) and {"int8", "int8+tis"} <= set(g["variants"])
    for v in W4A8:
        info = r["rollouts"][v]
        assert info["precision"] == "w4a8" and info["fn"] == "w4a8_profile_free"
        assert info["quant_types"] == ["W4A8_DYNAMIC"]
        assert v in g["paired"]  # paired with bf16 like the INT8 variants
    assert r["rollouts"]["int8"]["precision"] == "int8"
    mine = [c for c in r["checks"] if c.get("subject") in W4A8]
    names = {c["check"] for c in mine}
    for v in W4A8:
        assert f"{v}: rollout model is W4A8" in names and f"{v}: W4A8 state checked after every sync" in names
        assert f"{v} state: packed int4 weight equals a fresh W4A8 load" in names
        assert f"{v} each layer computes the W4A8 forward of its weights (bias included)" in names
        assert f"{v}: mismatch above int8's (coarser int4 values)" in names
    assert "w4a8+tis: TIS weights in the loss" in names and "w4a8: no TIS weights in the loss" in names
    assert all(c["ok"] for c in mine), [c for c in mine if not c["ok"]]
    # the TIS effect of both quantized rollouts, side by side (reported, not a verdict)
    te = g["tis_effect"]
    assert set(te) == {"int8+tis - int8", "w4a8+tis - w4a8"}
    assert all("heldout" in e and "curve" in e for e in te.values())
    assert "w4a8+tis - w4a8:" in stdout and "int8+tis - int8:" in stdout
    assert r["w4a8_setup"]["fn"] == "w4a8_profile_free" and r["w4a8_state_rules"]


@pytest.mark.every_line
@needs_line
def test_the_positive_control_reports_its_w4a8_setting(run):
    r, stdout = run
    pc = r["grpo"]["positive_control"]
    w = pc["settings"]["w4a8_rollout"]
    assert w["setting"]["rollout"] == "w4a8"
    assert {"w4a8 - bf16", "w4a8+tis - w4a8", "w4a8+tis - bf16"} <= set(w["heldout"])
    assert {"bf16", "w4a8", "w4a8+tis"} <= set(w["token_mult_prob_error"])
    assert "w4a8 without TIS" in w["finding"]["text"]
    assert set(pc["settings"]) >= {"sharper_rollout", "flatter_rollout"}  # the INT8 settings still run
    assert "int8 - bf16" in pc["settings"]["sharper_rollout"]["heldout"]
    pcs = [c for c in r["checks"] if c.get("subject", "").startswith("pc:w4a8_rollout/")]
    assert pcs and all(c["ok"] for c in pcs), [c for c in pcs if not c["ok"]]


def test_w4a8_variants_only_with_the_flag_and_the_tis_effects_pair_by_seed():
    from npu_flashrl.rehearsal.grpo import positive, report
    from npu_flashrl.rehearsal.grpo.settings import resolve

    def args(**kw):
        return argparse.Namespace(**dict(dict(quick=True, steps=None, seeds=None, step_lr=None, no_controls=True,
                                              positive_control=False, w4a8=False), **kw))

    plain, w4a8 = resolve(args()), resolve(args(w4a8=True))
    assert not {v.name for v in plain.variants()} & set(W4A8)
    assert set(W4A8) <= {v.name for v in w4a8.variants()}
    assert positive.table_for(plain) == positive.SETTINGS
    assert {st.rollout for st in positive.table_for(w4a8)} == {"int8", "w4a8"}

    def variant(per_seed, mismatch):
        return {"seeds": len(per_seed), "steps": 2, "heldout_per_seed": per_seed, "curve_per_seed": per_seed,
                "mismatch_mean": mismatch}

    v = {"int8": variant([0.5, 0.6, 0.7], 1.01), "int8+tis": variant([0.6, 0.7, 0.8], 1.01),
         "w4a8": variant([0.5, 0.5, 0.5], 1.02), "w4a8+tis": variant([0.5, 0.4, 0.6], 1.02)}
    te = report._tis_effect(v)
    assert te["int8+tis - int8"]["heldout"]["diff"] == pytest.approx(0.1)
    assert te["w4a8+tis - w4a8"]["heldout"]["diff"] == pytest.approx(0.0, abs=1e-12)
    v["w4a8+tis"] = variant([0.5, 0.4], 1.02)  # not the same runs: not paired
    assert set(report._tis_effect(v)) == {"int8+tis - int8"}
