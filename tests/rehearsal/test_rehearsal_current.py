"""`npu-flashrl rehearse` on the current line (vLLM / vllm-ascend 0.23 + verl 0.9.1) end to end,
its syncs through verl's real bucketed weight transfer.

One subprocess runs the rehearsal twice on the session's cached tiny model (2 syncs, 4 evaluation
sequences, no fp32-head variant): `--transport verl` (verl's real `BucketedWeightSender` in its own
process, verl's real `vLLMColocateWorkerExtension.update_weights_from_ipc` with npu_flashrl's
server-mode patches in the rehearsal's process, POSIX shared memory) and `--transport direct`
(`load_weights` per bucket). The same weights in the same order must leave the rollout models in
the same state, so the two runs' metrics must be equal, and the verl run's INT8 must be above its
bf16 baseline.

Stand-ins (npu_flashrl.sim.verl_transfer, listed in report.json's transport.stand_ins): verl's
`get_torch_device` / `is_support_ipc` inside `bucketed_weight_transfer` (CPU, no IPC), the vLLM
worker object verl's extension is mixed into, the sender's bucket size in bytes; torch_npu
emulated by the reference kernels, vLLM attention replaced by plain causal attention.
"""
import json
import os
import subprocess
import sys

import pytest

from npu_flashrl import lines
pytestmark = [pytest.mark.every_line,
              pytest.mark.skipif(not lines.verl_server_mode(), reason="needs verl 0.9.1 (server-mode bucketed syncs)")]

ROOT = os.path.abspath(os.path.join(os.path.dirname(__file__), "..", ".."))

_DRIVER = r"""
import json, os, sys
from npu_flashrl import cli
root, cache = sys.argv[1], sys.argv[2]
codes = {}
for transport in ("verl", "direct"):
    print(f"===== {transport}", flush=True)
    codes[transport] = cli.main(["rehearse", "--no-progress", "--no-fp32-head", "--no-plot", "--steps", "2",
                                 "--buckets", "3", "--num-seqs", "4", "--transport", transport,
                                 "--cache-dir", cache, "--output-dir", os.path.join(root, transport)])
print("CODES " + json.dumps(codes), flush=True)
"""


@pytest.fixture(scope="module")
def both(tmp_path_factory, rehearsal_cache):
    root = tmp_path_factory.mktemp("rehearsal-current")
    env = dict(os.environ, TORCH_DEVICE_BACKEND_AUTOLOAD="0", VLLM_PLUGINS="none", HF_HUB_OFFLINE="1",
               TRANSFORMERS_OFFLINE="1", PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""))
    for k in ("FLASHRL_CONFIG", "FLASHRL_LMHEAD_FP32", "NPU_FLASHRL_REHEARSAL_FAULT"):
        env.pop(k, None)
    p = subprocess.run([sys.executable, "-c", _DRIVER, str(root), str(rehearsal_cache)], capture_output=True,
                       text=True, timeout=600, env=env, cwd=ROOT)
    codes = [ln for ln in p.stdout.splitlines() if ln.startswith("CODES ")]
    assert codes, f"driver failed ({p.returncode}):\n{p.stdout[-4000:]}\n{p.stderr[-6000:]}"
    reports = {}
    for t in ("verl", "direct"):
        with open(root / t / "report.json") as f:
            reports[t] = json.load(f)
    return {"codes": json.loads(codes[-1][len("CODES "):]), "reports": reports, "stdout": p.stdout,
            "stderr": p.stderr}


def _mean(report, variant):
    errs = [r["metrics"]["token_mult_prob_error"] for r in report["steps"] if r["variant"] == variant]
    return sum(errs) / len(errs)


def test_verl_transport_passes_with_int8_above_the_baseline(both):
    r = both["reports"]["verl"]
    assert both["codes"]["verl"] == 0, both["stdout"][-4000:]
    assert r["ok"] and all(c["ok"] for c in r["checks"]), r["checks"]
    t = r["transport"]
    assert t["name"] == "verl" and t["use_shm"] is True and "update_weights_from_ipc" in t["path"]
    assert {row["transport"] for row in r["steps"]} == {"verl"}
    # several buckets per sync, counted where verl's receiver hands them to the model
    assert all(row["buckets"] >= 3 for row in r["steps"])
    assert {"verl_server_sync_end", "verl_server_receiver_drains"} <= set(r["patches"]["applied"])
    assert r["versions"]["verl"] == "0.9.1"
    assert _mean(r, "int8") > _mean(r, "bf16")
    assert [s["ok"] for s in r["rollout_state"]["int8"]["per_sync"]] == [True, True]
    assert "weight sync transport: verl (--transport verl)" in both["stdout"]
    assert "leaked shared_memory" not in both["stderr"]


def test_verl_and_direct_transports_leave_the_same_state(both):
    """Same weights, same order: verl's transfer must deliver them bit for bit."""
    v, d = both["reports"]["verl"], both["reports"]["direct"]
    assert both["codes"]["direct"] == 0 and d["transport"]["name"] == "direct"
    assert [row["buckets"] for row in d["steps"]] == [3] * 4
    for rv, rd in zip(v["steps"], d["steps"]):
        assert (rv["step"], rv["variant"]) == (rd["step"], rd["variant"])
        assert rv["metrics"] == rd["metrics"], (rv["variant"], rv["step"])
    for kind, t in v["rollout_state"]["int8"]["by_type"].items():
        assert t == d["rollout_state"]["int8"]["by_type"][kind]
