"""docs/performance.md's generated section (sync cost in the NPU's units) is what
`benchmarks/write_performance.py` writes from a fresh run of both benchmarks at the tiny shapes it
names: no figure in it is typed by hand, and a change to the counts fails here until the section
is written again. Also the writer's refusal of a JSON without device counts. Real vLLM /
vllm-ascend / verl code, torch_npu emulated (as in test_benchmark_costs / test_benchmark_sync)."""
import json
import os
import shlex
import subprocess
import sys

import pytest

from npu_flashrl import lines

ROOT = os.path.abspath(os.path.join(os.path.dirname(__file__), "..", ".."))
WRITER = os.path.join(ROOT, "benchmarks", "write_performance.py")


def _run(args, tmp_path, timeout=1500):
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([ROOT, os.environ.get("PYTHONPATH", "")]),
               TMPDIR=str(tmp_path))
    return subprocess.run([sys.executable] + args, capture_output=True, text=True, timeout=timeout,
                          env=env, cwd=str(tmp_path))


@pytest.mark.skipif(not lines.verl_server_mode(),
                    reason="the section is written from the current line's run (verl 0.9 transfer)")
def test_generated_section_equals_a_fresh_run(tmp_path):
    sys.path.insert(0, os.path.join(ROOT, "benchmarks"))
    try:
        import write_performance as wp
    finally:
        sys.path.remove(os.path.join(ROOT, "benchmarks"))
    out = {}
    for command in wp.COMMANDS:
        args = shlex.split(command)
        path = tmp_path / ("reload.json" if "reload" in args[0] else "sync.json")
        args[-1] = str(path)
        res = _run([os.path.join(ROOT, args[0])] + args[1:], tmp_path)
        assert res.returncode == 0, res.stdout[-2000:] + res.stderr[-4000:]
        out[path.name] = path
    res = _run([WRITER, "--reload-json", str(out["reload.json"]), "--sync-json",
                str(out["sync.json"]), "--check"], tmp_path, timeout=120)
    assert res.returncode == 0, ("docs/performance.md's generated section differs from a fresh run; "
                                 "write it again with benchmarks/write_performance.py\n" + res.stderr[-6000:])
    doc = open(os.path.join(ROOT, "docs", "performance.md")).read()
    assert doc.count(wp.BEGIN) == 1 and doc.count(wp.END) == 1
    for needle in ("(q + 8) / (q + 4)", "11/7", "Trainer side of the INT8 wire",
                   "an estimate from the counts, not a measurement", "Qwen2.5-32B",
                   "Why X stays above 1.5", "INT8-wire receiver (c), device traffic by op",
                   "without the transport's own"):
        assert needle in doc, needle


def test_writer_refuses_a_json_without_device_counts(tmp_path):
    bad = tmp_path / "old.json"
    bad.write_text(json.dumps({"counts": {}}))
    res = _run([WRITER, "--reload-json", str(bad), "--sync-json", str(bad), "--check"], tmp_path,
               timeout=120)
    assert res.returncode == 2 and "--reload-json: no 'device_counts'" in res.stderr
