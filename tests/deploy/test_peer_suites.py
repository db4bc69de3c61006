"""Upstream's own test suites as the spec (issue 43; scripts/peer_suites.sh, docs/compatibility.md).

The small selection of vllm-ascend 0.23's tests/ut and verl 0.9.1's CPU tests (their registry
sdists, cached under .cache/peer_suites) runs without and with npu_flashrl activated
(int8_profile_free, FLASHRL_LMHEAD_FP32=1), the emulated torch_npu installed after upstream's
conftest in both: no test may change outcome. Skipped, in one line, when the sdists cannot be
fetched (offline). Stand-ins: the emulation (no NPU), upstream's own mocks.
"""
import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from npu_flashrl.sim import peer_suites

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "scripts" / "peer_suites.sh"


def _env(**over):
    env = dict(os.environ, PEER_PYTHON=sys.executable, TORCH_DEVICE_BACKEND_AUTOLOAD="0",
               VLLM_PLUGINS="none",
               PYTHONPATH=os.pathsep.join(p for p in (str(ROOT), os.environ.get("PYTHONPATH", "")) if p))
    for k in ("FLASHRL_CONFIG", "FLASHRL_LMHEAD_FP32"):
        env.pop(k, None)
    env.update(over)
    return env


def test_compare_lists_each_changed_outcome_with_its_cause():
    without = {"a": {"outcome": "passed", "cause": ""}, "b": {"outcome": "failed", "cause": "x"},
               "c": {"outcome": "passed", "cause": ""}}
    with_ = {"a": {"outcome": "failed", "cause": "AssertionError: no config [at npu_flashrl/y.py:3]"},
             "b": {"outcome": "failed", "cause": "x"}, "d": {"outcome": "passed", "cause": ""}}
    assert peer_suites.compare(without, with_) == [
        ("a", "passed", "failed", "AssertionError: no config [at npu_flashrl/y.py:3]"),
        ("c", "passed", "not run", ""), ("d", "not run", "passed", "")]


def test_plugin_records_outcomes_and_the_cause(tmp_path):
    (tmp_path / "test_x.py").write_text(textwrap.dedent("""
        def test_ok():
            pass
        def test_bad():
            raise KeyError("torchair.fx_summary")
    """))
    report = tmp_path / "r.json"
    proc = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-p",
                           "npu_flashrl.sim.peer_suites", "test_x.py"], cwd=tmp_path,
                          env=_env(NPU_FLASHRL_PEER_REPORT=str(report)), capture_output=True, text=True,
                          timeout=300)
    assert proc.returncode == 1, proc.stdout[-2000:]
    got = json.loads(report.read_text())
    assert got["test_x.py::test_ok"] == {"outcome": "passed", "cause": ""}
    assert got["test_x.py::test_bad"]["outcome"] == "failed"
    assert "KeyError: 'torchair.fx_summary'" in got["test_x.py::test_bad"]["cause"]


def test_script_refuses_unknown_arguments_and_selections():
    for args, needle in ((["--bogus"], "unknown argument '--bogus'"),
                         (["--selection", "huge"], "unknown selection 'huge:vllm-ascend'"),
                         (["--suite", "vllm"], "unknown suite 'vllm'")):
        proc = subprocess.run(["bash", str(SCRIPT), *args], env=_env(), capture_output=True,
                              text=True, timeout=300)
        assert proc.returncode == 2 and needle in proc.stderr, (args, proc.stderr)


def test_small_selection_changes_no_outcome():
    """The CI run: both suites' small selection, without and with activation, no difference."""
    proc = subprocess.run(["bash", str(SCRIPT), "--selection", "small"], env=_env(),
                          capture_output=True, text=True, timeout=3600)
    if proc.returncode == 3:
        pytest.skip("upstream sdists not fetchable here (offline?): " + proc.stderr.strip().splitlines()[-1])
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-4000:]
    assert proc.stdout.count("no test differs") == 2, proc.stdout
    reports = ROOT / ".cache" / "peer_suites" / "reports"
    for suite in peer_suites.SELECTIONS["small"]:
        without = json.loads((reports / f"{suite}-small-without.json").read_text())
        with_ = json.loads((reports / f"{suite}-small-with.json").read_text())
        assert len(without) >= 10 and without.keys() == with_.keys(), suite  # the suite really ran
