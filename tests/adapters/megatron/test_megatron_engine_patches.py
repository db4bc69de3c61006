"""The checks npu_flashrl's patch `megatron_engine_checks` runs in verl 0.9's Megatron engine
`__init__` (adapters/megatron/engine_patches.py), on plain config objects (what verl hands the engine:
its HFModelConfig's `hf_config`, its McoreEngineConfig's fields). verl's own engine runs with
the patches in tests/adapters/megatron/test_megatron_engine.py. No stand-ins beyond the config objects."""
import logging
import types

import pytest

from npu_flashrl.adapters.megatron import (FusedKernelsConflict, UnsupportedArchitectureError,
                                           check_engine, engine_patches)


def _model(*archs):
    return types.SimpleNamespace(hf_config=types.SimpleNamespace(architectures=list(archs)))


def _engine(**kw):
    return types.SimpleNamespace(**{"use_fused_kernels": False, "use_mbridge": True,
                                    "vanilla_mbridge": True, **kw})


def test_fused_kernels_with_fp32_head_refused_by_name():
    with pytest.raises(FusedKernelsConflict, match="use_fused_kernels=False"):
        check_engine(_model("Qwen2ForCausalLM"), _engine(use_fused_kernels=True),
                     environ={"FLASHRL_LMHEAD_FP32": "1"})
    check_engine(_model("Qwen2ForCausalLM"), _engine(use_fused_kernels=True), environ={})
    check_engine(_model("Qwen2ForCausalLM"), _engine(), environ={"FLASHRL_LMHEAD_FP32": "1"})


@pytest.mark.parametrize("arch", ["DeepseekV3ForCausalLM", "Qwen2MoeForCausalLM",
                                  "Qwen2_5_VLForConditionalGeneration"])
def test_int8_of_an_unsupported_architecture_refused_by_name(arch):
    with pytest.raises(UnsupportedArchitectureError, match=f"does not support {arch}"):
        check_engine(_model(arch), _engine(), environ={"FLASHRL_CONFIG": "int8_profile_free"})
    # a bf16 rollout of it, or no npu_flashrl rollout at all: nothing to refuse
    check_engine(_model(arch), _engine(), environ={"FLASHRL_CONFIG": "bf16"})
    check_engine(_model(arch), _engine(), environ={})


@pytest.mark.parametrize("arch", engine_patches.INT8_ARCHITECTURES)
def test_int8_architectures_accepted(arch):
    check_engine(_model(arch), _engine(), environ={"FLASHRL_CONFIG": "int8_profile_free"})


def test_megatron_bridge_export_warned(caplog):
    with caplog.at_level(logging.WARNING, logger="npu_flashrl"):
        check_engine(_model("Qwen2ForCausalLM"), _engine(vanilla_mbridge=False), environ={})
    assert any("Megatron-Bridge" in r.getMessage() for r in caplog.records)
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="npu_flashrl"):
        check_engine(_model("Qwen2ForCausalLM"), _engine(vanilla_mbridge=True), environ={})
    assert not caplog.records


def test_patches_registered_without_importing_verl_or_megatron():
    import subprocess
    import sys

    code = ("import sys; from npu_flashrl import adapters, patches; adapters.load_all(); "
            "from npu_flashrl.adapters.megatron import ENGINE_PATCHES as E; "
            "print(all(patches.apply_patches(list(E)).values()), "
            "any(m == 'megatron' or m.startswith(('megatron.', 'verl.workers')) for m in sys.modules))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.stdout.split()[-2:] == ["True", "False"], out.stdout + out.stderr
