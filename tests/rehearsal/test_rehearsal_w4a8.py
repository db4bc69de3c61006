"""`npu-flashrl rehearse --w4a8`: the W4A8 rollout (fn w4a8_profile_free, vllm-ascend W4A8_DYNAMIC
linear layers) rehearsed beside INT8, its mismatch reported beside INT8's, its state checked after
every sync, each check able to fail.

Runs (one subprocess: the rehearsal is process-global): the tiny Llama (no linear bias) healthy,
and with the fault `w4a8_packed_flip` (npu_flashrl.sim.faults: one packed int32 word of the W4A8
model's first layer bit-flipped after each sync); the session's tiny Qwen2, whose q/k/v bias
vllm-ascend's W4A8 linear apply drops and npu_flashrl's patch `ascend_w4a8_dynamic_linear_bias`
adds back (its forward check passes; the patch itself: tests/adapters/vllm_ascend/test_w4a8_bias.py). The W4A8 rollout is set
up as a user does: `npu-flashrl setup --fn w4a8_profile_free -m <bf16 checkpoint> group_size=N`. Small sizes: 2 syncs,
4 evaluation sequences, no fp32-head variant. The state check's categories one by one, in process:
tests/rehearsal/test_rehearsal_state_w4a8.py.

Real code: vLLM, vllm-ascend (its W8A8 and W4A8 methods), verl's bucketed transfer on the current
line, npu_flashrl's setup / activation / syncs. Stand-ins (named): torch_npu (emulated by
`kernels`), vLLM attention (plain causal attention, cpu_vllm), the trainer (transformers AdamW
steps on the synthetic task).
"""
import json
import math
import subprocess
import sys

import pytest
import yaml

from helpers import ROOT, rehearsal_env

pytestmark = pytest.mark.every_line

PACKED = "w4a8 state: packed int4 weight equals a fresh W4A8 load"
FORWARD = "w4a8 each layer computes the W4A8 forward of its weights (bias included)"
W4A8_STATE = {PACKED, "w4a8 state: weight_scale and weight_scale_second equal a fresh W4A8 load",
              "w4a8 state: derived tensors consistent (weight_scale_bias, zero offsets)",
              "w4a8 state: written in place (data pointers unchanged since the cold load)",
              "w4a8 per-layer output error <= --max-w4a8-layer-error", FORWARD}
SMALL = ["--no-progress", "--no-fp32-head", "--no-plot", "--steps", "2", "--buckets", "2", "--num-seqs", "4", "--w4a8"]
RUNS = {"llama": ["--arch", "llama", "--train-iters", "120"],
        "llama_packed_flip": ["--arch", "llama", "--train-iters", "120"],
        "qwen2": []}

_DRIVER = r"""
import json, os, sys
from npu_flashrl import cli
root, cache, runs = sys.argv[1], sys.argv[2], json.loads(sys.argv[3])
codes = {}
for name, argv in runs.items():
    os.environ.pop("NPU_FLASHRL_REHEARSAL_FAULT", None)
    if name.endswith("packed_flip"):
        os.environ["NPU_FLASHRL_REHEARSAL_FAULT"] = "w4a8_packed_flip"
    print(f"===== {name}", flush=True)
    codes[name] = cli.main(["rehearse", *argv, "--cache-dir", cache, "--output-dir", os.path.join(root, name)])
print("CODES " + json.dumps(codes), flush=True)
"""


@pytest.fixture(scope="module")
def runs(tmp_path_factory, rehearsal_cache):
    root = tmp_path_factory.mktemp("rehearsal-w4a8")
    argv = {n: SMALL + a for n, a in RUNS.items()}
    p = subprocess.run([sys.executable, "-c", _DRIVER, str(root), str(rehearsal_cache), json.dumps(argv)],
                       capture_output=True, text=True, timeout=900, env=rehearsal_env(), cwd=ROOT)
    codes_line = [ln for ln in p.stdout.splitlines() if ln.startswith("CODES ")]
    assert codes_line, f"driver failed ({p.returncode}):\n{p.stdout[-4000:]}\n{p.stderr[-6000:]}"
    reports = {}
    for n in RUNS:
        with open(root / n / "report.json") as f:
            reports[n] = json.load(f)
    stdout = {c.partition("\n")[0]: c.partition("\n")[2] for c in p.stdout.split("===== ")[1:]}
    return {"codes": json.loads(codes_line[-1][len("CODES "):]), "reports": reports, "stdout": stdout}


def _failed(report):
    return [c["check"] for c in report["checks"] if not c["ok"]]


def test_w4a8_mismatch_is_reported_beside_int8s_and_every_check_passes(runs):
    r = runs["reports"]["llama"]
    assert runs["codes"]["llama"] == 0 and r["ok"] is True, _failed(r)
    s = r["summary"]
    assert set(s) == {"bf16", "int8", "w4a8"}
    for v in s.values():
        assert math.isfinite(v["token_mult_prob_error_mean"]) and math.isfinite(v["kl_k3_mean"])
    # int4 in groups is coarser than per-channel int8: its mismatch is larger, and both above bf16
    assert s["w4a8"]["token_mult_prob_error_mean"] > s["int8"]["token_mult_prob_error_mean"] > \
        s["bf16"]["token_mult_prob_error_mean"]
    assert s["w4a8"]["kl_k3_mean"] > s["int8"]["kl_k3_mean"]
    names = {c["check"] for c in r["checks"]}
    assert W4A8_STATE <= names and "w4a8 above int8 (coarser int4 values)" in names
    assert r["variants"]["w4a8"]["fn"] == "w4a8_profile_free"
    assert r["variants"]["w4a8"]["quant_types"] == ["W4A8_DYNAMIC"]
    with open(r["setup"]["w4a8"]["config"]) as f:  # the entry `npu-flashrl setup` wrote: the layers' group size
        assert yaml.safe_load(f)["configs"][0]["group_size"] == r["setup"]["w4a8"]["group_size"]
    assert r["w4a8_state_rules"]["forward"]
    w4a8_rows = [x for x in r["steps"] if x["variant"] == "w4a8"]
    assert [x["step"] for x in w4a8_rows] == [1, 2] and all(x["rollout_state"]["ok"] for x in w4a8_rows)
    out = runs["stdout"]["llama"]
    assert "  w4a8  " in out and "w4a8: token_mult_prob_error mean" in out


def test_a_corrupted_packed_weight_fails_the_w4a8_state_check(runs):
    r = runs["reports"]["llama_packed_flip"]
    assert runs["codes"]["llama_packed_flip"] == 1 and r["fault_injected"] == "w4a8_packed_flip"
    failed = _failed(r)
    assert PACKED in failed and not any(c.startswith("int8 ") for c in failed), failed
    check = next(c for c in r["checks"] if c["check"] == PACKED)
    assert check["failing_layers"] == ["model.layers.0.self_attn.qkv_proj"]
    assert "int4 values" in check["detail"] and "packed int32 words" in check["detail"]


def test_a_model_with_linear_biases_passes_the_w4a8_forward_check(runs):
    """Qwen2's q/k/v bias: upstream's W4A8 apply drops it, the bias patch adds it back, so every
    layer computes x @ dequant(W)^T + b (before the patch both qkv_proj layers failed here)."""
    r = runs["reports"]["qwen2"]
    assert runs["codes"]["qwen2"] == 0 and _failed(r) == [], _failed(r)
    check = next(c for c in r["checks"] if c["check"] == FORWARD)
    assert check["ok"] and not check.get("failing_layers")
    assert r["summary"]["w4a8"]["token_mult_prob_error_mean"] > r["summary"]["int8"]["token_mult_prob_error_mean"]
