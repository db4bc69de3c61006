"""`npu-flashrl rehearse --model <tiny Qwen3-MoE>`: the rehearsal on a mixture-of-experts checkpoint.

A tiny Qwen3-MoE (2 layers, 8 experts, top-2, `sim.tiny_models.build_tiny_qwen3_moe`, random
weights, not pre-trained) is written to a tmp dir; ONE subprocess runs the rehearsal on it five
times (2 syncs, 4 evaluation sequences of 24 tokens, no fp32-head variant): healthy (the line's
transport, then `--transport direct`), and with faults of the test seam
`npu_flashrl.sim.faults`: two expert faults (one expert's down_proj scales at half; one
expert left at the first sync's weights) and truncation instead of rounding in every quantized
tensor, experts included. Each run is the real path: transformers'
Qwen3MoeForCausalLM as the trainer (AdamW steps on the CPU), its weights pushed as verl's trainer
sends them (per-expert names; transformers 5's fused experts through verl 0.9's own
`unfuse_moe_params`), through the line's transport (current line: verl 0.9.1's real
`BucketedWeightSender` process -> shared memory -> `update_weights_from_ipc`; 0.11: `load_weights`
per bucket after verl's `patch_vllm_moe_model_weight_loader`) into vLLM's Qwen3MoeForCausalLM on
vllm-ascend's W8A8_DYNAMIC linear and fused-MoE methods with npu_flashrl's INT8 loader.

Stand-ins: torch_npu (the reference kernels, fused-MoE ops from `kernels.moe_reference`), vLLM
attention (plain causal attention), gloo answering for HCCL (`cpu_vllm`), and on the verl
transport the ones listed in report.json's transport.stand_ins (`sim.verl_transfer`).
v0.10.1rc1 (pinned line) is skipped: its runner dispatches small MoE batches with MC2 (HCCL), which
the CPU harness cannot run.
"""
import json
import os
import subprocess
import sys

import pytest
import torch

from npu_flashrl import lines
pytestmark = pytest.mark.every_line  # line-specific upstream code: runs on every stack line

ROOT = os.path.abspath(os.path.join(os.path.dirname(__file__), "..", ".."))
LAYERS, EXPERTS, HIDDEN, MOE_I = 2, 8, 128, 96
EXPERT_LAYERS = {f"model.layers.{i}.mlp.experts" for i in range(LAYERS)}
L0 = "model.layers.0.mlp.experts"
RUNS = ("healthy", "direct", "expert_scale_x0.5", "stale_expert", "round_trunc")

_DRIVER = r"""
import json, os, sys
from npu_flashrl import cli
model, root = sys.argv[1], sys.argv[2]
codes = {}
for run in sys.argv[3:]:
    os.environ.pop("NPU_FLASHRL_REHEARSAL_FAULT", None)
    if run not in ("healthy", "direct"):
        os.environ["NPU_FLASHRL_REHEARSAL_FAULT"] = run
    print(f"===== {run}", flush=True)
    extra = ["--transport", "direct"] if run == "direct" else []
    codes[run] = cli.main(["rehearse", "--model", model, "--no-progress", "--no-fp32-head", "--no-plot",
                           "--steps", "2", "--buckets", "3", "--num-seqs", "4", "--seq-len", "24",
                           "--output-dir", os.path.join(root, run)] + extra)
print("CODES " + json.dumps(codes), flush=True)
"""


def _line_name():
    try:
        return lines.current().name
    except lines.UnsupportedVersion as exc:
        pytest.skip(f"stack line unknown: {exc}")


@pytest.fixture(scope="module")
def moe_dir(tmp_path_factory):
    from npu_flashrl.sim.tiny_models import build_tiny_qwen3_moe

    d = tmp_path_factory.mktemp("tiny-qwen3-moe") / "ckpt"
    model = build_tiny_qwen3_moe(str(d), seed=0)
    return str(d), model


@pytest.fixture(scope="module")
def runs(tmp_path_factory, moe_dir):
    if _line_name() == "0.10.1rc1":
        pytest.skip("vllm-ascend v0.10.1rc1 dispatches small MoE batches with MC2 (HCCL): no MoE forward on "
                    "the CPU harness (ascend_harness.moe_comm_type)")
    root = tmp_path_factory.mktemp("rehearsal-moe")
    env = dict(os.environ, TORCH_DEVICE_BACKEND_AUTOLOAD="0", VLLM_PLUGINS="none", HF_HUB_OFFLINE="1",
               TRANSFORMERS_OFFLINE="1", PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""))
    for k in ("FLASHRL_CONFIG", "FLASHRL_LMHEAD_FP32", "NPU_FLASHRL_REHEARSAL_FAULT"):
        env.pop(k, None)
    p = subprocess.run([sys.executable, "-c", _DRIVER, moe_dir[0], str(root), *RUNS], capture_output=True,
                       text=True, timeout=900, env=env, cwd=ROOT)
    codes = [ln for ln in p.stdout.splitlines() if ln.startswith("CODES ")]
    assert codes, f"driver failed ({p.returncode}):\n{p.stdout[-4000:]}\n{p.stderr[-6000:]}"
    reports = {}
    for run in RUNS:
        with open(root / run / "report.json") as f:
            reports[run] = json.load(f)
    return {"codes": json.loads(codes[-1][len("CODES "):]), "reports": reports, "stdout": p.stdout}


def _check(report, suffix):
    found = [c for c in report["checks"] if c["check"] == f"int8 {suffix}"]
    assert len(found) == 1, [c["check"] for c in report["checks"]]
    return found[0]


def _mean(report, variant):
    errs = [r["metrics"]["token_mult_prob_error"] for r in report["steps"] if r["variant"] == variant]
    return sum(errs) / len(errs)


def test_moe_rehearsal_passes_through_the_lines_transport(runs):
    r = runs["reports"]["healthy"]
    assert runs["codes"]["healthy"] == 0, runs["stdout"][-4000:]
    assert r["ok"] and all(c["ok"] for c in r["checks"]), [c for c in r["checks"] if not c["ok"]]
    assert r["model"]["source"] == "local" and r["model"]["moe"] is True
    assert r["model"]["architectures"] == ["Qwen3MoeForCausalLM"] and r["model"]["num_experts"] == EXPERTS
    # the line's own transport: verl's bucketed sender where verl runs in server mode
    t = r["transport"]
    expected = "verl" if (lines.current().verl_mode == "server" and lines.verl_server_mode()) else "direct"
    assert t["name"] == expected and {row["transport"] for row in r["steps"]} == {expected}
    if expected == "verl":
        assert t["use_shm"] is True and "update_weights_from_ipc" in t["path"]
        assert all(row["buckets"] >= 2 for row in r["steps"])
    info = r["variants"]["int8"]
    assert info["moe"] is True and info["expert_layers"] == LAYERS
    assert info["layer0_w13_weight_dtype"] == "torch.int8"
    # 2 x (qkv, o) linear + 2 fused-MoE layers; the router stays bf16 (not a quantized layer)
    assert info["quantized_layers"] == 3 * LAYERS
    # INT8 above the bf16 noise floor, which stays ~1 (the synced bf16 MoE equals transformers up to
    # rounding and a few near-tie tokens routed differently: the MoE default tolerance is 0.02)
    assert r["resolved"]["baseline_tol"] == 0.02 and r["settings"]["baseline_tol"] == 0.02
    base, int8 = _mean(r, "bf16"), _mean(r, "int8")
    assert 1.0 <= base <= 1.02 and int8 > base


def test_direct_transport_leaves_the_same_models(runs):
    """`--transport direct` (load_weights per bucket after verl's MoE weight-loader patch; the bf16
    MoE re-post-processed once per sync) pushes the same tensors in the same order as the line's
    transport: the same metrics, bf16 and INT8."""
    a, b = runs["reports"]["healthy"], runs["reports"]["direct"]
    assert runs["codes"]["direct"] == 0 and b["ok"] and b["transport"]["name"] == "direct"
    key = lambda r: (r["step"], r["variant"])  # noqa: E731
    ma = {key(r): r["metrics"] for r in a["steps"]}
    mb = {key(r): r["metrics"] for r in b["steps"]}
    assert ma.keys() == mb.keys() and len(ma) == 4
    for k in ma:
        assert ma[k]["token_mult_prob_error"] == pytest.approx(mb[k]["token_mult_prob_error"], rel=1e-6), k


def test_state_checks_cover_every_expert_of_every_moe_layer(runs):
    r = runs["reports"]["healthy"]
    per_expert = 3 * MOE_I * HIDDEN  # gate + up + down int8 values
    exp = r["rollout_state"]["int8"]["by_type"]["experts"]
    assert exp["layers"] == LAYERS and exp["syncs"] == 2
    assert exp["int8_elements"] == LAYERS * 2 * EXPERTS * per_expert and exp["int8_mismatches"] == 0
    assert exp["scale_max_rel_diff"] == 0.0
    layers = [x for x in r["rollout_state"]["int8"]["layers"] if x["type"] == "experts"]
    assert {x["layer"] for x in layers} == EXPERT_LAYERS and {x["step"] for x in layers} == {1, 2}
    for x in layers:
        assert x["experts"] == EXPERTS and x["moved"] == [] and not any(x["problems"].values())
        # the MoE block really ran INT8 experts: a few % off the fp32 MoE, not 0, not broken
        assert 0.002 < x["output_rel_error"] < r["settings"]["max_layer_error"]
        assert x["output_tokens"] >= EXPERTS  # every expert reached by some token
    # the verdict's details name the experts
    assert "experts" in _check(r, "per-layer output error <= --max-layer-error")["detail"]
    assert f"{3 * LAYERS} layers x 2 syncs" in _check(r, "state: int8 values equal the reference quantization")["detail"]
    assert "fused-MoE" in next(c for c in r["checks"] if c["check"] == "int8 rollout model is INT8")["detail"]
    assert "experts" in r["int8_state_rules"]


def test_one_expert_at_half_scale_fails_the_scale_check_naming_it(runs):
    r = runs["reports"]["expert_scale_x0.5"]
    assert runs["codes"]["expert_scale_x0.5"] == 1 and r["fault_injected"] == "expert_scale_x0.5"
    scale = _check(r, "state: weight scales match the reference")
    assert not scale["ok"] and scale["failing_layers"] == [L0]
    assert "expert 3.down_proj" in scale["detail"] and "step 1" in scale["detail"]
    # the int8 values are right (only the scale is wrong) and every other layer is clean
    assert _check(r, "state: int8 values equal the reference quantization")["ok"]
    bad = [x for x in r["rollout_state"]["int8"]["layers"] if x["problems"]["scale"]]
    assert {x["layer"] for x in bad} == {L0} and all(x["experts_failing"] == [3] for x in bad)


def test_a_stale_expert_fails_the_int8_check_from_the_second_sync(runs):
    r = runs["reports"]["stale_expert"]
    assert runs["codes"]["stale_expert"] == 1 and r["fault_injected"] == "stale_expert"
    int8 = _check(r, "state: int8 values equal the reference quantization")
    assert not int8["ok"] and int8["failing_layers"] == [L0]
    assert "step 2" in int8["detail"] and "expert 5." in int8["detail"]
    bad = [x for x in r["rollout_state"]["int8"]["layers"] if x["problems"]["int8"]]
    assert [(x["layer"], x["step"]) for x in bad] == [(L0, 2)] and bad[0]["experts_failing"] == [5]


def test_truncation_instead_of_rounding_fails_every_layer_experts_included(runs):
    r = runs["reports"]["round_trunc"]
    assert runs["codes"]["round_trunc"] == 1 and r["fault_injected"] == "round_trunc"
    int8 = _check(r, "state: int8 values equal the reference quantization")
    linear = {f"model.layers.{i}.self_attn.{p}" for i in range(LAYERS) for p in ("qkv_proj", "o_proj")}
    assert not int8["ok"] and set(int8["failing_layers"]) == linear | EXPERT_LAYERS
    experts = [x for x in r["rollout_state"]["int8"]["layers"] if x["type"] == "experts"]
    # every expert of every layer is off (about half of the values, one step each)
    assert all(x["experts_failing"] == list(range(EXPERTS)) and x["int8_max_step_diff"] == 1 for x in experts)
    assert all(0.2 < x["int8_mismatches"] / x["int8_elements"] < 0.8 for x in experts)


# ------------------------------------------------------------------ fast: names, refusals

def test_pushed_names_are_the_checkpoint_names(moe_dir):
    """What the rehearsal pushes (`adapters.verl.moe_names.sync_names` over the trainer's
    parameters; on transformers 5 verl 0.9's own unfuse_moe_params) is exactly the per-expert
    checkpoint vLLM loads, tensor for tensor."""
    from safetensors.torch import load_file

    from npu_flashrl.adapters.verl.moe_names import sync_names

    d, model = moe_dir
    ckpt = {}
    for f in os.listdir(d):
        if f.endswith(".safetensors"):
            ckpt.update(load_file(os.path.join(d, f)))
    pushed = dict(sync_names(model.named_parameters(), model.config.model_type))
    assert pushed.keys() == ckpt.keys()
    assert f"{L0}.7.down_proj.weight" in pushed and tuple(pushed[f"{L0}.7.down_proj.weight"].shape) == (HIDDEN, MOE_I)
    for n, t in pushed.items():
        assert torch.equal(t.detach(), ckpt[n]), n


def _rehearse_err(capsys, *argv):
    from npu_flashrl import cli

    code = cli.main(["rehearse", "--no-progress", *argv])
    return code, capsys.readouterr().err


def test_profile_mode_is_refused_for_moe_before_anything_starts(moe_dir, tmp_path, capsys):
    code, err = _rehearse_err(capsys, "--model", moe_dir[0], "--mode", "profile",
                              "--output-dir", str(tmp_path / "out"))
    assert code == 1 and "--mode profile" in err and "mixture-of-experts" in err and "profile-free" in err
    assert not (tmp_path / "out").exists()


def test_unsupported_moe_architecture_is_refused(tmp_path, capsys):
    d = tmp_path / "m"
    d.mkdir()
    (d / "config.json").write_text(json.dumps({"architectures": ["MixtralForCausalLM"], "num_local_experts": 8,
                                               "vocab_size": 512}))
    (d / "model.safetensors").write_bytes(b"")
    code, err = _rehearse_err(capsys, "--model", str(d), "--output-dir", str(tmp_path / "out"))
    assert code == 1 and "MixtralForCausalLM" in err and "Qwen3MoeForCausalLM" in err


def test_expert_fault_on_a_dense_model_is_refused(monkeypatch):
    from npu_flashrl.sim import faults

    class DenseLoader:
        targets, experts = {}, {}

    monkeypatch.setenv(faults.FAULT_ENV, "stale_expert")
    with pytest.raises(faults.FaultError, match="needs a MoE --model"):
        faults.install(torch.nn.Linear(2, 2), DenseLoader())
