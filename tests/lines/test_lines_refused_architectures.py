"""A stack line refuses INT8 rollouts of an architecture it cannot keep right across syncs, at
`setup`, `verify` and the engine build, with the reason and what to run instead: the 0.11 line
(verl 0.6.1's sync-mode `update_weights` never calls `process_weights_after_loading`, so
vllm-ascend's MLA `W_UK_T` / `W_UV` would stay at their cold-load values) refuses DeepSeek-V2 / V3.

Runs on the installed line with the 0.11 line passed in (or put in place of the installed line by
monkeypatching `architectures.installed_line`): the refusal is line data, the checks are the
same code on every line. Stand-in at the engine build: an empty module named
DeepseekV3ForCausalLM (the refusal comes before the loader looks at any layer).
"""
import json
import os

import pytest
import torch

from npu_flashrl import architectures, lines
from npu_flashrl.errors import ArchitectureRefusedError

MLA = ("DeepseekV2ForCausalLM", "DeepseekV3ForCausalLM")


def _model_dir(tmp_path, arch):
    d = tmp_path / arch
    d.mkdir()
    (d / "config.json").write_text(json.dumps({"architectures": [arch]}))
    return str(d)


def test_only_the_0_11_line_refuses_mla_and_says_why():
    old = lines.by_label("0.11")
    for name in MLA:
        why = old.architecture_refusal(name)
        assert why and name in why and "0.11 line" in why
        assert "verl 0.6.1" in why and "process_weights_after_loading" in why and "W_UK_T / W_UV" in why
        assert "Use the current line" in why  # the alternative (a bf16 rollout is stale too)
    assert old.architecture_refusal("Qwen2ForCausalLM") is None
    for ln in lines.LINES:
        if ln.label != "0.11":
            assert all(ln.architecture_refusal(n) is None for n in MLA), ln.label


def test_verify_fails_a_deepseek_int8_entry_on_the_0_11_line(tmp_path):
    from npu_flashrl.verify import FAIL, WARN, architecture_rows

    class Entry:
        def __init__(self, model, fn="int8_profile_free"):
            self.model, self.fn = model, fn

    ds, qwen2 = _model_dir(tmp_path, "DeepseekV3ForCausalLM"), _model_dir(tmp_path, "Qwen2ForCausalLM")
    rows = architecture_rows([Entry(ds), Entry(qwen2)], line=lines.by_label("0.11"))
    assert [(r["check"], r["status"]) for r in rows] == [(f"architecture of {ds}", FAIL)]
    assert "W_UK_T" in rows[0]["detail"] and "--line current" in rows[0]["fix"]
    # a bf16 entry of the same model is not an INT8 rollout
    assert architecture_rows([Entry(ds, "bf16")], line=lines.by_label("0.11")) == []
    # the current line: covered in part (a WARNING), not refused
    rows = architecture_rows([Entry(ds)], line=lines.by_label("current"))
    assert [r["status"] for r in rows] == [WARN]


def test_setup_refuses_before_writing(tmp_path, monkeypatch):
    from npu_flashrl.commands import setup
    from npu_flashrl.errors import CliError

    monkeypatch.setattr(architectures, "installed_line", lambda: lines.by_label("0.11"))
    ds = _model_dir(tmp_path, "DeepseekV3ForCausalLM")
    out = str(tmp_path / "flashrl.yaml")
    with pytest.raises(CliError) as exc:
        setup(fn="int8_profile_free", model=ds, output=out, check=False)
    assert "W_UK_T / W_UV" in str(exc.value) and "nothing written" in str(exc.value)
    assert not os.path.exists(out)
    setup(fn="bf16", model=ds, output=out, check=False)  # a bf16 rollout of it is fine
    assert os.path.exists(out)


def test_engine_build_refuses_before_attaching(monkeypatch):
    from npu_flashrl.adapters.vllm_ascend.reload import attach
    from npu_flashrl.quant import make_quantizer

    monkeypatch.setattr(architectures, "installed_line", lambda: lines.by_label("0.11"))
    model = type("DeepseekV3ForCausalLM", (torch.nn.Module,), {})()
    original = model.load_weights = lambda weights: set()
    with pytest.raises(ArchitectureRefusedError, match="INT8 rollout engine build: DeepseekV3ForCausalLM"):
        attach(model, make_quantizer("int8_profile_free", torch.bfloat16, None))
    assert not hasattr(model, "_npu_flashrl_loader") and model.load_weights is original
