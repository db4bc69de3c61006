"""npu_flashrl.adapters.verl against verl 0.6.1's real functions on CPU (same schema as verl 51d2104)."""
import logging
import math
import os

import pytest
import torch

pytest.importorskip("verl")

from npu_flashrl import lines

from helpers import LogRecords

# every line: the sync-mode schema runs on the 0.11 (verl 0.6.1) and pinned (51d2104) lines; the
# tests that need it skip on server-mode verl, whose rules tests/test_verl091_*.py check
pytestmark = pytest.mark.every_line
sync_schema = pytest.mark.skipif(
    lines.verl_line() != lines.verl_line("pinned"),
    reason="the sync-mode verl schema (use_policy_gradient, rollout_rs=token, "
           "compute_policy_loss_with_rollout_correction); the installed verl is server-mode: "
           "tests/adapters/verl/test_verl_server_tis.py / test_verl_server_metrics.py")

try:  # verl.utils.profiler imports codetiming (a pure-Python timer) that the CPU stack may lack;
    import codetiming  # noqa: F401  -- none of the functions tested here time anything
except ImportError:  # pragma: no cover - depends on the venv
    import sys
    import types

    _ct = types.ModuleType("codetiming")

    class _Timer:  # minimal stand-in: context manager / decorator that does nothing
        def __init__(self, *a, **k):
            self.last = 0.0

        def __enter__(self):
            return self

        def __exit__(self, *exc):
            return False

        def __call__(self, fn):
            return fn

    _ct.Timer = _Timer
    sys.modules["codetiming"] = _ct
from omegaconf import OmegaConf  # noqa: E402

import verl  # noqa: E402
from verl.protocol import DataProto  # noqa: E402
from verl.trainer.ppo import core_algos  # noqa: E402
from verl.trainer.ppo import rollout_corr_helper as rch  # noqa: E402

from npu_flashrl import patches  # noqa: E402
from npu_flashrl.adapters import verl as ad  # noqa: E402
from npu_flashrl.metrics import mismatch_metrics, tis_weights  # noqa: E402

P = "npu_flashrl/"
GEN_YAML = os.path.join(os.path.dirname(verl.__file__), "trainer", "config", "_generated_ppo_trainer.yaml")


def _random_batch(seed=0, B=6, T=12, scale=0.3):
    g = torch.Generator().manual_seed(seed)
    lr = -torch.rand(B, T, generator=g) * 3 - 0.01
    lt = (lr + torch.randn(B, T, generator=g) * scale).clamp(max=-1e-4)  # valid log-probs
    lengths = torch.randint(1, T + 1, (B,), generator=g)
    mask = (torch.arange(T)[None] < lengths[:, None]).float()
    return lt, lr, mask


@pytest.fixture
def warnings_log():
    h = LogRecords()
    root = logging.getLogger("npu_flashrl")
    root.addHandler(h)
    ad._last_warn.clear()
    yield h.records
    root.removeHandler(h)


# ------------------------------------------------------------------- metrics == verl's own numbers

@pytest.mark.parametrize("level", ["token", "sequence"])
@pytest.mark.parametrize("seed", [0, 1, 2])
def test_tis_weights_equal_verl(level, seed):
    lt, lr, mask = _random_batch(seed, scale=0.8)
    verl_w, _ = rch.compute_rollout_correction_weights(
        log_ratio=(lt - lr), response_mask=mask, rollout_is=level, rollout_is_threshold=1.5)
    ours = tis_weights(lt, lr, mask, level=level, threshold=1.5)
    torch.testing.assert_close(ours.float(), verl_w.float(), rtol=1e-5, atol=1e-6)
    assert (ours[mask == 0] == 0).all()
    assert (ours <= 1.5).all()


@sync_schema
def test_token_tis_stats_equal_verl():
    # all raw weights >= 1/C so verl's lower clamp for ESS does not apply
    lt, lr, mask = _random_batch(3, scale=0.3)
    C = 1.3
    lt = lr + (lt - lr).clamp(min=-math.log(C) + 1e-3)
    _, vm = rch.compute_rollout_correction_weights(log_ratio=lt - lr, response_mask=mask,
                                                   rollout_is="token", rollout_is_threshold=C)
    m = mismatch_metrics(lt, lr, mask, tis_threshold=C)
    assert m[P + "tis_token_frac_truncated"] == pytest.approx(vm["rollout_is_ratio_fraction_high"], abs=1e-6)
    assert m[P + "tis_token_ess"] == pytest.approx(vm["rollout_is_eff_sample_size"], rel=1e-4)
    # verl's rollout_is_max is the pre-truncation weight, like ours
    assert m[P + "tis_token_max"] == pytest.approx(vm["rollout_is_max"], rel=1e-5)
    assert m[P + "tis_token_frac_truncated"] > 0  # the data really exercises truncation


def test_kl_equal_verl_offpolicy_metrics():
    lt, lr, mask = _random_batch(4)
    vm = rch.compute_offpolicy_metrics(old_log_prob=lt, rollout_log_prob=lr, response_mask=mask)
    m = mismatch_metrics(lt, lr, mask)
    assert m[P + "kl_k1"] == pytest.approx(vm["kl"], rel=1e-4, abs=1e-7)
    assert m[P + "kl_k3"] == pytest.approx(vm["k3_kl"], rel=1e-4, abs=1e-7)


def test_prob_diff_and_pearson_equal_verl_debug_metrics():
    from verl.utils.debug.metrics import calculate_debug_metrics

    lt, lr, mask = _random_batch(5)
    B, T = lt.shape
    batch = DataProto.from_dict(tensors={"old_log_probs": lt, "rollout_log_probs": lr,
                                         "response_mask": mask, "responses": torch.zeros(B, T, dtype=torch.long)})
    vm = calculate_debug_metrics(batch)
    m = mismatch_metrics(lt, lr, mask)
    assert m[P + "prob_diff_max"] == pytest.approx(vm["training/rollout_probs_diff_max"], rel=1e-5)
    assert m[P + "prob_diff_mean"] == pytest.approx(vm["training/rollout_probs_diff_mean"], rel=1e-5)
    assert m[P + "prob_diff_std"] == pytest.approx(vm["training/rollout_probs_diff_std"], rel=1e-4)
    assert m[P + "prob_pearson"] == pytest.approx(vm["training/rollout_actor_probs_pearson_corr"], rel=1e-4)


# ------------------------------------------------------------------------------ callback + warning

def test_add_mismatch_metrics_from_dataproto_and_tuple(warnings_log):
    lt, lr, mask = _random_batch(6, scale=0.01)
    B, T = lt.shape
    batch = DataProto.from_dict(tensors={"old_log_probs": lt, "rollout_log_probs": lr,
                                         "attention_mask": torch.cat([torch.ones(B, 5), mask], 1),
                                         "responses": torch.zeros(B, T, dtype=torch.long)})
    metrics = {"actor/x": 1.0}
    ours = ad.add_mismatch_metrics(batch, metrics)
    assert metrics["actor/x"] == 1.0 and set(ours) <= set(metrics)
    assert ours == mismatch_metrics(lt, lr, mask)  # mask taken from attention_mask[:, -T:]
    assert ad.add_mismatch_metrics((lt, lr, mask)) == ours
    assert not warnings_log  # scale 0.01 -> error ~1.008 < 1.05
    with pytest.raises(KeyError, match="calculate_log_probs"):
        ad.add_mismatch_metrics(DataProto.from_dict(tensors={"old_log_probs": lt}), {})


def test_warning_threshold_and_env(warnings_log, monkeypatch):
    lt, lr, mask = _random_batch(7, scale=0.5)
    monkeypatch.delenv(ad.WARN_ENV, raising=False)
    m = ad.add_mismatch_metrics((lt, lr, mask), {})
    assert m[P + "token_mult_prob_error"] > 1.05
    assert len(warnings_log) == 1 and "token_mult_prob_error" in warnings_log[0].getMessage()
    assert warnings_log[0].name.startswith("npu_flashrl")
    monkeypatch.setenv(ad.WARN_ENV, "100")
    ad.add_mismatch_metrics((lt, lr, mask), {})
    assert len(warnings_log) == 1
    monkeypatch.setenv(ad.WARN_ENV, "not-a-number")
    assert ad.warn_threshold() == 1.05


# ---------------------------------------------------------------------------------- patches

def _rc_config(**kw):
    cfg = OmegaConf.load(GEN_YAML).algorithm.rollout_correction
    for k, v in kw.items():
        cfg[k] = v
    return cfg


@sync_schema
def test_driver_patch_adds_metrics_and_keeps_verl_behaviour(warnings_log):
    assert patches.apply_patch(ad.PATCH_DRIVER)
    fn = rch.compute_rollout_correction_and_add_to_batch
    assert patches.apply_patch(ad.PATCH_DRIVER)  # idempotent
    assert rch.compute_rollout_correction_and_add_to_batch is fn
    assert patches.original(fn) is not fn

    lt, lr, mask = _random_batch(8, scale=0.6)
    cfg = _rc_config(rollout_is="token", rollout_is_threshold=2.0, rollout_rs="token", rollout_rs_threshold=1.5)
    batch = DataProto.from_dict(tensors={"old_log_probs": lt, "rollout_log_probs": lr, "response_mask": mask.clone()})
    # exactly how ray_trainer.fit calls it (import at call time)
    from verl.trainer.ppo.rollout_corr_helper import compute_rollout_correction_and_add_to_batch
    batch, metrics = compute_rollout_correction_and_add_to_batch(batch, cfg)
    assert any(k.startswith("rollout_corr/") for k in metrics)  # verl's own metrics are still there
    assert not any(k.startswith("npu_flashrl/actor/") for k in metrics)
    expected = mismatch_metrics(lt, lr, mask, tis_threshold=2.0)  # on the mask BEFORE rejection sampling
    for k, v in expected.items():
        assert metrics[k] == pytest.approx(v, nan_ok=True), k
    assert not torch.equal(batch.batch["response_mask"], mask)  # verl's RS still modified the mask
    torch.testing.assert_close(batch.batch["rollout_is_weights"].float(),
                               tis_weights(lt, lr, mask, "token", 2.0).float(), rtol=1e-5, atol=1e-6)
    assert metrics[P + "token_mult_prob_error"] > 1.05 and len(warnings_log) == 1


def test_driver_patch_uses_config_threshold():
    patches.apply_patch(ad.PATCH_DRIVER)
    lt, lr, mask = _random_batch(9, scale=0.6)
    batch = DataProto.from_dict(tensors={"old_log_probs": lt, "rollout_log_probs": lr, "response_mask": mask})
    _, metrics = rch.compute_rollout_correction_and_add_to_batch(batch, _rc_config(rollout_is_threshold=3.0))
    assert metrics[P + "tis_threshold"] == 3.0


@sync_schema
def test_actor_patches_bypass_and_policy_gradient_paths():
    assert patches.apply_patch(ad.PATCH_ACTOR)
    lt, lr, mask = _random_batch(10, scale=0.2)
    expected = mismatch_metrics(lt, lr, mask, prefix="npu_flashrl/actor/")
    # dp_actor.update_policy with a PPO loss (any mode with rollout_log_probs)
    m = rch.compute_rollout_corr_metrics_from_logprobs(log_prob=lt, rollout_log_prob=lr, response_mask=mask)
    assert "rollout_corr/kl" in m
    for k, v in expected.items():
        assert m[k] == pytest.approx(v, nan_ok=True), k
    # bypass_mode + use_policy_gradient: verl's rollout_correction policy loss
    adv = torch.randn_like(lt)
    loss, pg_metrics = core_algos.compute_policy_loss_with_rollout_correction(
        rollout_log_prob=lr, log_prob=lt.clone().requires_grad_(), advantages=adv, eos_mask=mask,
        rollout_is="token", rollout_is_threshold=2.0)
    assert torch.isfinite(loss)
    assert pg_metrics["npu_flashrl/actor/token_mult_prob_error"] == pytest.approx(
        expected["npu_flashrl/actor/token_mult_prob_error"])
    assert "rollout_corr/rollout_is_mean" in pg_metrics


def test_metrics_failure_never_breaks_the_step(warnings_log, monkeypatch):
    patches.apply_patch(ad.PATCH_DRIVER)
    lt, lr, mask = _random_batch(12)
    batch = DataProto.from_dict(tensors={"old_log_probs": lt, "rollout_log_probs": lr, "response_mask": mask})

    def boom(*a, **k):
        raise RuntimeError("simulated metrics failure")

    monkeypatch.setattr(ad, "mismatch_metrics", boom)
    _, metrics = rch.compute_rollout_correction_and_add_to_batch(batch, _rc_config())
    assert "rollout_corr/kl" in metrics and not any(k.startswith(P) for k in metrics)
    assert any("simulated metrics failure" in r.getMessage() for r in warnings_log)


def test_bad_threshold_in_config_falls_back(warnings_log):
    patches.apply_patch(ad.PATCH_DRIVER)
    lt, lr, mask = _random_batch(11)
    batch = DataProto.from_dict(tensors={"old_log_probs": lt, "rollout_log_probs": lr, "response_mask": mask})
    _, metrics = rch.compute_rollout_correction_and_add_to_batch(batch, _rc_config(rollout_is_threshold=-1))
    # our threshold falls back to 2.0 on a bad value; verl itself does not use it with rollout_is=null
    assert metrics[P + "tis_threshold"] == 2.0


# ------------------------------------------------------------------------------- config checks

def _trainer_cfg(*overrides):
    cfg = OmegaConf.load(GEN_YAML)
    if overrides:
        cfg = OmegaConf.merge(cfg, OmegaConf.from_dotlist(list(overrides)))
    return cfg


def test_check_rollout_mode_async_with_flashrl_raises(monkeypatch):
    from npu_flashrl import lines
    monkeypatch.setattr(lines.verl, "verl_server_mode", lambda: False)  # the sync-mode (51d2104) branch
    cfg = _trainer_cfg("actor_rollout_ref.rollout.mode=async")
    with pytest.raises(ad.RolloutModeError, match=r"actor_rollout_ref\.rollout\.mode=sync"):
        ad.check_rollout_mode(cfg, environ={"FLASHRL_CONFIG": "/x/config.yaml"})
    # plain dict config, key missing -> verl 51d2104's default (async) -> error
    with pytest.raises(ad.RolloutModeError, match="mode=sync"):
        ad.check_rollout_mode({"actor_rollout_ref": {"rollout": {}}}, environ={"FLASHRL_CONFIG": "int8"})
    # no FLASHRL_CONFIG: async is fine, nothing quantized -> no warnings
    assert ad.check_rollout_mode(cfg, environ={}) == []


@sync_schema
def test_check_rollout_mode_warns_when_tis_off(warnings_log):
    cfg = _trainer_cfg("actor_rollout_ref.rollout.mode=sync")
    assert cfg.algorithm.rollout_correction.rollout_is is None  # verl's default
    msgs = ad.check_rollout_mode(cfg, environ={"FLASHRL_CONFIG": "int8"})
    assert len(msgs) == 1 and "TIS" in msgs[0] and "calculate_log_probs=True" in msgs[0]
    assert warnings_log and "TIS" in warnings_log[-1].getMessage()
    # TIS requested but no rollout log-probs -> verl would silently skip it
    cfg2 = _trainer_cfg("actor_rollout_ref.rollout.mode=sync", "algorithm.rollout_correction.rollout_is=token")
    msgs = ad.check_rollout_mode(cfg2, environ={"FLASHRL_CONFIG": "int8"})
    assert len(msgs) == 1 and "calculate_log_probs=True" in msgs[0]
    # explicit quantized flag without FLASHRL_CONFIG
    assert ad.check_rollout_mode(cfg, quantized=True, environ={})


@sync_schema
def test_tis_overrides_make_a_clean_config():
    ov = ad.tis_overrides()
    assert ov == ["algorithm.rollout_correction.rollout_is=token",
                  "algorithm.rollout_correction.rollout_is_threshold=2.0",
                  "algorithm.rollout_correction.bypass_mode=False",
                  "algorithm.rollout_correction.use_policy_gradient=False",
                  "actor_rollout_ref.rollout.calculate_log_probs=True",
                  "actor_rollout_ref.rollout.mode=sync"]
    cfg = _trainer_cfg(*ov)
    assert ad.check_rollout_mode(cfg, environ={"FLASHRL_CONFIG": "int8"}) == []


@sync_schema
def test_tis_overrides_keys_exist_in_verl_config_and_validate():
    from verl.trainer.config.algorithm import RolloutCorrectionConfig
    from verl.utils.config import omega_conf_to_dataclass

    ov = ad.tis_overrides("sequence", 3.0, batch_normalize=True,
                          rs="geometric", rs_threshold=1.001, rs_threshold_lower=0.999,
                          token_veto_threshold=1e-4)
    base = OmegaConf.load(GEN_YAML)
    for o in ov:
        key = o.split("=", 1)[0]
        assert OmegaConf.select(base, key, default="__missing__") != "__missing__", key
    cfg = _trainer_cfg(*ov)
    rc = omega_conf_to_dataclass(cfg.algorithm.rollout_correction, RolloutCorrectionConfig)
    assert (rc.rollout_is, rc.rollout_is_threshold, rc.bypass_mode, rc.use_policy_gradient) == ("sequence", 3.0, False, False)
    assert rc.rollout_is_batch_normalize is True and rc.rollout_rs == "geometric"
    assert rc.rollout_rs_threshold == 1.001 and rc.rollout_token_veto_threshold == 1e-4
    assert cfg.actor_rollout_ref.rollout.calculate_log_probs is True
    off = _trainer_cfg(*ad.tis_overrides(None, calculate_log_probs=False, sync_mode=False))
    assert off.algorithm.rollout_correction.rollout_is is None
    with pytest.raises(ValueError):
        ad.tis_overrides("geometric")
    with pytest.raises(ValueError):
        ad.tis_overrides("token", 0)
