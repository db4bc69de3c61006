"""Policy only: with npu_flashrl active, only the policy rollout's engine (built from a FlashRL config
entry) is redirected onto vllm-ascend's "ascend" W8A8 path; every other vLLM engine in the process
(verl's reward / teacher model servers, any engine npu_flashrl's engine patch does not make the
policy) loads a compressed-tensors checkpoint exactly as vllm-ascend would without npu_flashrl.
The non-W8A8 scheme is W4A8_DYNAMIC (int4 grouped weights, int8 dynamic per-token activations):
vllm-ascend 0.23 serves it on dense linear layers (its W4A16 scheme is fused-MoE only), and
npu_flashrl's compressed-tensors description refuses it (UnsupportedScheme: the W4A8 rollout
reloads ModelSlim-format W4A8 layers only, docs/w4a8.md), so a redirect would show.

Real code: vLLM's `EngineArgs.create_engine_config` under npu_flashrl's engine patch, vLLM's
`ModelConfig` / `VllmConfig` (which run the compressed-tensors override and the quant-description
redirect), vllm-ascend's `AscendCompressedTensorsConfig` and its W4A8_DYNAMIC / W8A8 schemes, vLLM's
`initialize_model` / `get_model` (the INT8 loader hook). Stand-ins (named): torch_npu (reference
kernels) and vLLM's CPU platform accepting the quantization methods vllm-ascend's NPU platform
accepts (npu_flashrl.sim.cpu_vllm); Ray's runtime context (the reward server actor's name). The
W4A8 model is built, not loaded: the directory holds the bf16 weights under a W4A8
quantization_config, so its engine uses load_format=dummy and stops at the build.
"""
import json
import os
import shutil
import types

import pytest
import torch

pytestmark = pytest.mark.every_line

W4A8 = {"quant_method": "compressed-tensors", "format": "int-quantized", "ignore": ["lm_head"],
        "config_groups": {"group_0": {
            "targets": ["Linear"],
            "weights": {"num_bits": 4, "type": "int", "symmetric": True, "strategy": "group",
                        "group_size": 32, "dynamic": False},
            "input_activations": {"num_bits": 8, "type": "int", "symmetric": True,
                                  "strategy": "token", "dynamic": True}}}}


@pytest.fixture(scope="module")
def rig(va, tmp_path_factory):
    pytest.importorskip("compressed_tensors")
    from npu_flashrl.sim import cpu_vllm
    from npu_flashrl.sim.checkpoints import tiny_checkpoint_pair

    if "compressed-tensors" not in cpu_vllm._npu_supported_quantization():
        pytest.skip("this vllm-ascend has no compressed-tensors method of its own (v0.12.0rc1+): "
                    "its NPU platform sends every quantized checkpoint to 'ascend'")
    root = tmp_path_factory.mktemp("policy_only")
    bf16, w8a8 = tiny_checkpoint_pair(str(root))
    w4a8 = str(root / "w4a8")
    shutil.copytree(bf16, w4a8)  # the W4A8 quantization_config; weights unread (load_format=dummy)
    with open(os.path.join(w4a8, "config.json")) as f:
        cfg = json.load(f)
    cfg["quantization_config"] = W4A8
    with open(os.path.join(w4a8, "config.json"), "w") as f:
        json.dump(cfg, f)
    return types.SimpleNamespace(bf16=bf16, w8a8=w8a8, w4a8=w4a8, root=root)


@pytest.fixture()
def engine_patch(rig, monkeypatch):
    """npu_flashrl's engine patch applied with a one-entry FlashRL config, as `activate()` does."""
    from npu_flashrl import config as C
    from npu_flashrl import patches
    from npu_flashrl.adapters import vllm_engine
    from npu_flashrl.adapters.verl import server_mode  # noqa: F401  (registers verl's server engines)

    monkeypatch.setenv("FLASHRL_CONFIG", str(rig.root / "flashrl.yaml"))
    monkeypatch.delenv("VERL_REPLICA_RANK", raising=False)
    assert patches.apply_patch(vllm_engine.PATCH_NAME)
    vllm_engine.set_config(C.FlashRLConfig(entries=[C.RolloutConfig.from_dict(
        {"fn": "int8_profile_free", "load_format": "auto"})]))
    yield vllm_engine
    vllm_engine.set_config(None)


def _engine_config(model, **kw):
    from vllm.engine.arg_utils import EngineArgs

    from npu_flashrl.sim import ascend_harness

    # the CPU harness's compilation config (no custom-op kernels), as every CpuVllm model has:
    # vLLM caches rotary embeddings across models, so one built with GPU ops would leak
    args = EngineArgs(model=model, enforce_eager=True, skip_tokenizer_init=True,
                      compilation_config=ascend_harness.eager_compilation_config(), **kw)
    vc = args.create_engine_config()
    vc.device_config.device = torch.device("cpu")
    return vc


def _reward_server(monkeypatch):
    """verl's reward-model vLLMHttpServer: its actor name (Ray's runtime context and its connected
    state, stand-ins)."""
    ray = pytest.importorskip("ray")
    monkeypatch.setattr(ray, "is_initialized", lambda: True)
    monkeypatch.setattr(ray, "get_runtime_context",
                        lambda: types.SimpleNamespace(get_actor_name=lambda: "vllm_server_reward_0_0",
                                                      runtime_env=None))


def _ascend_ct_config():
    from vllm_ascend.quantization.compressed_tensors_config import AscendCompressedTensorsConfig

    return AscendCompressedTensorsConfig


def _built(vllm_config):
    """The model vLLM's `initialize_model` builds under `vllm_config` (npu_flashrl's
    `model_loader_int8_load_weights` hook included), without loading weights."""
    import importlib

    from vllm.config import set_current_vllm_config

    from npu_flashrl import lines
    from npu_flashrl.sim import ascend_harness, cpu_vllm

    module, _, name = lines.INITIALIZE_MODEL_TARGET.partition(":")
    initialize_model = getattr(importlib.import_module(module), name)  # what vLLM's loaders call

    with set_current_vllm_config(vllm_config):
        cpu_vllm.ensure_distributed(1)
        ascend_harness.init_vllm_ascend_config(vllm_config)
        ascend_harness.forget_served_model()
        from vllm_ascend.distributed.parallel_state import init_ascend_model_parallel

        init_ascend_model_parallel(vllm_config.parallel_config)
        with torch.device("cpu"):
            return initialize_model(vllm_config=vllm_config)


def _assert_vllm_ascend_w4a8(vllm_config):
    from npu_flashrl.adapters.engine_choice import engine_choice
    from npu_flashrl.adapters.vllm_ascend import hooks

    assert vllm_config.model_config.quantization == "compressed-tensors"
    assert type(vllm_config.quant_config) is _ascend_ct_config()
    assert engine_choice(vllm_config) is None
    model = _built(vllm_config)
    qkv = model.model.layers[0].self_attn.qkv_proj
    assert type(qkv.quant_method.quant_method).__name__ == "AscendW4A8DynamicLinearMethod"
    assert qkv.weight.dtype == torch.int8 and hasattr(qkv, "weight_scale_second")  # int4, grouped
    assert getattr(model, "_npu_flashrl_loader", None) is None
    assert not getattr(qkv, hooks.POLICY_ATTR, False)


def test_policy_engine_from_the_entry_gets_int8(rig, engine_patch):
    """The policy: its entry sets quantization="ascend"; vLLM's ModelConfig keeps it for the
    compressed-tensors W8A8 checkpoint (the override, this engine only) and the redirect gives
    vllm-ascend an in-memory description; the model gets the INT8 loader."""
    from npu_flashrl import lines
    from npu_flashrl.adapters.engine_choice import EngineChoice, engine_choice
    from npu_flashrl.sim import cpu_vllm

    vc = _engine_config(rig.w8a8, distributed_executor_backend="external_launcher")
    assert vc.model_config.quantization == "ascend"
    assert isinstance(vc.quant_config, lines.current().quant_config_class())
    assert engine_choice(vc) == EngineChoice(fn="int8_profile_free")
    assert vc.compute_hash()  # vLLM hashes additional_config with json.dumps: the choice serialises
    with cpu_vllm.CpuVllm(rig.w8a8, vllm_config=vc) as v:
        dyn = lines.current().method_class("W8A8_DYNAMIC", "linear")
        assert isinstance(v.model.model.layers[0].self_attn.qkv_proj.quant_method.quant_method, dyn)
        assert v.model._npu_flashrl_loader.targets


def test_reward_server_w4a8_goes_to_vllm_ascend_compressed_tensors(rig, engine_patch, monkeypatch):
    """A verl reward-model server in the same process: left as configured, its compressed-tensors
    W4A8 checkpoint is vllm-ascend's own (before the policy-only rule: sent to "ascend" and refused,
    UnsupportedScheme)."""
    from npu_flashrl.adapters.verl import server_mode

    _reward_server(monkeypatch)
    vc = _engine_config(rig.w4a8, distributed_executor_backend="mp", load_format="dummy",
                        worker_extension_cls=server_mode.EXTENSION_CLS)
    _assert_vllm_ascend_w4a8(vc)


def test_engine_without_an_entry_keeps_vllm_ascend_compressed_tensors(rig, engine_patch):
    """Any engine npu_flashrl's engine patch did not make the policy (here one vLLM builds from
    its config directly, with npu_flashrl's vllm-ascend patches applied): W4A8 and W8A8
    compressed-tensors checkpoints keep vllm-ascend's own method; the W8A8 one loads and runs
    as vllm-ascend serves it, without npu_flashrl's loader."""
    from npu_flashrl.sim import cpu_vllm

    _assert_vllm_ascend_w4a8(cpu_vllm.make_vllm_config(rig.w4a8, load_format="dummy"))
    with cpu_vllm.CpuVllm(rig.w8a8) as v:
        assert v.vllm_config.model_config.quantization == "compressed-tensors"
        assert type(v.vllm_config.quant_config) is _ascend_ct_config()
        assert getattr(v.model, "_npu_flashrl_loader", None) is None
        assert torch.isfinite(v.logits(torch.tensor([[1, 2, 3, 4]]))).all()


def test_explicit_ascend_without_a_choice_is_upstreams_refusal(rig, engine_patch):
    """quantization="ascend" asked for a compressed-tensors checkpoint by an engine that is not
    the policy: vLLM's own mismatch error, as without npu_flashrl (the override stays inert)."""
    from npu_flashrl.sim import cpu_vllm

    with pytest.raises(Exception, match="does not match"):
        cpu_vllm.make_vllm_config(rig.w8a8, quantization="ascend")
