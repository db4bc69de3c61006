"""An INT8 rollout in float16 is refused at setup (the verl config check, also behind
`npu-flashrl verify --verl-overrides`) and at the engine build (explicit dtype, and dtype "auto"
once vLLM resolved it): vllm-ascend's W8A8_DYNAMIC linear would call torch_npu.npu_quant_matmul
with a float16 scale and a per-token scale, which the op's table does not accept (the emulation
refuses that call: tests/adapters/vllm_ascend/test_vllm_ascend_methods.py).

Stand-ins: vLLM's EngineArgs / VllmConfig as namespaces carrying the fields npu_flashrl reads
(the engine build itself needs an NPU); the verl config as the dict verl's Hydra overrides give."""
import types

import pytest
import torch

from npu_flashrl import config as flashrl_config
from npu_flashrl.adapters import vllm_engine
from npu_flashrl.adapters.verl import RolloutModeError, check_rollout_mode


@pytest.mark.parametrize("dtype", ["float16", "half", torch.float16, "torch.float16"])
def test_fp16_is_refused_with_the_reason(dtype):
    problem = flashrl_config.int8_rollout_dtype_problem(dtype)
    assert "float16" in problem and "float32 scale" in problem and "bfloat16" in problem


@pytest.mark.parametrize("dtype", [None, "auto", "bfloat16", torch.bfloat16, "float32"])
def test_other_dtypes_pass(dtype):
    assert flashrl_config.int8_rollout_dtype_problem(dtype) is None


def _cfg(tmp_path, fn="int8_profile_free"):
    p = tmp_path / "c.yaml"
    p.write_text(f"configs:\n  - fn: {fn}\n    load_format: auto\n")
    return flashrl_config.load_config(str(p))


def _args(**kw):
    base = dict(model="/models/bf16", tokenizer=None, tensor_parallel_size=1, pipeline_parallel_size=1,
                distributed_executor_backend="external_launcher", load_format="auto", quantization=None,
                dtype="float16")
    base.update(kw)
    return types.SimpleNamespace(**base)


def test_engine_build_refuses_an_explicit_fp16_int8_engine(tmp_path):
    with pytest.raises(flashrl_config.ConfigError, match="fn=int8_profile_free: an INT8 rollout cannot run in float16"):
        vllm_engine.apply_entry(_args(), _cfg(tmp_path))
    # a bf16 entry (no INT8) in float16 is vLLM's business
    assert vllm_engine.apply_entry(_args(), _cfg(tmp_path, fn="bf16")).fn == "bf16"


def test_engine_build_refuses_auto_resolved_to_fp16(tmp_path, monkeypatch):
    monkeypatch.setattr(vllm_engine, "_config", [_cfg(tmp_path)])
    built = types.SimpleNamespace(model_config=types.SimpleNamespace(quantization="ascend", dtype=torch.float16))
    create = vllm_engine._wrap(lambda self: built)
    with pytest.raises(flashrl_config.ConfigError, match="cannot run in float16"):
        create(_args(dtype="auto"))
    built.model_config.dtype = torch.bfloat16
    assert create(_args(dtype="auto")) is built


def test_verl_config_check_refuses_fp16_int8(tmp_path):
    p = tmp_path / "c.yaml"
    p.write_text("configs:\n  - fn: int8_profile_free\n")
    cfg = {"actor_rollout_ref": {"rollout": {"mode": "sync", "dtype": "float16", "calculate_log_probs": True}},
           "algorithm": {"rollout_correction": {"rollout_is": "token"}}}
    env = {"FLASHRL_CONFIG": str(p)}
    with pytest.raises(RolloutModeError, match=r"cannot run in float16.*Fix: actor_rollout_ref\.rollout\.dtype=bfloat16"):
        check_rollout_mode(cfg, environ=env, verl="51d2104")
    cfg["actor_rollout_ref"]["rollout"]["dtype"] = "bfloat16"
    assert check_rollout_mode(cfg, environ=env, verl="51d2104") == []
