"""The engine patch on engine arguments as verl 0.7+'s vLLMHttpServer hands them over (verl's
worker extension, `distributed_executor_backend="mp"`): entry per VERL_REPLICA_RANK, the choice
recorded in `additional_config["npu_flashrl"]`, refusals. Plain engine-argument objects stand in
for vLLM's EngineArgs (this runs on every line, verl 0.9 or not; the real verl server path is
tests/adapters/verl/test_verl_server.py::test_engine_build_through_verl_server)."""
import types

import pytest

from npu_flashrl import config as flashrl_config
from npu_flashrl.adapters import vllm_engine
from npu_flashrl.adapters.verl import server_mode

pytestmark = pytest.mark.every_line

HYBRID = {"configs": [{"fn": "int8_profile_free"}, {"fn": "bf16"}]}


def _args(**kw):
    base = dict(model="/models/tiny", tokenizer=None, quantization=None, load_format="dummy",
                tensor_parallel_size=1, pipeline_parallel_size=1, distributed_executor_backend="mp",
                worker_extension_cls=server_mode.EXTENSION_CLS, additional_config={"keep": 1})
    base.update(kw)
    return types.SimpleNamespace(**base)


@pytest.fixture()
def cfg():
    return flashrl_config.parse_config(HYBRID, "hybrid.yaml")


@pytest.mark.parametrize("replica,fn,quant", [(0, "int8_profile_free", "ascend"), (1, None, None),
                                              (2, "int8_profile_free", "ascend")])
def test_entry_per_replica_recorded_in_additional_config(cfg, monkeypatch, replica, fn, quant):
    monkeypatch.setenv("VERL_REPLICA_RANK", str(replica))
    monkeypatch.delenv("RANK", raising=False)  # server mode needs no external_launcher RANK
    args = _args()
    vllm_engine.apply_entry(args, cfg)
    assert args.quantization == quant
    assert args.additional_config["keep"] == 1  # the user's own additional_config survives
    assert args.additional_config[vllm_engine.CHOICE_KEY] == vllm_engine.EngineChoice(
        fn=fn, profile=None, rank=replica)
    assert vllm_engine.engine_choice(args).quantized is (fn is not None)
    vm = types.SimpleNamespace(additional_config=args.additional_config)
    assert vllm_engine.engine_choice(vm) == args.additional_config[vllm_engine.CHOICE_KEY]


def test_hybrid_without_replica_rank_refused(cfg, monkeypatch):
    monkeypatch.delenv("VERL_REPLICA_RANK", raising=False)
    with pytest.raises(server_mode.ServerModeError, match="VERL_REPLICA_RANK"):
        vllm_engine.apply_entry(_args(), cfg)


@pytest.mark.parametrize("quant,key", [("fp8", "actor_rollout_ref.rollout.quantization=fp8"),
                                       ("ascend", "actor_rollout_ref.rollout.quantization=ascend"),
                                       ("compressed-tensors", "actor_rollout_ref.rollout.qat.enable"),
                                       ("awq", "engine_kwargs.vllm.quantization=awq")])
def test_verl_quantization_with_flashrl_config_refused(cfg, monkeypatch, quant, key):
    monkeypatch.setenv("VERL_REPLICA_RANK", "1")
    args = _args(quantization=quant)
    with pytest.raises(server_mode.ServerModeError) as info:
        vllm_engine.apply_entry(args, cfg)
    assert key in str(info.value) and "Drop one" in str(info.value)
    assert vllm_engine.CHOICE_KEY not in args.additional_config  # nothing half-applied


def test_mp_engine_without_verl_extension_still_refused(cfg, monkeypatch):
    monkeypatch.setenv("RANK", "0")
    with pytest.raises(RuntimeError, match="distributed_executor_backend='mp'"):
        vllm_engine.apply_entry(_args(worker_extension_cls=""), cfg)


def test_driver_check_on_the_server_line(monkeypatch):
    """`check_rollout_mode` (also behind `npu-flashrl verify --verl-overrides`) on verl 0.7+:
    no `rollout.mode=sync` demanded, verl's own rollout quantization refused naming the key."""
    from npu_flashrl import lines
    from npu_flashrl.adapters import verl as verl_adapter

    monkeypatch.setattr(lines.verl, "verl_server_mode", lambda: True)
    env = {"FLASHRL_CONFIG": "/x/flashrl.yaml"}
    ok = {"actor_rollout_ref": {"rollout": {"mode": "async", "calculate_log_probs": True}},
          "algorithm": {"rollout_correction": {"rollout_is": "token"}}}
    assert verl_adapter.check_rollout_mode(ok, environ=env) == []
    bad = {"actor_rollout_ref": {"rollout": {"quantization": "fp8", "calculate_log_probs": True}},
           "algorithm": {"rollout_correction": {"rollout_is": "token"}}}
    with pytest.raises(verl_adapter.RolloutModeError,
                       match=r"Fix: drop actor_rollout_ref\.rollout\.quantization"):
        verl_adapter.check_rollout_mode(bad, environ=env)


def test_reward_model_server_left_alone(cfg, monkeypatch):
    """verl also serves reward / teacher models through vLLMHttpServer (actor
    `vllm_server_reward_<r>_<n>`): the FlashRL config is the policy rollout's, never applied
    there. Stand-ins: Ray's runtime context (the actor's name) and its connected state."""
    import types as _t

    ray = pytest.importorskip("ray")
    monkeypatch.setattr(ray, "is_initialized", lambda: True)
    monkeypatch.setenv("VERL_REPLICA_RANK", "0")
    monkeypatch.setattr(ray, "get_runtime_context",
                        lambda: _t.SimpleNamespace(get_actor_name=lambda: "vllm_server_reward_0_0"))
    args = _args(quantization="fp8")
    assert vllm_engine.apply_entry(args, cfg) is None
    assert args.quantization == "fp8" and vllm_engine.CHOICE_KEY not in args.additional_config
    monkeypatch.setattr(ray, "get_runtime_context",
                        lambda: _t.SimpleNamespace(get_actor_name=lambda: "vllm_server_0_0"))
    args = _args()
    assert vllm_engine.apply_entry(args, cfg).fn == "int8_profile_free"
