"""verl 0.9 + Megatron actor + FLASHRL_CONFIG: refused at the driver check (issue 11, item 5).

Why refused rather than supported: read from verl 0.9.1's wheel (its source text here, because
importing verl's Megatron engine needs megatron-core, which the CPU test stack does not have).
The engine's weight export streams HF names through Megatron-Bridge/mbridge, the form the INT8
loader takes, but nothing of it can run here, and npu_flashrl's Megatron trainer-side patches
target verl 51d2104 modules that verl 0.9 no longer has. The configs are verl 0.9.1's own
generated trainer configs (`model_engine=megatron` and the FSDP default). No stand-ins.
"""
import os

import pytest

from npu_flashrl import compat

pytestmark = [
    pytest.mark.every_line,
    pytest.mark.skipif(not compat.verl_server_mode(),
                       reason="needs verl 0.7.1+ (verl/workers/engine/megatron), e.g. 0.9.1"),
]

from npu_flashrl.adapters import verl as ad  # noqa: E402
from npu_flashrl.adapters.megatron import _common  # noqa: E402
from npu_flashrl.adapters.verl import server_mode  # noqa: E402

ENV = {"FLASHRL_CONFIG": "int8.yaml"}
TIS = ad.tis_overrides(verl="0.9")


def _verl_dir():
    import importlib.util

    return list(importlib.util.find_spec("verl").submodule_search_locations)[0]


def _cfg(name, *overrides):
    from omegaconf import OmegaConf

    cfg = OmegaConf.load(os.path.join(_verl_dir(), "trainer", "config", name))
    return OmegaConf.merge(cfg, OmegaConf.from_dotlist(list(overrides)))


def test_what_the_refusal_rests_on():
    """verl 0.9.1's Megatron engine exports HF-named weights through a bridge, and the modules
    npu_flashrl's Megatron patches wait for are gone."""
    engine = open(os.path.join(_verl_dir(), "workers", "engine", "megatron", "transformer_impl.py"),
                  encoding="utf-8").read()
    export = engine[engine.index("def get_per_tensor_param("):engine.index("def _mcore_export_index(")]
    assert "self.bridge.export_hf_weights(" in export and "self.bridge.export_weights(" in export
    assert not os.path.exists(os.path.join(_verl_dir(), *_common.WORKER_MODULE.split(".")[1:]) + ".py")
    # per_tensor_generator (the stream patch's target) is still defined, but nothing calls it
    callers = []
    for folder, _, files in os.walk(_verl_dir()):
        for f in files:
            if f.endswith(".py"):
                text = open(os.path.join(folder, f), encoding="utf-8").read()
                if "per_tensor_generator(" in text.replace("def per_tensor_generator(", ""):
                    callers.append(f)
    assert callers == []


def test_megatron_actor_refused_with_the_reason_and_fix():
    cfg = _cfg("_generated_ppo_megatron_trainer.yaml", *TIS)
    assert cfg.actor_rollout_ref.actor.strategy == "megatron"
    with pytest.raises(ad.RolloutModeError) as err:
        ad.check_rollout_mode(cfg, environ=ENV, verl="0.9")
    msg = str(err.value)
    assert "actor_rollout_ref.actor.strategy=megatron" in msg and "export" in msg
    assert "Fix: actor_rollout_ref.actor.strategy=fsdp2" in msg and server_mode.MEGATRON_ENV in msg
    # without FLASHRL_CONFIG npu_flashrl has nothing to say about the backend
    ad.check_rollout_mode(cfg, environ={}, verl="0.9")
    # verl 0.9.1's FSDP default passes
    assert ad.check_rollout_mode(_cfg("_generated_ppo_trainer.yaml", *TIS), environ=ENV, verl="0.9") == []


def test_megatron_escape_hatch_warns(caplog):
    cfg = _cfg("_generated_ppo_megatron_trainer.yaml", *TIS)
    env = dict(ENV, **{server_mode.MEGATRON_ENV: "1"})
    with caplog.at_level("WARNING", logger="npu_flashrl"):
        assert ad.check_rollout_mode(cfg, environ=env, verl="0.9") == []
    assert any("not supported" in r.getMessage() and "Fix:" not in r.getMessage() for r in caplog.records)


def test_verify_refuses_it(tmp_path):
    from npu_flashrl import cli

    path = tmp_path / "overrides.txt"
    path.write_text("\n".join(["FLASHRL_CONFIG=int8.yaml python3 -m verl.trainer.main_ppo",
                               "actor_rollout_ref.actor.strategy=megatron", *TIS]))
    rows = cli.verl_rows(str(path), "0.9")
    assert rows[0]["status"] == cli.FAIL and "strategy=megatron" in rows[0]["detail"]
    assert rows[0]["fix"].startswith("actor_rollout_ref.actor.strategy=fsdp2")
