"""`npu-flashrl verify --kernels` on the CPU: the op-level conformance cases run against the
emulated torch_npu (no NPU here; on an NPU host the same cases run against the device).

Stand-ins: the emulated torch_npu (`kernels.emulation`), the subject of the CPU run; a
deliberately wrong op patched into it shows that a difference is caught and fails the command."""
import json

import pytest
import torch

from npu_flashrl import cli
from npu_flashrl.kernels import conformance, emulation


@pytest.fixture
def emulated():
    was = emulation.is_installed()
    emulation.install()
    import torch_npu

    yield torch_npu
    if not was:
        emulation.uninstall()


def test_cpu_run_matches_every_op_and_exits_zero(emulated, capsys):
    rc = cli.main(["verify", "--kernels"])
    out = capsys.readouterr().out
    assert rc == 0, out
    ops = {c.op for c in conformance.CASES}
    for op in ops:  # one row per op, each "matches"
        rows = [line for line in out.splitlines() if line.startswith(op + " ")]
        assert len(rows) == 1, op
        assert rows[0][len(op):].split()[0] == conformance.MATCHES, rows[0]
    assert "(cpu)" in out


def test_json_rows(emulated, capsys):
    assert cli.main(["verify", "--kernels", "--json"]) == 0
    doc = json.loads(capsys.readouterr().out)
    assert doc["ok"] is True
    assert {r["op"] for r in doc["rows"]} == {c.op for c in conformance.CASES}
    assert all(r["status"] == conformance.MATCHES for r in doc["rows"])


def test_an_int8_result_off_by_two_differs_and_fails(emulated, monkeypatch, capsys):
    real = emulated.npu_dynamic_quant

    def off_by_two(x, *a, **kw):
        q, s = real(x, *a, **kw)
        return (q.to(torch.int16) - 2).clamp(-128, 127).to(torch.int8), s

    monkeypatch.setattr(emulated, "npu_dynamic_quant", off_by_two)
    assert cli.main(["verify", "--kernels"]) == 1
    out = capsys.readouterr().out
    row = next(line for line in out.splitlines() if line.startswith("npu_dynamic_quant "))
    assert conformance.DIFFERS in row and "integer difference 2 > 1" in row


def test_a_difference_of_one_is_within_huaweis_int8_tolerance(emulated, monkeypatch):
    """Huawei's op test accepts |npu - golden| <= 1 for int8 results: a device that rounds a tie
    the other way still conforms."""
    real = emulated.npu_dynamic_quant

    def off_by_one(x, *a, **kw):
        q, s = real(x, *a, **kw)
        return (q.to(torch.int16) - 1).clamp(-128, 127).to(torch.int8), s

    monkeypatch.setattr(emulated, "npu_dynamic_quant", off_by_one)
    cases = [c for c in conformance.CASES if c.op == "npu_dynamic_quant"]
    assert conformance.run(cases)[0]["status"] == conformance.MATCHES
    assert conformance.INT8_ABS_TOL == 1 and conformance.SCALE_RTOL == 1e-4


def test_a_refusal_of_a_valid_input_and_acceptance_of_an_invalid_one(emulated, monkeypatch):
    def refuse(*a, **kw):
        raise RuntimeError("EZ1001: device says no")

    monkeypatch.setattr(emulated, "npu_swiglu", refuse)
    rows = conformance.run([c for c in conformance.CASES if c.op == "npu_swiglu"])
    assert rows[0]["status"] == conformance.REFUSED and conformance.failed(rows)
    # an op that accepts what its page rejects: reported, does not fail the run
    monkeypatch.setattr(emulated, "npu_moe_token_unpermute", lambda *a, **kw: torch.zeros(1))
    rows = conformance.run([c for c in conformance.CASES
                            if c.op == "npu_moe_token_unpermute" and not c.valid])
    assert rows[0]["status"] == conformance.ACCEPTS_INVALID and not conformance.failed(rows)
