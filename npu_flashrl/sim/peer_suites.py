"""Upstream's own test suites as the spec (issue 43): vllm-ascend's `tests/ut` and verl's CPU tests,
run twice on the same stack, without and with npu_flashrl activated, the emulated torch_npu
installed the same way in both runs. A test whose outcome differs is something npu_flashrl's
activation changed that was not its job.

Two parts:

* a pytest plugin (`pytest -p npu_flashrl.sim.peer_suites`), driven by environment variables so
  that the same command line serves both runs:

  - `NPU_FLASHRL_PEER_EMULATION=1`: install the emulation (`kernels.emulation.install`) in
    `pytest_configure`, i.e. after upstream's initial conftest ran: vllm-ascend's
    `tests/ut/conftest.py` puts its own torch_npu mocks in `sys.modules` first and the emulation
    only answers what they leave out (the order that conftest expects);
  - `NPU_FLASHRL_PEER_ACTIVATE=1`: then `npu_flashrl.activate()` with `FLASHRL_CONFIG`
    (and `FLASHRL_LMHEAD_FP32` as set by the caller);
  - `NPU_FLASHRL_PEER_REPORT=FILE`: every test's outcome (and, when it did not pass, the last
    line of its error and npu_flashrl's innermost frame in the traceback) as JSON;

* `compare(without, with_)`: the tests whose outcome differs, each with its cause;
  `python -m npu_flashrl.sim.peer_suites compare A.json B.json` prints them and exits 1 when any
  differ (`scripts/peer_suites.sh` runs the whole thing; docs/compatibility.md).

The selections are named here (`SELECTIONS`): "small" runs in our CI
(`tests/deploy/test_peer_suites.py`), "full" is the documented command.
"""
from __future__ import annotations

import json
import os
import re
import sys
from typing import Dict, List, Optional, Tuple

ENV_EMULATION = "NPU_FLASHRL_PEER_EMULATION"
ENV_ACTIVATE = "NPU_FLASHRL_PEER_ACTIVATE"
ENV_REPORT = "NPU_FLASHRL_PEER_REPORT"

# {selection: {suite: [paths inside that suite's source tree]}}; suites: "vllm-ascend" (its
# tests/ut, from the vllm-ascend sdist) and "verl" (its tests/, from the verl sdist).
SELECTIONS: Dict[str, Dict[str, List[str]]] = {
    "small": {
        "vllm-ascend": [
            "tests/ut/ops/test_vocab_parallel_embedding.py",
            "tests/ut/quantization/methods/a2/test_w8a8_static.py",
            "tests/ut/quantization/methods/a2/test_w8a8_dynamic.py",
            "tests/ut/quantization/test_modelslim_config.py",
        ],
        "verl": [
            "tests/trainer/test_constants_ppo_on_cpu.py",
            "tests/trainer/ppo/test_rollout_corr.py",
        ],
    },
    "full": {
        "vllm-ascend": [
            "tests/ut/quantization", "tests/ut/model_loader", "tests/ut/ops", "tests/ut/worker",
            "tests/ut/patch", "tests/ut/eplb", "tests/ut/sample",
        ],
        "verl": [
            "tests/checkpoint_engine", "tests/trainer", "tests/test_base_config_on_cpu.py",
            "tests/test_protocol_on_cpu.py",
        ],
    },
}


# ------------------------------------------------------------------------------ pytest plugin

_outcomes: Dict[str, dict] = {}


def _flag(name: str) -> bool:
    return os.environ.get(name, "") == "1"


def pytest_configure(config) -> None:  # noqa: D103 - pytest hook
    if _flag(ENV_EMULATION) or _flag(ENV_ACTIVATE):
        from npu_flashrl.kernels import emulation

        emulation.install()
    if _flag(ENV_ACTIVATE):
        import npu_flashrl

        if not os.environ.get("FLASHRL_CONFIG", "").strip():
            raise RuntimeError(f"{ENV_ACTIVATE}=1 needs FLASHRL_CONFIG (a FlashRL config or a "
                               "shortcut such as int8_profile_free)")
        npu_flashrl.activate()


def _cause(report) -> str:
    """The last line of the error, and npu_flashrl's innermost frame when it is in the traceback."""
    text = str(getattr(report, "longrepr", "") or "")
    lines = [ln for ln in text.splitlines() if ln.strip()]
    error = next((ln[2:].strip() if ln.startswith("E ") else ln.strip()
                  for ln in reversed(lines) if ln.startswith("E ") or re.match(r"^\w+(Error|Exception)", ln)),
                 lines[-1].strip() if lines else "")
    ours = [ln.strip() for ln in lines if "npu_flashrl" in ln and re.search(r"\.py:\d+", ln)]
    return error[:300] + (f" [at {ours[-1][:200]}]" if ours else "")


def _record(nodeid: str, outcome: str, report) -> None:
    have = _outcomes.get(nodeid)
    # a failed setup or teardown decides; a pass in "call" does not hide a teardown error
    if have is not None and have["outcome"] != "passed" and outcome == "passed":
        return
    _outcomes[nodeid] = {"outcome": outcome, "cause": "" if outcome in ("passed", "skipped")
                         else _cause(report)}


def pytest_runtest_logreport(report) -> None:  # noqa: D103 - pytest hook
    if report.when == "call" or report.outcome != "passed":
        outcome = "xfailed" if hasattr(report, "wasxfail") and report.skipped else report.outcome
        if report.when != "call" and report.outcome == "failed":
            outcome = "error"
        _record(report.nodeid, outcome, report)


def pytest_collectreport(report) -> None:  # noqa: D103 - pytest hook
    if report.outcome == "failed":
        _record(report.nodeid or "<collection>", "collection error", report)


def pytest_sessionfinish(session, exitstatus) -> None:  # noqa: D103 - pytest hook
    path = os.environ.get(ENV_REPORT)
    if path:
        with open(path, "w") as fh:
            json.dump(_outcomes, fh, indent=1, sort_keys=True)


# ------------------------------------------------------------------------------ comparison

def compare(without: Dict[str, dict], with_: Dict[str, dict]) -> List[Tuple[str, str, str, str]]:
    """(test, outcome without, outcome with, cause) for every test whose outcome differs; a test
    present in one run only counts as "not run" in the other."""
    out = []
    for nodeid in sorted(set(without) | set(with_)):
        a = without.get(nodeid, {"outcome": "not run", "cause": ""})
        b = with_.get(nodeid, {"outcome": "not run", "cause": ""})
        if a["outcome"] != b["outcome"]:
            cause = b["cause"] or a["cause"]
            out.append((nodeid, a["outcome"], b["outcome"], cause))
    return out


def summary(outcomes: Dict[str, dict]) -> str:
    counts: Dict[str, int] = {}
    for v in outcomes.values():
        counts[v["outcome"]] = counts.get(v["outcome"], 0) + 1
    return ", ".join(f"{n} {k}" for k, n in sorted(counts.items())) or "no tests"


def _load(path: str) -> Dict[str, dict]:
    try:
        with open(path) as fh:
            data = json.load(fh)
    except FileNotFoundError:
        raise SystemExit(f"peer_suites: no report {path} (did the pytest run start? see its output)")
    except json.JSONDecodeError as exc:
        raise SystemExit(f"peer_suites: {path} is not a report written by this plugin: {exc}")
    if not isinstance(data, dict):
        raise SystemExit(f"peer_suites: {path}: expected a JSON object {{test: outcome}}")
    return data


def main(argv: Optional[List[str]] = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if len(argv) == 2 and argv[0] == "paths":
        name, _, suite = argv[1].partition(":")
        if name not in SELECTIONS or suite not in SELECTIONS[name]:
            raise SystemExit(f"peer_suites: unknown selection {argv[1]!r}; known: "
                             + ", ".join(f"{n}:{s}" for n in SELECTIONS for s in SELECTIONS[n]))
        print("\n".join(SELECTIONS[name][suite]))
        return 0
    if len(argv) != 3 or argv[0] != "compare":
        raise SystemExit("usage: python -m npu_flashrl.sim.peer_suites compare WITHOUT.json WITH.json\n"
                         "       python -m npu_flashrl.sim.peer_suites paths SELECTION:SUITE")
    without, with_ = _load(argv[1]), _load(argv[2])
    print(f"without activation: {summary(without)}")
    print(f"with activation:    {summary(with_)}")
    diff = compare(without, with_)
    for nodeid, a, b, cause in diff:
        print(f"DIFFERS {nodeid}: {a} -> {b}: {cause}")
    print(f"{len(diff)} test(s) differ" if diff else "no test differs")
    return 1 if diff else 0


if __name__ == "__main__":
    sys.exit(main())
