"""`benchmarks/sync.py --tiny` end to end (a smoke run; no timings asserted): the four variants
over both transports (verl's real BucketedWeightSender over shared memory, the gloo checkpoint
engine standing in for HCCL, each from its own trainer process), the four ratio lines printed,
the INT8 wire's bytes under half of bf16's, and (c) and (d) leaving (b)'s exact INT8 state.
Real vLLM / vllm-ascend / verl code, torch_npu emulated."""
import json
import os
import subprocess
import sys

import pytest

from npu_flashrl import compat

pytestmark = pytest.mark.skipif(not compat.verl_server_mode(),
                                reason="needs verl 0.9's bucketed transfer (current line)")

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def test_sync_benchmark_smoke(tmp_path):
    out = tmp_path / "sync.json"
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([ROOT, os.environ.get("PYTHONPATH", "")]))
    res = subprocess.run([sys.executable, os.path.join(ROOT, "benchmarks", "sync.py"), "--tiny",
                          "--layers", "2", "--threads", "1", "--json", str(out)],
                         capture_output=True, text=True, timeout=1500, env=env, cwd=str(tmp_path))
    assert res.returncode == 0, res.stdout[-2000:] + res.stderr[-4000:]
    for line in ("bytes bf16/int8 = ", "receiver b/c = ", "layerwise/in-place = ",
                 "end-to-end b/c = "):
        assert res.stdout.count(line) == 2, (line, res.stdout[-3000:])  # shm and checkpoint engine
    r = json.loads(out.read_text())
    for transport in ("shm", "ce"):
        # tiny shapes: in=256 -> 2 * 256 / (256 + 4) on the projections, embeddings unchanged
        assert r["ratios"][transport]["bytes"] > 1.5
        for k in ("a", "b", "c"):
            assert r["results"][f"{k}/{transport}"]["receiver_s"] > 0
    assert all(r["same_int8_state_as_b"].values()) and "c" in r["same_int8_state_as_b"]
