"""The benchmarks' machine-independent costs (`npu_flashrl.sim.costs`), held at tiny shapes:
`benchmarks/reload.py --tiny` run end to end (real vLLM / vllm-ascend loaders, torch_npu
emulated), its counted launches and bytes per variant within a few percent of the values they
had when this test was written: a change that adds a pass over the weights (~+9% of (b)'s
bytes read here) or an operation per row (hundreds of launches) fails here, not in a benchmark
reading. Also the benchmarks' argument checks."""
import json
import os
import subprocess
import sys

import pytest

from npu_flashrl import lines
ROOT = os.path.abspath(os.path.join(os.path.dirname(__file__), "..", ".."))

# benchmarks/reload.py --tiny --layers 2: 4.0 MB of bf16 weights per sync (launches, bytes read,
# bytes written, peak extra bytes)
RELOAD_TINY = {"a": (29, 4002304, 4002304, 0),
               "b": (476, 27044748, 18550566, 1800241),
               "c": (384, 28969556, 21509237, 3639820),
               "d": (447, 31477844, 21489781, 1108237)}
# (c) and (d) each +1474560 bytes read and written, +8 launches, since the emulated npu_format_cast
# returns a converted copy and leaves its input as it was, as torch_npu documents (it re-tagged
# its input before): the NZ cast is a real read and write on an NPU too.
# (b) +1053184 bytes read and written, +13 launches, +527360 peak extra bytes since a streamed
# float tensor (embedding, norms, biases) that waits for its group's write is copied once (a
# generator may refill the buffer it yielded; vLLM's own loader copies each tensor as it comes).
# (b) -39 launches (was 515), +0.3% bytes: a streamed call's NaN / Inf checks (floats, the
# quantizer's refusal) are handed back as device flags and read back twice per call, not one by
# one; (c) and (d) -54 launches (were 438 and 501): the cold stream (c) and the checkpoint-format
# quantization (d) read the quantizer's refusals back once at the end of their stream.
MARGIN = 0.03


def _env():
    return dict(os.environ, PYTHONPATH=os.pathsep.join([ROOT, os.environ.get("PYTHONPATH", "")]))


def _tmp_env(tmp_path):
    return dict(_env(), TMPDIR=str(tmp_path))


def assert_near(got, held, what):
    """`got` within MARGIN of `held` (exactly 0 when held is 0)."""
    assert abs(got - held) <= MARGIN * held, f"{what}: {got} vs {held} held (+-{MARGIN:.0%})"


@pytest.mark.skipif(not lines.verl_server_mode(),
                    reason="counts held on the current line's vLLM (its loaders and layerwise reload)")
def test_reload_counts_held_at_tiny_shapes(tmp_path):
    out = tmp_path / "reload.json"
    res = subprocess.run([sys.executable, os.path.join(ROOT, "benchmarks", "reload.py"), "--tiny",
                          "--layers", "2", "--repeats", "1", "--threads", "1", "--fp32-vocab", "0",
                          "--json", str(out)], capture_output=True, text=True, timeout=900,
                         env=_tmp_env(tmp_path), cwd=str(tmp_path))
    assert res.returncode == 0, res.stdout[-2000:] + res.stderr[-4000:]
    for line in ("traffic flashrl-style / in-place = ", "traffic layerwise / in-place = ",
                 "launches flashrl-style / in-place = ", "machine load (start)", "machine load (end)",
                 "device traffic in-place / limit = ", "peak extra 4 layers / 1 layer in-place = ",
                 "host syncs per layer, max over receivers = "):
        assert res.stdout.count(line) == 1, (line, res.stdout[-3000:])
    r = json.loads(out.read_text())
    assert r["weight_bytes"] == 4002304
    for k, (launches, read, written, peak) in RELOAD_TINY.items():
        c = r["counts"][k]
        assert_near(c["launches"], launches, f"({k}) launches")
        assert_near(c["read_bytes"], read, f"({k}) bytes read")
        assert_near(c["written_bytes"], written, f"({k}) bytes written")
        assert_near(c["peak_extra_bytes"], peak, f"({k}) peak extra")
    # the floor is one copy of each weight byte; the quantizer's per-row work stays in chunks
    assert r["counts"]["a"]["read_bytes"] == r["weight_bytes"]
    assert r["counts"]["b"]["by_op"].get("round_", 0) <= 2 * 14  # 14 projections, <= 2 chunks each
    assert r["count_ratios"]["traffic_c_b"] == pytest.approx(
        (28969556 + 21509237) / (27044748 + 18550566), rel=0.05)
    # the device counts (sim.device_costs): the quantizer one kernel mix, not CPU chunks; the
    # in-place reload within 2.5x of the limit and flat in the layer count, FlashRL-style not
    dev, dc = r["device"], r["device_counts"]
    assert "round_" not in dc["b"]["by_op"] and dc["b"]["by_op"]["npu_dynamic_quant"] == 14
    assert dev["traffic_over_limit"] <= 2.5 and dev["peak_ratio"]["b"] <= 1.05
    assert dev["peak_ratio"]["c"] > 1.5
    # no host synchronisation per layer in any variant (each one streamed call)
    assert max(dev["host_syncs_per_layer"].values()) == 0, dev["host_syncs_per_layer"]
    assert not list(tmp_path.glob("npu_flashrl_bench_*"))


@pytest.mark.parametrize("script,args,message", [
    ("reload.py", ["--threads", "100000"], "--threads must be between 1 and"),
    ("reload.py", ["--repeats", "0"], "--repeats must be at least 1, got 0"),
    ("reload.py", ["--layers", "0"], "--layers must be at least 1, got 0"),
    ("reload.py", ["--fp32-vocab", "-1"], "--fp32-vocab must be at least 0, got -1"),
    ("reload.py", ["--moe", "--fp32-vocab", "0"], "--fp32-vocab applies to the dense mode only"),
    ("sync.py", ["--threads", "0"], "--threads must be between 1 and"),
    ("sync.py", ["--repeats", "0"], "--repeats must be at least 1, got 0"),
    ("sync.py", ["--layers", "0"], "--layers must be at least 1, got 0"),
    ("sync.py", ["--bucket-mb", "0"], "--bucket-mb must be at least 1, got 0"),
    # --json is checked before the run (a missing directory lost the whole run's result)
    ("reload.py", ["--json", "/nonexistent-npu-flashrl/r.json"],
     "--json /nonexistent-npu-flashrl/r.json: the directory /nonexistent-npu-flashrl does not exist"),
    ("sync.py", ["--json", "/nonexistent-npu-flashrl/s.json"],
     "--json /nonexistent-npu-flashrl/s.json: the directory /nonexistent-npu-flashrl does not exist"),
    ("sync.py", ["--json", "/"], "--json /: is a directory; expected a file path"),
])
def test_benchmark_arguments_checked(script, args, message, capsys):
    """Refused by argparse before anything runs (in this process: the scripts' `main(argv)`)."""
    import importlib.util

    sys.path.insert(0, os.path.join(ROOT, "benchmarks"))
    try:
        spec = importlib.util.spec_from_file_location(f"bench_{script[:-3]}",
                                                      os.path.join(ROOT, "benchmarks", script))
        mod = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(mod)
        with pytest.raises(SystemExit) as exc:
            mod.main(args)
    finally:
        sys.path.remove(os.path.join(ROOT, "benchmarks"))
    assert exc.value.code == 2
    assert message in capsys.readouterr().err
