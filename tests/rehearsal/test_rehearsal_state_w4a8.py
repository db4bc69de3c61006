"""The rehearsal's W4A8 state check (`npu_flashrl.rehearsal.state_w4a8`) on a real W4A8 rollout
model, in process: after a sync, every vllm-ascend W4A8_DYNAMIC layer equals a fresh W4A8 load of
the pushed weights; a corrupted packed weight, a wrong antiquant scale or a re-allocated weight
is named by its category; the tiny Qwen2's q/k/v bias, which vllm-ascend's W4A8 linear apply
drops, is added back by npu_flashrl's patch (the forward check passes), and without the patch
the forward check names those layers.

Real code: vLLM's model and loaders, vllm-ascend's `AscendModelSlimConfig` and
`AscendW4A8DynamicLinearMethod` (its weight loaders, post-processing, `process_scale_second` and
`apply`), npu_flashrl's W4A8 scheme and sync. Stand-ins (named): torch_npu (the emulation:
`kernels.int4` for the int4 ops), vLLM's CPU platform accepting "ascend", plain causal attention
(npu_flashrl.sim.cpu_vllm); the rollout checkpoint is the bf16 one beside a W4A8_DYNAMIC
description (`sim.checkpoints.write_w4a8_description`, as `rehearse --w4a8` writes it).
"""
import os

import pytest
import torch

from npu_flashrl.sim import cpu_vllm

from helpers import hf_weights

pytestmark = pytest.mark.every_line
GROUP = 32


@pytest.fixture(scope="module")
def w4a8_model(va, tmp_path_factory):
    """(rollout CpuVllm context, its W4A8StateCheck, {name: tensor} of the second weight set)."""
    from transformers import AutoModelForCausalLM

    from npu_flashrl import lines
    from npu_flashrl.adapters.vllm_ascend import end_weight_sync
    from npu_flashrl.rehearsal.state_w4a8 import W4A8StateCheck
    from npu_flashrl.sim.checkpoints import tiny_checkpoint_pair, write_w4a8_description

    if lines.current().method_class("W4A8_DYNAMIC", "linear") is None:
        pytest.skip(f"vllm-ascend {lines.current().vllm_ascend} has no W4A8_DYNAMIC linear method")
    root = str(tmp_path_factory.mktemp("w4a8_state"))
    bf16, _ = tiny_checkpoint_pair(os.path.join(root, "a"), seed=0)
    bf16_b, _ = tiny_checkpoint_pair(os.path.join(root, "b"), seed=1)
    rollout = write_w4a8_description(bf16, os.path.join(root, "w4a8"), GROUP)
    pushed = hf_weights(AutoModelForCausalLM.from_pretrained(bf16_b, dtype=torch.bfloat16))
    with cpu_vllm.CpuVllm(rollout, quantization="ascend", choice=cpu_vllm.int8("w4a8_profile_free")) as v:
        loader = v.model._npu_flashrl_loader
        check = W4A8StateCheck(v.model, loader.targets, "cpu", seed=0)
        v.model.load_weights(pushed)
        assert end_weight_sync(v.model) == []
        yield v, check, dict(pushed)


def _failing(results, category):
    return {r["layer"] for r in results if r["problems"][category]}


def test_a_sync_equals_a_fresh_w4a8_load_and_the_dropped_bias_is_named(w4a8_model, monkeypatch):
    from npu_flashrl import patches
    from npu_flashrl.adapters.vllm_ascend.schemes.base import inner_method

    v, check, pushed = w4a8_model
    results = check.check(pushed, step=1)
    assert {r["type"] for r in results} == {"qkv_proj", "o_proj", "gate_up_proj", "down_proj"}
    for cat in ("int8", "scale", "derived", "in_place", "forward"):
        assert not _failing(results, cat), [r["problems"][cat] for r in results if r["problems"][cat]]
    assert all(r["int8_mismatches"] == 0 and r["int8_elements"] > 0 for r in results)
    # the int4 error is there (the output against the bf16 weights), the forward itself exact
    assert all(r["output_rel_error"] > 0 for r in results)
    biased = {r["layer"] for r in results if r["bias"]}
    assert biased and all(p.endswith("qkv_proj") for p in biased)
    # without npu_flashrl's bias patch (upstream's own apply), the forward check names those layers
    layer = next(m for n, m in v.model.named_modules() if n in biased)
    cls = type(inner_method(layer))
    monkeypatch.setattr(cls, "apply", patches.original(cls.apply))
    results = check.check(pushed, step=2)
    assert _failing(results, "forward") == biased
    bad = next(r for r in results if r["layer"] in biased)["problems"]["forward"]
    assert "WITHOUT the layer's bias" in bad and "PR #11371" in bad and "ascend_w4a8_dynamic_linear_bias" in bad
    unbiased = [r for r in results if not r["bias"]]
    assert max(r["forward_rel_error"] for r in unbiased) < min(r["forward_rel_error"] for r in results if r["bias"])


@pytest.mark.parametrize("fault, category", [("packed", "int8"), ("scale_second", "scale"),
                                             ("moved", "in_place")])
def test_a_corrupted_layer_is_named_in_its_category(w4a8_model, fault, category):
    v, check, pushed = w4a8_model
    layer = next(l for l in check.layers if l.kind == "o_proj")
    w = layer.layer
    saved = {"weight": w.weight.data, "scale": w.weight_scale_second.data.clone(), "word": w.weight.data.clone()}
    try:
        with torch.no_grad():
            if fault == "packed":
                w.weight.data.view(-1)[3] ^= 0x0F00  # one int4 value
            elif fault == "scale_second":
                w.weight_scale_second.data[0, 0] *= 1.5
            else:
                w.weight.data = w.weight.data.clone()
        results = check.check(pushed, step=1)
        assert _failing(results, category) == {layer.path}
        r = next(r for r in results if r["layer"] == layer.path)
        if fault == "packed":
            assert r["int8_mismatches"] == 1 and "1/" in r["problems"]["int8"]
        if fault == "scale_second":
            assert "weight_scale_second differs in 1/" in r["problems"]["scale"]
        if fault == "moved":
            assert "weight data_ptr" in r["problems"]["in_place"]
    finally:
        with torch.no_grad():
            w.weight.data = saved["weight"]
            w.weight.data.copy_(saved["word"])
            w.weight_scale_second.data.copy_(saved["scale"])
    assert not _failing(check.check(pushed, step=1), category)


def test_group_size_default_divides_every_projection_and_a_bad_one_is_refused():
    from npu_flashrl.rehearsal.common import RehearsalError
    from npu_flashrl.rehearsal.user_setup import W4A8_MAX_GROUP, w4a8_group_size, w4a8_input_sizes
    from npu_flashrl.sim.tiny_models import TINY_QWEN2

    sizes = w4a8_input_sizes(TINY_QWEN2).values()
    g = w4a8_group_size(TINY_QWEN2)
    assert g <= W4A8_MAX_GROUP and all(s % g == 0 for s in sizes)
    assert 2 * g > W4A8_MAX_GROUP or any(s % (2 * g) for s in sizes)  # the largest such power of two
    assert w4a8_group_size(TINY_QWEN2, g // 2) == g // 2
    with pytest.raises(RehearsalError, match=r"--group-size 48: must divide .*down_proj \(intermediate_size\)"):
        w4a8_group_size(TINY_QWEN2, 48)


def test_the_w4a8_doc_states_the_check_bounds_the_code_applies():
    from helpers import ROOT
    from npu_flashrl.rehearsal.common import LAYER_ERROR_TOKENS
    from npu_flashrl.rehearsal.state_w4a8 import FORWARD_TOL

    with open(os.path.join(ROOT, "docs", "w4a8.md")) as f:
        doc = " ".join(f.read().split())
    assert f"within {FORWARD_TOL}" in doc and f"on {LAYER_ERROR_TOKENS} random tokens" in doc
    assert "npu-flashrl rehearse --w4a8" in doc and "PR #11371" in doc


@pytest.mark.parametrize("argv, message", [
    (["--w4a8", "--arch", "deepseek_v3"], "--w4a8 with --arch deepseek_v3: a mixture-of-experts model"),
    (["--w4a8", "--grpo", "--arch", "deepseek_v3"], "--w4a8 with --arch deepseek_v3: a mixture-of-experts model"),
    (["--group-size", "32"], "--group-size 32 is the W4A8 variant's: add --w4a8"),
    (["--w4a8", "--grpo", "--max-w4a8-error", "1.2"], "--max-w4a8-error 1.2: not a --grpo option"),
])
def test_w4a8_options_are_refused_before_anything_starts(tmp_path, capsys, argv, message):
    from npu_flashrl import cli

    code = cli.main(["rehearse", *argv, "--output-dir", str(tmp_path / "out"), "--no-progress"])
    assert code in (1, 2) and message in capsys.readouterr().err
    assert not (tmp_path / "out").exists()
