"""Each of the rehearsal's INT8 checks is able to fail: faults injected into its rollout path.

The rehearsal (real vLLM 0.11.0 / vllm-ascend W8A8_DYNAMIC layers and the npu_flashrl INT8 loader on
CPU, torch_npu emulated by the reference kernels) runs once healthy and once per fault of the test
seam `npu_flashrl.sim.faults` (NPU_FLASHRL_REHEARSAL_FAULT): after the cold load the loader's
quantizer is wrapped through the adapter's public `attach`, or the model is tampered with after
`end_weight_sync`. Nothing upstream or in the adapter is edited. On the current line the syncs come through verl 0.9.1's
real bucketed transfer (`--transport auto`: sender process, `update_weights_from_ipc`, shared memory),
so the checks are proven on that path too. Each run must fail exactly the
checks that can see its fault (the mismatch metric may or may not also fail: it is NOT able to see
these faults reliably, which is the point of these checks), naming the layer and the number.

Stand-ins: torch_npu (emulated by npu_flashrl.kernels.reference, so int8 values must be exact here),
vLLM attention (plain causal attention, cpu_vllm). Speed: all runs in ONE subprocess (the rehearsal
is process-global: patches, emulation, vLLM's process group), 2 syncs, 4 evaluation sequences, no
fp32-head variant, the session's cached tiny model; about 20 s on 2 cores.
"""
import json
import subprocess
import sys

import pytest

from helpers import FAULT_ENV, ROOT, rehearsal_env

pytestmark = pytest.mark.every_line  # line-specific upstream code: runs on every stack line


INT8 = "int8 state: int8 values equal the reference quantization"
SCALE = "int8 state: weight scales match the reference"
DERIVED = ("int8 state: derived copies consistent (weight_scale_fp32, weight_offset, static "
           "deq_scale/quant_bias)")
IN_PLACE = "int8 state: written in place (data pointers unchanged since the cold load)"
OUTPUT = "int8 per-layer output error <= --max-layer-error"
METRIC = {"int8 error <= --max-error"}  # may fail too, but is not what catches these faults

ALL_LAYERS = {f"model.layers.{i}.{p}" for i in (0, 1) for p in
              ("self_attn.qkv_proj", "self_attn.o_proj", "mlp.gate_up_proj", "mlp.down_proj")}
QKV0 = "model.layers.0.self_attn.qkv_proj"
O0 = "model.layers.0.self_attn.o_proj"

# fault -> {check that must fail: the layers it must name}
EXPECTED = {
    "scale_x0.5": {SCALE: ALL_LAYERS, OUTPUT: ALL_LAYERS},
    "scale_x1.1": {SCALE: ALL_LAYERS, OUTPUT: ALL_LAYERS},
    "int8_transposed": {INT8: {O0}, OUTPUT: {O0}},
    "stale_shard": {INT8: {QKV0}},
    "round_trunc": {INT8: ALL_LAYERS},
    "moved_weight": {IN_PLACE: {QKV0}},
    "stale_fp32_scale": {DERIVED: {QKV0}},
}

_DRIVER = r"""
import json, os, sys
from npu_flashrl import cli
root, cache, faults = sys.argv[1], sys.argv[2], sys.argv[3:]
codes = {}
for fault in faults:
    os.environ.pop("NPU_FLASHRL_REHEARSAL_FAULT", None)
    if fault != "healthy":
        os.environ["NPU_FLASHRL_REHEARSAL_FAULT"] = fault
    print(f"===== {fault}", flush=True)
    codes[fault] = cli.main(["rehearse", "--no-progress", "--no-fp32-head", "--no-plot", "--steps", "2",
                             "--buckets", "2", "--num-seqs", "4", "--cache-dir", cache,
                             "--output-dir", os.path.join(root, fault)])
print("CODES " + json.dumps(codes), flush=True)
"""


@pytest.fixture(scope="module")
def fault_runs(tmp_path_factory, rehearsal_cache):
    root = tmp_path_factory.mktemp("rehearsal-faults")
    names = ["healthy", *EXPECTED]
    p = subprocess.run([sys.executable, "-c", _DRIVER, str(root), str(rehearsal_cache), *names],
                       capture_output=True, text=True, timeout=600, env=rehearsal_env(), cwd=ROOT)
    codes_line = [ln for ln in p.stdout.splitlines() if ln.startswith("CODES ")]
    assert codes_line, f"driver failed ({p.returncode}):\n{p.stdout[-4000:]}\n{p.stderr[-6000:]}"
    codes = json.loads(codes_line[-1][len("CODES "):])
    stdout = {}
    for chunk in p.stdout.split("===== ")[1:]:
        name, _, text = chunk.partition("\n")
        stdout[name] = text
    reports = {}
    for n in names:
        with open(root / n / "report.json") as f:
            reports[n] = json.load(f)
    return {"codes": codes, "reports": reports, "stdout": stdout}


def test_healthy_run_passes_every_check(fault_runs):
    r = fault_runs["reports"]["healthy"]
    assert fault_runs["codes"]["healthy"] == 0
    assert r["ok"] is True and r["fault_injected"] is None
    names = [c["check"] for c in r["checks"]]
    for check in (INT8, SCALE, DERIVED, IN_PLACE, OUTPUT):
        assert check in names
    assert all(c["ok"] for c in r["checks"]), [c for c in r["checks"] if not c["ok"]]
    assert "FAULT INJECTED" not in fault_runs["stdout"]["healthy"]


@pytest.mark.parametrize("fault", sorted(EXPECTED))
def test_fault_fails_the_check_that_sees_it(fault_runs, fault):
    r = fault_runs["reports"][fault]
    out = fault_runs["stdout"][fault]
    assert fault_runs["codes"][fault] == 1 and r["ok"] is False
    assert r["fault_injected"] == fault and f"FAULT INJECTED (test seam {FAULT_ENV}): {fault}" in out
    expected = EXPECTED[fault]
    failed = {c["check"]: c for c in r["checks"] if not c["ok"]}
    assert set(expected) <= set(failed) <= set(expected) | METRIC, sorted(failed)
    for check, layers in expected.items():
        c = failed[check]
        assert set(c["failing_layers"]) == layers, (check, c["failing_layers"])
        # the printed verdict names the check, a layer and a number
        line = next(ln for ln in out.splitlines() if ln.startswith(f"[FAIL] {check}: "))
        assert any(layer in line for layer in layers) and any(ch.isdigit() for ch in line.split(": ", 1)[1])
    assert "rehearsal FAILED" in out


def test_fault_details_carry_the_numbers(fault_runs):
    rep = fault_runs["reports"]

    def detail(fault, check):
        return next(c["detail"] for c in rep[fault]["checks"] if c["check"] == check)

    assert "weight_scale off by up to 0.5 relative" in detail("scale_x0.5", SCALE)
    assert "off by up to 0.1" in detail("scale_x1.1", SCALE)  # 10% (1.1 rounded to bf16)
    # 10% of scale is 10% of the output; half the scale, half the output
    errs = {f: max(l["output_rel_error"] for l in rep[f]["rollout_state"]["int8"]["layers"])
            for f in ("scale_x0.5", "scale_x1.1", "healthy", "stale_shard", "round_trunc")}
    assert 0.45 < errs["scale_x0.5"] < 0.55 and 0.08 < errs["scale_x1.1"] < 0.12, errs
    # a stale shard and truncation stay under the layer-error bound: only the exact state check sees them
    assert errs["healthy"] < errs["round_trunc"] < 0.05 and errs["stale_shard"] < 0.05, errs
    stale = detail("stale_shard", INT8)
    assert stale.startswith(f"step 2 {QKV0}: ") and "in k_proj" in stale  # the first sync is still right
    assert "not at a .5 tie" in detail("round_trunc", INT8)
    assert "weight_scale_fp32 differs from weight_scale" in detail("stale_fp32_scale", DERIVED)
    assert "not written in place: weight data_ptr" in detail("moved_weight", IN_PLACE)


def test_unknown_fault_is_refused(tmp_path, capsys, monkeypatch):
    from npu_flashrl import cli

    monkeypatch.setenv(FAULT_ENV, "nope")
    code = cli.main(["rehearse", "--output-dir", str(tmp_path / "out"), "--no-progress"])
    assert code == 1
    err = capsys.readouterr().err
    assert f"{FAULT_ENV}=nope: unknown fault" in err and "scale_x0.5" in err
    assert not (tmp_path / "out").exists()
