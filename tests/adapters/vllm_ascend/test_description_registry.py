"""A ModelSlim description's quant types against the installed line's own vllm-ascend scheme table
(`description_check`, what `setup` / `verify` / the preflight run where vllm-ascend imports): a
type vllm-ascend registers but the in-place reload does not write (W8A16) is refused naming
vllm-ascend's class; a type it has no scheme for at all, as vllm-ascend's engine would refuse it;
the registered keys listed are the ones whose class this line's table holds.

Stand-ins: torch_npu (emulated, the `va` fixture's CPU harness: vllm-ascend's quantization package
imports it). The checkpoint is a tiny ModelSlim W8A8 one written by tests/support/modelslim_writer.
"""
import json
import os
import shutil

import pytest

from npu_flashrl import lines
from npu_flashrl.sim.checkpoints import tiny_checkpoint_pair

pytestmark = pytest.mark.every_line

DOWN = "model.layers.0.mlp.down_proj"


@pytest.fixture(scope="module")
def modelslim(tmp_path_factory):
    from modelslim_writer import write_modelslim_w8a8

    root = tmp_path_factory.mktemp("registry")
    bf16, _ = tiny_checkpoint_pair(str(root / "pair"))
    out = str(root / "ms")
    write_modelslim_w8a8(bf16, out)
    return out


def _typed(src, dst, quant_type):
    shutil.copytree(src, dst)
    path = os.path.join(dst, "quant_model_description.json")
    with open(path) as f:
        desc = json.load(f)
    desc[f"{DOWN}.weight"] = quant_type
    with open(path, "w") as f:
        json.dump(desc, f)
    return str(dst)


def test_the_lines_own_table_is_read(va, modelslim, tmp_path):
    from npu_flashrl.adapters.vllm_ascend.description_check import description_problems, reload_keys

    line = lines.current()
    keys = reload_keys(line)
    assert ("W8A8", "linear") in keys and ("W8A16", "linear") not in keys
    assert description_problems(modelslim) == ([], [])  # read, so no "not checked" note
    problems, _ = description_problems(_typed(modelslim, tmp_path / "w8a16", "W8A16"))
    w8a16 = line.method_class("W8A16", "linear")
    assert len(problems) == 1 and f"layer {DOWN}" in problems[0], problems
    if w8a16 is not None:  # this vllm-ascend runs W8A16: named, and refused as the reload's gap
        assert w8a16.__name__ in problems[0] and "does not write" in problems[0], problems
    else:
        assert "has no such scheme" in problems[0], problems
    problems, _ = description_problems(_typed(modelslim, tmp_path / "magic", "W3A5_MAGIC"))
    assert len(problems) == 1 and "has no such scheme" in problems[0] and f"vllm-ascend {line.vllm_ascend}" in problems[0]
    assert all(f"{qt}/{lt}" in problems[0] for qt, lt in keys), problems
