"""TIS on verl 0.7+ (0.9.1): which `algorithm.rollout_correction` combination really multiplies
the truncated IS weights into the policy loss, with verl's own driver and loss code.

verl's functions run as the trainer calls them: `compute_rollout_correction_and_add_to_batch`
(driver, decoupled mode), `apply_bypass_mode` (driver, bypass mode), the registered policy
losses (`get_policy_loss_fn`) and the workers' `ppo_loss` (`verl/workers/utils/losses.py`) on
an actor config built the way `engine_workers` builds it at init (`omega_conf_to_dataclass` of
verl's own trainer config with the overrides merged in struct mode, as Hydra does).

Stand-ins: the tensors are small CPU tensors in place of a rollout batch, and the trainer's
log-probs handed to `ppo_loss` are given instead of coming from a model forward (the engine's
`forward_step` output, which needs the FSDP process group); `batch_num_tokens` / `dp_size`, which
the engine all-reduces over the data-parallel group, are set for one rank. HF `datasets`, which
`verl.workers.utils.losses` imports through `verl.utils.dataset` (the RL dataset loader) and the
current CPU stack lacks, is an empty module (with a `Dataset` name) when it is not installed.
"""
import os

import pytest
import torch
from helpers import masked_mean, ppo_clip_per_token

from npu_flashrl import lines
from npu_flashrl.adapters import verl as ad

pytestmark = [
    pytest.mark.every_line,
    pytest.mark.skipif(not lines.verl_server_mode(),
                       reason="needs verl 0.7.1+ (rollout_correction with loss_type), e.g. 0.9.1"),
]

B, T, THRESHOLD = 4, 6, 2.0


@pytest.fixture()
def batch():
    torch.manual_seed(0)
    old = -torch.rand(B, T)
    rollout = old + 0.8 * torch.randn(B, T)  # an INT8 rollout disagreeing with the trainer
    current = old + 0.05 * torch.randn(B, T)
    mask = torch.ones(B, T)
    mask[0, -2:] = 0
    return dict(old=old, rollout=rollout, current=current, mask=mask, adv=torch.randn(B, T))


def _actor_config(loss_mode="vanilla", **rollout_correction):
    from verl.trainer.config.algorithm import RolloutCorrectionConfig
    from verl.workers.config import FSDPActorConfig
    from verl.workers.config.actor import PolicyLossConfig

    policy_loss = PolicyLossConfig(loss_mode=loss_mode,
                                   rollout_correction=RolloutCorrectionConfig(**rollout_correction))
    return FSDPActorConfig(strategy="fsdp", ppo_mini_batch_size=4, ppo_micro_batch_size_per_gpu=1,
                           use_dynamic_bsz=False, rollout_n=1, policy_loss=policy_loss)


def test_decoupled_mode_multiplies_truncated_is_weights_into_the_loss(batch):
    from verl import DataProto
    from verl.trainer.config.algorithm import RolloutCorrectionConfig
    from verl.trainer.ppo.core_algos import get_policy_loss_fn
    from verl.trainer.ppo.rollout_corr_helper import compute_rollout_correction_and_add_to_batch

    data = DataProto.from_dict(tensors={"old_log_probs": batch["old"],
                                        "rollout_log_probs": batch["rollout"],
                                        "response_mask": batch["mask"]})
    rc = RolloutCorrectionConfig(rollout_is="token", rollout_is_threshold=THRESHOLD, bypass_mode=False)
    data, _ = compute_rollout_correction_and_add_to_batch(data, rc)
    w = data.batch["rollout_is_weights"]
    want_w = torch.clamp(torch.exp(batch["old"] - batch["rollout"]), max=THRESHOLD) * batch["mask"]
    torch.testing.assert_close(w, want_w)
    assert (w[batch["mask"].bool()] < 1).any() and (w == THRESHOLD).any()  # both sides exercised

    cfg = _actor_config()
    assert cfg.policy_loss.loss_mode == "vanilla"
    loss_fn = get_policy_loss_fn(cfg.policy_loss.loss_mode)
    args = dict(old_log_prob=batch["old"], log_prob=batch["current"], advantages=batch["adv"],
                response_mask=batch["mask"].bool(), loss_agg_mode="token-mean", config=cfg)
    weighted, _ = loss_fn(rollout_is_weights=w, **args)
    plain, _ = loss_fn(rollout_is_weights=None, **args)
    pg = ppo_clip_per_token(cfg, batch["old"], batch["current"], batch["adv"])
    torch.testing.assert_close(weighted, masked_mean(pg * w, batch["mask"]))
    torch.testing.assert_close(plain, masked_mean(pg, batch["mask"]))
    assert not torch.isclose(weighted, plain)


@pytest.mark.parametrize("loss_type", ["reinforce", "ppo_clip"])
def test_bypass_mode_loss_types(batch, loss_type):
    """Bypass mode (old_log_probs := rollout_log_probs): verl's bypass loss multiplies IS weights
    in only for loss_type=reinforce; ppo_clip computes them for metrics and leaves them out."""
    from omegaconf import OmegaConf

    from verl import DataProto
    from verl.trainer.config.algorithm import RolloutCorrectionConfig
    from verl.trainer.ppo.core_algos import get_policy_loss_fn
    from verl.trainer.ppo.rollout_corr_helper import apply_bypass_mode

    data = DataProto.from_dict(tensors={"old_log_probs": batch["old"],
                                        "rollout_log_probs": batch["rollout"],
                                        "response_mask": batch["mask"]})
    rc = RolloutCorrectionConfig(rollout_is="token", rollout_is_threshold=THRESHOLD, bypass_mode=True,
                                 loss_type=loss_type)
    driver_policy_loss = OmegaConf.create({"loss_mode": "vanilla"})
    apply_bypass_mode(batch=data, rollout_corr_config=rc, policy_loss_config=driver_policy_loss)
    assert torch.equal(data.batch["old_log_probs"], batch["rollout"])
    assert driver_policy_loss.loss_mode == "bypass_mode"  # the DRIVER's copy (see docs)

    # what a worker's own actor config would need to say for this loss to run there
    cfg = _actor_config("bypass_mode", rollout_is="token", rollout_is_threshold=THRESHOLD,
                        bypass_mode=True, loss_type=loss_type)
    loss, _ = get_policy_loss_fn("bypass_mode")(
        old_log_prob=data.batch["old_log_probs"], log_prob=batch["current"],
        advantages=batch["adv"], response_mask=batch["mask"].bool(), loss_agg_mode="token-mean",
        config=cfg)
    mask = batch["mask"]
    w = torch.clamp(torch.exp(batch["current"] - batch["rollout"]), max=THRESHOLD)
    if loss_type == "reinforce":
        want = masked_mean(-batch["adv"] * w.detach() * batch["current"], mask)
    else:
        want = masked_mean(ppo_clip_per_token(cfg, batch["rollout"], batch["current"],
                                                batch["adv"]), mask)
    torch.testing.assert_close(loss, want)


# ------------------------------------------------------------------ the overrides npu_flashrl writes

RC = "algorithm.rollout_correction."
WL = "actor_rollout_ref.actor.policy_loss."
SIZES = ("actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=1", "actor_rollout_ref.rollout.n=1")


def _verl_cfg(*overrides):
    """verl 0.9.1's own trainer config with Hydra-style overrides (struct mode: an unknown key is
    refused, as `main_ppo` refuses it; a `+key` may add one)."""
    import yaml
    from omegaconf import OmegaConf, open_dict

    import verl

    cfg = OmegaConf.load(os.path.join(os.path.dirname(verl.__file__), "trainer", "config",
                                      "_generated_ppo_trainer.yaml"))
    OmegaConf.set_struct(cfg, True)
    for ov in overrides:
        key, _, value = ov.partition("=")
        if key.startswith("+"):
            with open_dict(cfg):
                OmegaConf.update(cfg, key[1:], yaml.safe_load(value), force_add=True)
        else:
            cfg = OmegaConf.merge(cfg, OmegaConf.from_dotlist([ov]))
    return cfg


def _import_losses():
    import importlib.util
    import sys
    import types

    stub = None
    if "datasets" not in sys.modules and importlib.util.find_spec("datasets") is None:  # dataset loader only
        stub = types.ModuleType("datasets")
        stub.Dataset = object  # rl_dataset's annotations are evaluated at import
        sys.modules["datasets"] = stub
    try:
        from verl.workers.utils import losses
    finally:
        # verl's modules keep the stub they bound; later tests in this process (a fresh process
        # for the Megatron pin's, which asks whether `datasets` is installed) must not find it
        if stub is not None and sys.modules.get("datasets") is stub:
            del sys.modules["datasets"]
    return losses


def _worker_loss(actor_cfg, batch, weights=None):
    """The actor worker's loss: `partial(ppo_loss, config=omega_conf_to_dataclass(config.actor))`
    as `engine_workers` builds it at init, on the trainer's log-probs of a micro-batch."""
    from tensordict import TensorDict

    from verl.utils import tensordict_utils as tu
    from verl.utils.config import omega_conf_to_dataclass

    ppo_loss = _import_losses().ppo_loss

    config = omega_conf_to_dataclass(actor_cfg)
    mask = batch["mask"]
    prompt = 2
    # no-padding model output: one row per sequence, prompt + its valid response tokens; the
    # log-prob of response token j sits at position prompt - 1 + j (verl shifts by one)
    lens = mask.sum(-1).long()
    flat = torch.cat([torch.cat([torch.zeros(prompt - 1), batch["current"][i, :n], torch.zeros(1)])
                      for i, n in enumerate(lens.tolist())])
    tensors = {"prompts": torch.ones(B, prompt, dtype=torch.long),
               "responses": torch.ones(B, T, dtype=torch.long),
               "attention_mask": torch.cat([torch.ones(B, prompt), mask], dim=-1).long(),
               "response_mask": mask, "old_log_probs": batch["old"], "advantages": batch["adv"]}
    if weights is not None:
        tensors["rollout_is_weights"] = weights
    data = TensorDict(tensors, batch_size=[B])
    tu.assign_non_tensor(data, dp_size=1, batch_num_tokens=int(mask.sum()), global_batch_size=B)
    loss, _ = ppo_loss(config, {"log_probs": flat}, data)
    return config, loss


def test_recommended_overrides_multiply_is_weights_into_the_workers_loss(batch):
    """`tis_overrides(verl="0.9")` on verl 0.9.1's config: the driver's decoupled-mode step puts
    truncated IS weights into the batch and the workers' `ppo_loss` multiplies them in."""
    from verl import DataProto
    from verl.trainer.ppo.rollout_corr_helper import compute_rollout_correction_and_add_to_batch

    overrides = ad.tis_overrides(verl="0.9")
    assert not any("use_policy_gradient" in o or "rollout.mode" in o for o in overrides)
    cfg = _verl_cfg(*overrides, *SIZES)
    assert ad.check_rollout_mode(cfg, environ={"FLASHRL_CONFIG": "int8.yaml"}, verl="0.9") == []

    rc = cfg.algorithm.get("rollout_correction", None)  # what RayPPOTrainer.fit reads
    assert not rc.get("bypass_mode", False)  # -> decoupled: old_log_probs recomputed, then ...
    data = DataProto.from_dict(tensors={"old_log_probs": batch["old"],
                                        "rollout_log_probs": batch["rollout"],
                                        "response_mask": batch["mask"]})
    data, _ = compute_rollout_correction_and_add_to_batch(data, rc)
    w = data.batch["rollout_is_weights"]
    assert (w[batch["mask"].bool()] < 1).any() and (w == THRESHOLD).any()

    config, weighted = _worker_loss(cfg.actor_rollout_ref.actor, batch, w)
    _, plain = _worker_loss(cfg.actor_rollout_ref.actor, batch)
    assert config.policy_loss.loss_mode == "vanilla"
    pg = ppo_clip_per_token(config, batch["old"], batch["current"], batch["adv"])
    torch.testing.assert_close(weighted, masked_mean(pg * w, batch["mask"]))
    torch.testing.assert_close(plain, masked_mean(pg, batch["mask"]))
    assert not torch.isclose(weighted, plain)


def test_bypass_mode_is_refused_and_its_workers_get_no_is_weights(batch):
    """Bypass mode with TIS: refused by check_tis for both loss types, and verl's own code shows
    why: after `apply_bypass_mode` (driver) the workers, whose actor config was built at init,
    run the same loss with or without the TIS settings (no IS weights in it)."""
    from verl import DataProto
    from verl.trainer.ppo.rollout_corr_helper import apply_bypass_mode

    for loss_type, reason in (("ppo_clip", "for metrics only"), ("reinforce", "driver's copy")):
        overrides = (RC + "rollout_is=token", RC + "bypass_mode=True", RC + f"loss_type={loss_type}")
        cfg = _verl_cfg(*overrides, *SIZES)
        with pytest.raises(ad.TisConfigError, match=reason) as err:
            ad.check_tis(cfg, "0.9")
        assert "bypass_mode=False" in str(err.value).split("Fix:")[1]

        worker_actor = cfg.actor_rollout_ref.actor.copy()  # the workers' config, built at init
        data = DataProto.from_dict(tensors={"old_log_probs": batch["old"],
                                            "rollout_log_probs": batch["rollout"],
                                            "response_mask": batch["mask"]})
        apply_bypass_mode(batch=data, rollout_corr_config=cfg.algorithm.rollout_correction,
                          policy_loss_config=cfg.actor_rollout_ref.actor.policy_loss)
        assert cfg.actor_rollout_ref.actor.policy_loss.loss_mode == "bypass_mode"  # driver only
        assert "rollout_is_weights" not in data.batch.keys()
        on_rollout = dict(batch, old=data.batch["old_log_probs"])
        config, loss = _worker_loss(worker_actor, on_rollout)
        assert config.policy_loss.loss_mode == "vanilla"
        _, without_tis = _worker_loss(_verl_cfg(RC + "bypass_mode=True", *SIZES).actor_rollout_ref.actor,
                                      on_rollout)
        torch.testing.assert_close(loss, without_tis)  # rollout_is / threshold changed nothing


def test_bypass_reinforce_with_the_workers_configured_from_the_start(batch):
    """The one bypass combination that does TIS: the workers start with the bypass loss and
    `loss_type=reinforce`; check_tis accepts it and the workers' loss carries the weights."""
    overrides = (RC + "rollout_is=token", RC + "bypass_mode=True", RC + "loss_type=reinforce",
                 WL + "loss_mode=bypass_mode", "+" + WL + "rollout_correction.loss_type=reinforce",
                 "+" + WL + "rollout_correction.rollout_is=token",
                 "+" + WL + f"rollout_correction.rollout_is_threshold={THRESHOLD}")
    cfg = _verl_cfg(*overrides, *SIZES)
    ad.check_tis(cfg, "0.9")
    on_rollout = dict(batch, old=batch["rollout"])
    config, loss = _worker_loss(cfg.actor_rollout_ref.actor, on_rollout)
    assert config.policy_loss.loss_mode == "bypass_mode"
    w = torch.clamp(torch.exp(batch["current"] - batch["rollout"]), max=THRESHOLD)
    torch.testing.assert_close(loss, masked_mean(-batch["adv"] * w * batch["current"], batch["mask"]))


@pytest.mark.parametrize("overrides, reason", [
    ((RC + "use_policy_gradient=False",), "replaced by loss_type"),
    ((RC + "rollout_token_veto_threshold=5.0",), "does not exist at verl 0.7+"),
    ((RC + "rollout_is=token", WL + "loss_mode=bypass_mode"), "ignores the batch's rollout_is_weights"),
    ((RC + "bypass_mode=True", RC + "loss_type=pg"), "takes ppo_clip or reinforce"),
])
def test_check_tis_refuses_with_the_reason(overrides, reason):
    from omegaconf.errors import ConfigKeyError

    config = ad.overrides_to_config(overrides)
    with pytest.raises(ad.TisConfigError, match=reason):
        ad.check_tis(config, "0.9")
    if reason.startswith(("replaced", "does not exist")):
        with pytest.raises(ConfigKeyError):  # verl itself would not start with it
            _verl_cfg(*overrides)
    if "use_policy_gradient" in overrides[0]:
        ad.check_tis(config, "51d2104")  # the pin's own key: fine on that line


def test_tis_overrides_refuse_what_verl_09_does_not_have():
    assert ad.tis_overrides(verl="0.9.1") == ad.tis_overrides() == [
        RC + "rollout_is=token", RC + "rollout_is_threshold=2.0", RC + "bypass_mode=False",
        "actor_rollout_ref.rollout.calculate_log_probs=True"]  # the installed verl is 0.9.1
    assert ad.tis_overrides("sequence", 3.0, batch_normalize=True, rs="seq_mean_k3", rs_threshold=0.01,
                            verl="0.9")[3:5] == [RC + "rollout_is_batch_normalize=True",
                                                 RC + "rollout_rs=seq_mean_k3"]
    for kwargs, err, needle in [(dict(use_policy_gradient=True), ad.TisConfigError, "replaced by loss_type"),
                                (dict(bypass_mode=True), ad.TisConfigError, "for metrics only"),
                                (dict(sync_mode=True), ValueError, "server only"),
                                (dict(token_veto_threshold=5.0), ValueError, "rollout_token_veto_threshold"),
                                (dict(rs="geometric"), ValueError, "seq_mean_k1")]:
        with pytest.raises(err, match=needle):
            ad.tis_overrides(verl="0.9", **kwargs)
    with pytest.raises(ValueError, match="51d2104, 0.9"):
        ad.tis_overrides(verl="0.8")
    assert RC + "use_policy_gradient=False" in ad.tis_overrides(verl="51d2104")


def test_verify_knows_verl_091_keys(tmp_path):
    from npu_flashrl import verify

    good = tmp_path / "good.txt"
    good.write_text("\n".join(ad.tis_overrides(verl="0.9")))
    rows = verify.verl_rows(str(good))
    assert [r["status"] for r in rows] == [verify.OK] and "verl 0.9" in rows[0]["detail"]
    bad = tmp_path / "bad.txt"
    bad.write_text("\n".join([RC + "rollout_is=token", RC + "bypass_mode=True",
                              RC + "use_policy_gradient=True",
                              "actor_rollout_ref.rollout.calculate_log_probs=True"]))
    rows = verify.verl_rows(str(bad))
    assert rows[0]["status"] == verify.FAIL
    assert "use_policy_gradient does not exist" in rows[0]["detail"]
    assert "for metrics only" in rows[0]["detail"] and "bypass_mode=False" in rows[0]["fix"]
