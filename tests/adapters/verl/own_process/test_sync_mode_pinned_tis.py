"""TIS at verl 51d2104, driven through verl's OWN code (the published recipe's TIS computes no IS weights there).

verl 51d2104 has no registry release: these tests use its source tree from ../shared/upstream (the
`verl_51d2104` fixture puts it first on sys.path and skips, saying how to get it, when it is absent).

What runs for real: verl's driver-side `compute_rollout_correction_and_add_to_batch` (decoupled mode)
and `apply_rollout_correction` (bypass mode), verl's config schema and `omega_conf_to_dataclass`
(how the Ray workers build their actor config at init), and `DataParallelPPOActor.update_policy`
(the FSDP actor's loss and backward) on a tiny Qwen2 HF model on the CPU.

Stand-ins, each for what needs a cluster: `torch.distributed.get_rank` returns 0 (one process, no
process group; the actor only prints on rank 0 and reads it in a warning); the Megatron actor needs
Megatron-Core + an NPU to import, so its loss path is checked on its source text (it selects
`rollout_is_weights` and hands it to the same `get_policy_loss_fn(loss_mode)` as the FSDP actor).
"""
import ast
import os
import subprocess
import sys

import pytest
import torch

from npu_flashrl.adapters import verl as ad

pytestmark = pytest.mark.every_line

HERE = os.path.dirname(os.path.abspath(__file__))
RECIPES = os.path.join(HERE, "..", "..", "..", "verl_examples", "configs")
RC = "algorithm.rollout_correction."

# The recipes' TIS settings (tests/verl_examples/common.sh defaults).
RECIPE_TIS = dict(level="sequence", threshold=2.0, batch_normalize=True)
BROKEN = (RC + "bypass_mode=True", RC + "use_policy_gradient=True")  # the published Ascend recipe's


# ---------------------------------------------------------------------------------- recipes

def _dry_run(script, tmp_path, *extra, **env_extra):
    model = tmp_path / "model"
    model.mkdir(exist_ok=True)
    (model / "config.json").write_text("{}")
    data = tmp_path / "train.parquet"
    data.write_text("")
    cfg = tmp_path / "flashrl.yaml"
    cfg.write_text("configs:\n  - fn: int8_profile_free\n")
    env = dict(os.environ, MODEL_PATH=str(model), TRAIN_FILE=str(data), VAL_FILE=str(data),
               FLASHRL_CONFIG=str(cfg), PYTHON=sys.executable, **env_extra)
    return subprocess.run(["bash", os.path.join(RECIPES, script), "--dry-run", *extra], env=env,
                          capture_output=True, text=True)


@pytest.mark.parametrize("script", ["test_grpo_qwen25_7b_fsdp_int8_A2.sh",
                                    "test_grpo_qwen25_7b_megatron_int8_A2.sh"])
def test_recipes_use_the_tis_overrides_of_the_adapter(script, tmp_path):
    from npu_flashrl.verify import read_overrides

    proc = _dry_run(script, tmp_path)
    assert proc.returncode == 0, proc.stderr
    overrides, _ = read_overrides(proc.stdout)
    recipe = sorted(o for o in overrides if o.startswith(RC))
    want = sorted(o for o in ad.tis_overrides(**RECIPE_TIS, verl="51d2104") if o.startswith(RC))
    assert recipe == want
    assert set(ad.tis_overrides(**RECIPE_TIS, verl="51d2104")) <= set(overrides)
    ad.check_rollout_mode(ad.overrides_to_config(overrides), environ={"FLASHRL_CONFIG": "x"},
                          verl="51d2104")


@pytest.mark.parametrize("env, extra, needle", [
    ({"TIS_BYPASS_MODE": "True"}, (), "bypass mode computes no IS weights"),
    ({"TIS_USE_POLICY_GRADIENT": "True"}, (), "never reaches the Ray workers"),
    ({}, BROKEN, "never reaches the Ray workers"),
    ({}, (RC + "bypass_mode=true",), "bypass mode computes no IS weights"),
])
def test_recipe_preflight_refuses_the_combination_without_tis(env, extra, needle, tmp_path):
    proc = _dry_run("test_grpo_qwen25_7b_fsdp_int8_A2.sh", tmp_path, *extra, **env)
    assert proc.returncode == 1
    assert needle in proc.stderr and "TIS_BYPASS_MODE=False TIS_USE_POLICY_GRADIENT=False" in proc.stderr
    assert "verl.trainer.main_ppo" not in proc.stdout  # nothing printed to launch
    # bypass without TIS (rollout_is=null) is plain bypass PPO: allowed
    ok = _dry_run("test_grpo_qwen25_7b_fsdp_int8_A2.sh", tmp_path, TIS_BYPASS_MODE="True",
                  TIS_LEVEL="null")
    assert ok.returncode == 0, ok.stderr


def test_verify_refuses_the_broken_overrides(tmp_path):
    from npu_flashrl import verify
    from npu_flashrl.verify import verl_rows

    proc = _dry_run("test_grpo_qwen25_7b_fsdp_int8_A2.sh", tmp_path)
    good = tmp_path / "good.txt"
    good.write_text(proc.stdout)
    assert [r["status"] for r in verl_rows(str(good), "51d2104")] == [verify.OK]
    bad = tmp_path / "bad.txt"
    bad.write_text("\n".join(BROKEN[:1] + (RC + "rollout_is=token",
                                           "actor_rollout_ref.rollout.mode=sync",
                                           "actor_rollout_ref.rollout.calculate_log_probs=True")))
    rows = verl_rows(str(bad), "51d2104")
    assert rows[0]["status"] == verify.FAIL and "computes no IS weights" in rows[0]["detail"]
    assert "bypass_mode=False" in rows[0]["fix"]
    with pytest.raises(ad.TisConfigError, match="use_policy_gradient=True"):
        ad.tis_overrides(use_policy_gradient=True, verl="51d2104")
    with pytest.raises(ad.TisConfigError, match="bypass_mode=True"):
        ad.tis_overrides(bypass_mode=True, verl="51d2104")


# --------------------------------------------------------------------- verl 51d2104's own code

def _trainer_cfg(tree, *overrides):
    from omegaconf import OmegaConf

    cfg = OmegaConf.load(os.path.join(tree, "verl", "trainer", "config", "_generated_ppo_trainer.yaml"))
    return OmegaConf.merge(cfg, OmegaConf.from_dotlist(list(overrides)))


def _batch(B=4, P=3, R=6, seed=0):
    """A tiny rollout batch: prompts + responses, rollout log-probs and trainer log-probs that differ
    enough for some IS weights to exceed the truncation threshold."""
    from verl.protocol import DataProto

    g = torch.Generator().manual_seed(seed)
    input_ids = torch.randint(0, 512, (B, P + R), generator=g)
    lengths = torch.tensor([R, R - 2, R - 1, 2])[:B]
    response_mask = (torch.arange(R)[None] < lengths[:, None]).float()
    attention_mask = torch.cat([torch.ones(B, P), response_mask], dim=1).long()
    rollout = -torch.rand(B, R, generator=g) * 2 - 0.05
    old = rollout + torch.randn(B, R, generator=g) * 0.8
    batch = DataProto.from_dict(tensors={
        "input_ids": input_ids, "attention_mask": attention_mask,
        "position_ids": torch.arange(P + R).expand(B, -1).clone(),
        "responses": input_ids[:, P:], "response_mask": response_mask,
        "old_log_probs": old, "rollout_log_probs": rollout,
        "advantages": torch.randn(B, R, generator=g) * response_mask,
    }, meta_info={"temperature": 1.0})
    return batch


def _actor(tree, cfg, monkeypatch, tmp_path):
    """verl's DataParallelPPOActor on a tiny HF Qwen2 with the worker's actor config dataclass."""
    from verl.utils.config import omega_conf_to_dataclass
    from verl.workers.actor.dp_actor import DataParallelPPOActor

    from npu_flashrl.sim.tiny_models import build_tiny_qwen2

    monkeypatch.setattr(torch.distributed, "get_rank", lambda *a, **k: 0)  # stand-in: one process
    model = build_tiny_qwen2(str(tmp_path / "hf"), dtype=torch.float32, seed=0, tokenizer=False)
    actor_cfg = omega_conf_to_dataclass(cfg.actor_rollout_ref.actor)  # as fsdp_workers does at init
    opt = torch.optim.SGD(model.parameters(), lr=0.0)  # lr 0: every call sees the same weights
    return DataParallelPPOActor(actor_cfg, model, opt), actor_cfg


ACTOR_OVERRIDES = ("actor_rollout_ref.actor.ppo_mini_batch_size=4",
                   "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=4",
                   "actor_rollout_ref.actor.use_dynamic_bsz=False",
                   "actor_rollout_ref.actor.use_kl_loss=False",
                   "actor_rollout_ref.actor.entropy_coeff=0",
                   "actor_rollout_ref.actor.use_torch_compile=False",
                   "actor_rollout_ref.actor.fsdp_config.dtype=float32")


def _token_mean(x, mask):
    return (x * mask).sum() / mask.sum()


@pytest.mark.parametrize("level", ["token", "sequence"])
def test_decoupled_mode_multiplies_truncated_weights_into_the_actor_loss(verl_51d2104, level,
                                                                        monkeypatch, tmp_path):
    from verl.trainer.ppo.rollout_corr_helper import compute_rollout_correction_and_add_to_batch

    tis = dict(RECIPE_TIS, level=level)
    cfg = _trainer_cfg(verl_51d2104, *ad.tis_overrides(**tis, verl="51d2104"), *ACTOR_OVERRIDES)
    rc = cfg.algorithm.rollout_correction
    assert not rc.bypass_mode  # ray_trainer.fit takes the decoupled branch and calls the driver function
    batch = _batch()
    batch, metrics = compute_rollout_correction_and_add_to_batch(batch, rc)
    w = batch.batch["rollout_is_weights"]
    mask = batch.batch["response_mask"]
    assert "rollout_corr/rollout_is_mean" in metrics
    valid = w[mask.bool()]
    assert (valid - 1).abs().max() > 0.1  # weights that matter
    # truncated at the threshold before batch normalisation
    raw_max = metrics.get("rollout_corr/rollout_is_batch_norm_factor", 1.0) * valid.max()
    assert raw_max <= 2.0 + 1e-5

    actor, actor_cfg = _actor(verl_51d2104, cfg, monkeypatch, tmp_path)
    assert actor_cfg.policy_loss.loss_mode == "vanilla"
    with_w = actor.update_policy(batch)
    no_w = batch.select(batch_keys=[k for k in batch.batch.keys() if k != "rollout_is_weights"],
                        meta_info_keys=["temperature"])
    without = actor.update_policy(no_w)
    # on-policy step (1 mini-batch, 1 epoch): ratio == 1, so the PPO-clip loss is -A (times w)
    adv = batch.batch["advantages"]
    got_w, got = with_w["actor/pg_loss"][0], without["actor/pg_loss"][0]
    assert got_w == pytest.approx(_token_mean(-adv * w, mask).item(), rel=1e-5, abs=1e-7)
    assert got == pytest.approx(_token_mean(-adv, mask).item(), rel=1e-5, abs=1e-7)
    assert got_w != pytest.approx(got, rel=1e-3)
    assert with_w["actor/grad_norm"][0] != pytest.approx(without["actor/grad_norm"][0], rel=1e-3)


def test_published_bypass_policy_gradient_combination_computes_no_weights(verl_51d2104, monkeypatch,
                                                                          tmp_path):
    """Documents the defect with verl's own functions: what the trainer does in bypass mode, and what
    the workers' actor config keeps."""
    from omegaconf import OmegaConf
    from verl.trainer.ppo.rollout_corr_helper import apply_rollout_correction

    cfg = _trainer_cfg(verl_51d2104, RC + "rollout_is=sequence", RC + "rollout_is_batch_normalize=True",
                       *BROKEN, *ACTOR_OVERRIDES)
    with pytest.raises(ad.TisConfigError):
        ad.check_tis(cfg, "51d2104")
    # the workers build their actor config at init (fsdp_workers: omega_conf_to_dataclass), before fit
    actor, actor_cfg = _actor(verl_51d2104, cfg, monkeypatch, tmp_path)
    batch = _batch()
    rollout = batch.batch["rollout_log_probs"].clone()
    apply_rollout_correction(batch=batch, rollout_corr_config=cfg.algorithm.rollout_correction,
                             policy_loss_config=cfg.actor_rollout_ref.actor.policy_loss)
    assert "rollout_is_weights" not in batch.batch.keys()  # no IS weights computed
    assert torch.equal(batch.batch["old_log_probs"], rollout)
    # the loss switch lands in the driver's config only; the workers keep the vanilla loss
    assert OmegaConf.select(cfg, "actor_rollout_ref.actor.policy_loss.loss_mode") == "rollout_correction"
    assert actor_cfg.policy_loss.loss_mode == "vanilla"
    assert not hasattr(actor_cfg.policy_loss, "rollout_correction")
    out = actor.update_policy(batch)
    mask, adv = batch.batch["response_mask"], batch.batch["advantages"]
    # the actor's loss is the plain PPO-clip loss: no weight, no threshold, no normalisation
    assert out["actor/pg_loss"][0] == pytest.approx(_token_mean(-adv, mask).item(), rel=1e-5, abs=1e-7)


def _source(tree, rel):
    with open(os.path.join(tree, rel), encoding="utf-8") as fh:
        return ast.parse(fh.read())


def test_ray_trainer_computes_weights_only_in_decoupled_mode(verl_51d2104):
    """ray_trainer.fit needs Ray + workers: read the guard of its one call of the driver function."""
    tree = _source(verl_51d2104, "verl/trainer/ppo/ray_trainer.py")
    guards = []
    for node in ast.walk(tree):
        if isinstance(node, ast.If):
            calls = [n for stmt in node.body for n in ast.walk(stmt)
                     if isinstance(n, ast.Call) and getattr(n.func, "id", None)
                     == "compute_rollout_correction_and_add_to_batch"]
            if calls:
                guards.append(ast.unparse(node.test))
    assert len(guards) == 1 and "not bypass_recomputing_logprobs" in guards[0], guards


@pytest.mark.parametrize("rel", ["verl/workers/actor/dp_actor.py", "verl/workers/actor/megatron_actor.py"])
def test_both_actors_hand_the_weights_to_the_same_policy_loss(verl_51d2104, rel):
    """The Megatron actor cannot be imported on a CPU (Megatron-Core): its loss path, like the FSDP
    actor's, selects rollout_is_weights and passes them to core_algos.get_policy_loss_fn(loss_mode)."""
    tree = _source(verl_51d2104, rel)
    text = ast.unparse(tree)
    assert "select_keys.append('rollout_is_weights')" in text
    assert "policy_loss_fn = get_policy_loss_fn(loss_mode)" in text
    calls = [n for n in ast.walk(tree) if isinstance(n, ast.Call) and getattr(n.func, "id", None) == "policy_loss_fn"]
    assert calls and all(any(k.arg == "rollout_is_weights" for k in c.keywords) for c in calls)
    imports = [n for n in ast.walk(tree) if isinstance(n, ast.ImportFrom) and n.module == "verl.trainer.ppo.core_algos"]
    assert any(a.name == "get_policy_loss_fn" for n in imports for a in n.names)
