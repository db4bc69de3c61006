"""What upstream's own unit tests do to npu_flashrl's patches (issue 43): they build layers
outside vLLM's model construction and from `unittest.mock.MagicMock`s. The patches must leave
such layers to upstream's behaviour.

Stand-ins: the emulated torch_npu (`kernels.emulation`, through `sim.cpu_vllm.prepare_process`);
a `MagicMock` layer, as vllm-ascend's `tests/ut/quantization/methods/a2/test_w8a8_static.py`
builds them.
"""
import json
import os
import subprocess
import sys
import textwrap
from unittest.mock import MagicMock

import pytest

from npu_flashrl import lines
from npu_flashrl.lines.base import POLICY_ATTR
from npu_flashrl.marks import marked, set_mark

pytestmark = pytest.mark.every_line

ROOT = os.path.abspath(os.path.join(os.path.dirname(__file__), "..", ".."))


def test_a_mock_layer_carries_no_mark():
    layer = MagicMock()
    assert getattr(layer, POLICY_ATTR)  # what fooled the guard: an auto-attribute is truthy
    assert not marked(layer, POLICY_ATTR) and not marked(layer, "_npu_flashrl_processed")
    set_mark(layer, POLICY_ATTR)
    assert marked(layer, POLICY_ATTR)


def test_run_once_guard_runs_upstream_on_a_mock_layer():
    """vllm-ascend's own static W8A8 test calls process_weights_after_loading on a MagicMock
    layer: upstream's body must run (and, for the static scheme, no bias folded into it)."""
    calls, after = [], []
    guarded = lines.current().process_once(lambda scheme, layer: calls.append(layer),
                                           after=after.append)
    layer = MagicMock()
    guarded(None, layer)
    guarded(None, layer)
    assert calls == [layer, layer] and after == []


def test_run_once_guard_still_runs_once_on_a_marked_layer():
    class Layer:
        pass

    calls, after = [], []
    guarded = lines.current().process_once(lambda scheme, layer: calls.append(layer),
                                           after=after.append)
    layer = Layer()
    set_mark(layer, POLICY_ATTR)
    if not lines.current().is_processed(layer):  # the 0.23 line also checks the scale layout
        layer.weight_scale = __import__("torch").ones(4)
    guarded(None, layer)
    guarded(None, layer)
    assert calls == [layer] and after == [layer] and marked(layer, "_npu_flashrl_processed")


def _run(code):
    path = os.pathsep.join(p for p in (ROOT, os.environ.get("PYTHONPATH", "")) if p)
    env = dict(os.environ, TORCH_DEVICE_BACKEND_AUTOLOAD="0", VLLM_PLUGINS="none", PYTHONPATH=path)
    env.pop("FLASHRL_CONFIG", None)
    proc = subprocess.run([sys.executable, "-c", textwrap.dedent(code)], capture_output=True,
                          text=True, timeout=600, env=env, cwd=ROOT)
    assert proc.returncode == 0, f"{proc.stdout[-3000:]}\n{proc.stderr[-6000:]}"
    return json.loads(proc.stdout.strip().splitlines()[-1])


def test_lm_head_built_without_a_vllm_config_keeps_upstreams_head():
    """FLASHRL_LMHEAD_FP32's creation patch on a head built outside `set_current_vllm_config`
    (vllm-ascend's `ops/test_vocab_parallel_embedding.py` does, with the tensor-parallel
    rank and size mocked as there): it builds, and stays in its
    dtype (no config: not the policy rollout's model). In a subprocess: the patch is global."""
    pytest.importorskip("vllm")
    r = _run("""
        import json, torch
        from npu_flashrl.sim import cpu_vllm
        cpu_vllm.prepare_process()
        from npu_flashrl import patches
        from npu_flashrl.adapters import vllm_lm_head as va
        assert all(va.enable_lm_head_fp32().values())
        from unittest import mock
        from vllm.model_executor.layers import vocab_parallel_embedding as vpe
        with mock.patch.object(vpe, "get_tensor_model_parallel_rank", return_value=0), \
                mock.patch.object(vpe, "get_tensor_model_parallel_world_size", return_value=1):
            head = vpe.ParallelLMHead(64, 16, params_dtype=torch.bfloat16)
        print(json.dumps({"dtype": str(head.weight.dtype), "marked": getattr(head, va.MARK, None) is True}))
    """)
    assert r == {"dtype": "torch.bfloat16", "marked": False}
