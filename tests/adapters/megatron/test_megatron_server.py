"""verl 0.9 + Megatron actor + FLASHRL_CONFIG at the driver check: accepted (verl 0.9.1's Megatron engine is supported), with what
stays refused named. The engine itself (export into the INT8 rollout, fp32 head, TIS) runs in
tests/adapters/megatron/test_megatron_engine.py; this file reads verl 0.9.1's own generated trainer configs
(`ppo_megatron_trainer` and the FSDP default) and the engine's source text, and builds no
model. No stand-ins.
"""
import os

import pytest

from npu_flashrl import lines
pytestmark = [
    pytest.mark.every_line,
    pytest.mark.skipif(not lines.verl_server_mode(),
                       reason="needs verl 0.7.1+ (verl/workers/engine/megatron), e.g. 0.9.1"),
]

from npu_flashrl.adapters import verl as ad  # noqa: E402
from npu_flashrl.adapters.megatron import _common  # noqa: E402

ENV = {"FLASHRL_CONFIG": "int8.yaml"}
TIS = ad.tis_overrides(verl="0.9")


def _verl_dir():
    import importlib.util

    return list(importlib.util.find_spec("verl").submodule_search_locations)[0]


def _cfg(name, *overrides):
    from omegaconf import OmegaConf

    cfg = OmegaConf.load(os.path.join(_verl_dir(), "trainer", "config", name))
    return OmegaConf.merge(cfg, OmegaConf.from_dotlist(list(overrides)))


def test_what_the_engine_patches_rest_on():
    """verl 0.9.1's Megatron engine exports HF-named weights through a bridge, the pinned line's
    worker module is gone (so the engine patches target `MegatronEngine`), and the methods
    npu_flashrl's engine patches wrap are where they expect them."""
    from npu_flashrl.adapters.megatron import engine_patches

    engine = open(os.path.join(_verl_dir(), "workers", "engine", "megatron", "transformer_impl.py"),
                  encoding="utf-8").read()
    export = engine[engine.index("def get_per_tensor_param("):engine.index("def _mcore_export_index(")]
    assert "self.bridge.export_hf_weights(" in export and "self.bridge.export_weights(" in export
    assert not os.path.exists(os.path.join(_verl_dir(), *_common.WORKER_MODULE.split(".")[1:]) + ".py")
    assert engine_patches.ENGINE_MODULE == "verl.workers.engine.megatron.transformer_impl"
    init = engine[engine.index("class MegatronEngine(BaseEngine):"):engine.index("def _init_device_mesh(")]
    assert "self._init_device_mesh()" in init  # so the checks run before MindSpeed's repatch
    build = engine[engine.index("def initialize(self):"):engine.index("def train_mode(")]
    # the fp32 head goes on right after the model is built, before the fused forward would
    assert build.index("self._build_megatron_module()") < build.index("self._maybe_enable_fused_kernels()")
    mindspeed = open(os.path.join(_verl_dir(), "workers", "engine", "mindspeed", "transformer_impl.py"),
                     encoding="utf-8").read()
    assert "class MindspeedEngineWithLMHead(MegatronEngineWithLMHead)" in mindspeed
    assert "_mindspeed_repatch(self.engine_config)" in mindspeed


def test_megatron_actor_accepted():
    cfg = _cfg("_generated_ppo_megatron_trainer.yaml", *TIS)
    assert cfg.actor_rollout_ref.actor.strategy == "megatron"
    assert ad.check_rollout_mode(cfg, environ=ENV, verl="0.9") == []
    assert ad.check_rollout_mode(_cfg("_generated_ppo_trainer.yaml", *TIS), environ=ENV, verl="0.9") == []


def test_what_stays_refused_on_the_megatron_config():
    """The refusals that remain, on verl's own ppo_megatron_trainer config: verl's own quantized
    rollout next to FLASHRL_CONFIG, FLASHRL_LMHEAD_FP32=1 with the fused kernels (verl's Megatron
    fused forward reads output_layer.weight directly), TIS in bypass mode with ppo_clip."""
    base = ("_generated_ppo_megatron_trainer.yaml", *TIS)
    with pytest.raises(ad.RolloutModeError, match="Drop|drop"):
        ad.check_rollout_mode(_cfg(*base, "actor_rollout_ref.rollout.quantization=fp8"),
                              environ=ENV, verl="0.9")
    fused = _cfg(*base, "actor_rollout_ref.model.use_fused_kernels=True")
    with pytest.raises(ad.RolloutModeError, match="use_fused_kernels=False"):
        ad.check_rollout_mode(fused, environ=dict(ENV, FLASHRL_LMHEAD_FP32="1"), verl="0.9")
    assert ad.check_rollout_mode(fused, environ=ENV, verl="0.9") == []
    bypass = _cfg(*base, "algorithm.rollout_correction.bypass_mode=True",
                  "algorithm.rollout_correction.loss_type=ppo_clip")
    with pytest.raises(ad.TisConfigError, match="for metrics only"):
        ad.check_rollout_mode(bypass, environ=ENV, verl="0.9")


def test_verify_accepts_it(tmp_path):
    from npu_flashrl import verify

    path = tmp_path / "overrides.txt"
    path.write_text("\n".join(["FLASHRL_CONFIG=int8.yaml python3 -m verl.trainer.main_ppo",
                               "actor_rollout_ref.actor.strategy=megatron", *TIS]))
    rows = verify.verl_rows(str(path), "0.9")
    assert rows and all(r["status"] != verify.FAIL for r in rows), rows
