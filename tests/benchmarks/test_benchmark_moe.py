"""`benchmarks/reload.py --moe --tiny` end to end (a smoke run in seconds; no timings asserted):
the four variants run on this line where they can, (c) and (d) leave npu_flashrl's exact INT8 state
with the data pointers kept, and npu_flashrl's expert staging peaks at exactly one layer's int8
experts + fp32 scales (the documented bound). Runs the benchmark as users do, in a subprocess;
real vLLM / vllm-ascend code, torch_npu emulated."""
import json
import os
import subprocess
import sys

import pytest

pytestmark = pytest.mark.every_line

ROOT = os.path.abspath(os.path.join(os.path.dirname(__file__), "..", ".."))


def test_moe_reload_benchmark_smoke(tmp_path):
    from npu_flashrl.sim import ascend_harness

    if ascend_harness.cpu_moe_forward_unsupported() is not None:
        pytest.skip(ascend_harness.cpu_moe_forward_unsupported())
    out = tmp_path / "moe.json"
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([ROOT, os.environ.get("PYTHONPATH", "")]))
    res = subprocess.run([sys.executable, os.path.join(ROOT, "benchmarks", "reload.py"), "--moe",
                          "--tiny", "--repeats", "1", "--threads", "1", "--json", str(out)],
                         capture_output=True, text=True, timeout=600, env=env, cwd=str(tmp_path))
    assert res.returncode == 0, res.stdout[-2000:] + res.stderr[-4000:]
    r = json.loads(out.read_text())
    assert isinstance(r["seconds"]["b"], float) and isinstance(r["seconds"]["c"], float)
    assert r["same_int8_state_as_b"]["c"] is True and r["keeps_data_pointers"]["c"] is True
    if "d" not in r["not_run"]:  # vLLM >= 0.16 has the layerwise reload
        assert r["same_int8_state_as_b"]["d"] is True and r["keeps_data_pointers"]["d"] is True
    assert r["staging"]["peak_bytes"] == r["staging"]["bound_bytes"] > 0
    # Qwen3-30B-A3B: 128 experts x (2048 x 1536 + 768 x 2048) int8 + 128 x (1536 + 2048) x 4 fp32
    assert r["staging"]["qwen3_30b_a3b_bound_bytes"]["tp1_ep1"] == \
        128 * (2048 * 1536 + 768 * 2048) + 128 * (1536 + 2048) * 4
