"""npu_flashrl's mismatch metrics on verl 0.9.1's rollout-correction code.

Where verl 0.9.1 computes its `rollout_corr/*` metrics (read from the wheel):
- decoupled mode, once per step in the driver: `rollout_corr_helper.compute_rollout_correction_and_add_to_batch`,
  called by `RayPPOTrainer.fit` (legacy v0 trainer, imported at call time) and by the default v1
  trainer (`trainer.use_v1=true`, `trainer/ppo/v1/trainer_base.py`, imported at module level);
- bypass mode, in the actor workers' loss: `core_algos.compute_policy_loss_bypass_mode` ->
  `rollout_corr_helper.compute_rollout_correction_and_rejection_mask` (imported at call time);
- `compute_rollout_corr_metrics_from_logprobs` still exists but nothing in 0.9.1 calls it.

verl's own functions run here on a tiny CPU batch, as the trainer and the workers call them.
Stand-ins: the tensors in place of a rollout batch; for the v1 trainer module (in a fresh process:
the stubs are process-wide), `transfer_queue`, `torchdata`, HF `datasets` and `peft`, which it
imports at module level and the current CPU stack lacks, are empty modules.
"""
import json
import logging
import os
import subprocess
import sys

import pytest
import torch

from helpers import LogRecords

from npu_flashrl import lines
pytestmark = [
    pytest.mark.every_line,
    pytest.mark.skipif(not lines.verl_server_mode(),
                       reason="needs verl 0.7.1+ (rollout_correction with loss_type), e.g. 0.9.1"),
]

from npu_flashrl.adapters import verl as ad  # noqa: E402

ROOT = os.path.abspath(os.path.join(os.path.dirname(__file__), "..", "..", ".."))
B, T = 4, 8


@pytest.fixture
def warnings_log():
    handler = LogRecords()
    logger = logging.getLogger("npu_flashrl")
    logger.addHandler(handler)
    ad._last_warn.clear()
    yield handler.records
    logger.removeHandler(handler)
    ad._last_warn.clear()


@pytest.fixture(scope="module", autouse=True)
def hooks():
    assert ad.install_verl_hooks() == {ad.PATCH_DRIVER: True, ad.PATCH_ACTOR: True}


def _batch(scale, seed=0):
    g = torch.Generator().manual_seed(seed)
    old = -torch.rand(B, T, generator=g) * 2
    rollout = old + scale * torch.randn(B, T, generator=g)
    mask = torch.ones(B, T)
    mask[1, -3:] = 0
    return old, rollout, mask


@pytest.mark.parametrize("scale, warns", [(0.6, True), (0.005, False)])
def test_driver_metrics_in_decoupled_mode(scale, warns, warnings_log):
    from omegaconf import OmegaConf

    from verl import DataProto

    old, rollout, mask = _batch(scale)
    data = DataProto.from_dict(tensors={"old_log_probs": old, "rollout_log_probs": rollout,
                                        "response_mask": mask})
    rc = OmegaConf.create({"rollout_is": "token", "rollout_is_threshold": "0.5_5.0",  # IcePop form
                           "rollout_rs": "token_k1", "rollout_rs_threshold": "0.6_1.6",
                           "bypass_mode": False, "loss_type": "ppo_clip"})
    # the call RayPPOTrainer.fit makes (module attribute read at call time)
    from verl.trainer.ppo.rollout_corr_helper import compute_rollout_correction_and_add_to_batch

    data, metrics = compute_rollout_correction_and_add_to_batch(data, rc)
    err = metrics["npu_flashrl/token_mult_prob_error"]
    want = float((torch.exp((old - rollout).abs()) * mask).sum() / mask.sum())
    assert err == pytest.approx(want, rel=1e-6)  # on the mask before verl's rejection sampling
    if warns:
        assert not torch.equal(data.batch["response_mask"], mask)  # verl did reject tokens
    # next to verl's own numbers, which agree where both define the same quantity
    assert metrics["npu_flashrl/kl_k1"] == pytest.approx(metrics["rollout_corr/kl"], rel=1e-4, abs=1e-6)
    assert metrics["npu_flashrl/kl_k3"] == pytest.approx(metrics["rollout_corr/k3_kl"], rel=1e-4, abs=1e-6)
    assert metrics["npu_flashrl/tis_threshold"] == 5.0
    assert "rollout_is_weights" in data.batch.keys()
    hits = [r for r in warnings_log if "token_mult_prob_error" in r.getMessage()]
    assert (err > 1.05) == warns and bool(hits) == warns
    if warns:
        assert f"{err:.4f}" in hits[0].getMessage() and "1.0500" in hits[0].getMessage()


def test_actor_metrics_in_bypass_loss(warnings_log):
    """Bypass mode: the workers' `bypass_mode` policy loss reports npu_flashrl/actor/* with its
    own metrics (current policy vs rollout), for both loss types."""
    from verl.trainer.config.algorithm import RolloutCorrectionConfig
    from verl.trainer.ppo.core_algos import get_policy_loss_fn
    from verl.workers.config import FSDPActorConfig
    from verl.workers.config.actor import PolicyLossConfig

    _, rollout, mask = _batch(0.6)
    current = rollout + 0.6 * torch.randn(B, T, generator=torch.Generator().manual_seed(3))
    for loss_type in ("reinforce", "ppo_clip"):
        ad._last_warn.clear()
        warnings_log.clear()
        rc = RolloutCorrectionConfig(rollout_is="token", rollout_is_threshold=2.0, bypass_mode=True,
                                     loss_type=loss_type)
        cfg = FSDPActorConfig(strategy="fsdp", ppo_mini_batch_size=4, ppo_micro_batch_size_per_gpu=1,
                              use_dynamic_bsz=False, rollout_n=1,
                              policy_loss=PolicyLossConfig(loss_mode="bypass_mode", rollout_correction=rc))
        _, metrics = get_policy_loss_fn("bypass_mode")(
            old_log_prob=rollout, log_prob=current, advantages=torch.randn(B, T),
            response_mask=mask.bool(), loss_agg_mode="token-mean", config=cfg)
        err = metrics["npu_flashrl/actor/token_mult_prob_error"]
        want = float((torch.exp((current - rollout).abs()) * mask).sum() / mask.sum())
        assert err == pytest.approx(want, rel=1e-6) and err > 1.05
        assert any(k.startswith("rollout_corr/") for k in metrics)
        assert [r for r in warnings_log if "token_mult_prob_error" in r.getMessage()]


V1_CHILD = r"""
import json, sys

from npu_flashrl.sim.megatron_engine import stub_absent_modules

stub_absent_modules(("transfer_queue", "torchdata", "torchdata.stateful_dataloader", "datasets", "peft",
                     "peft.utils", "peft.utils.save_and_load"))

import verl.trainer.ppo.rollout_corr_helper as helper
order = sys.argv[1]
if order == "trainer_first":
    import verl.trainer.ppo.v1.trainer_base as trainer_base
from npu_flashrl.adapters import verl as ad
ad.install_verl_hooks()
import verl.trainer.ppo.v1.trainer_base as trainer_base
fn = trainer_base.compute_rollout_correction_and_add_to_batch
print("RESULT " + json.dumps({"wrapped": fn is helper.compute_rollout_correction_and_add_to_batch
                                         and hasattr(fn, "__wrapped__")}))
"""


@pytest.mark.parametrize("order", ["trainer_first", "hooks_first"])
def test_v1_trainer_gets_the_driver_hook(order):
    """verl 0.9's default trainer binds the driver function when its module is imported: our
    hook reaches it whether that import comes before or after the patch."""
    env = dict(os.environ, TORCH_DEVICE_BACKEND_AUTOLOAD="0", VLLM_PLUGINS="none",
               PYTHONPATH=os.pathsep.join(p for p in (ROOT, os.environ.get("PYTHONPATH")) if p))
    env.pop("FLASHRL_CONFIG", None)
    proc = subprocess.run([sys.executable, "-W", "ignore", "-c", V1_CHILD, order], env=env,
                          capture_output=True, text=True, timeout=300)
    lines = [line for line in proc.stdout.splitlines() if line.startswith("RESULT ")]
    assert proc.returncode == 0 and lines, proc.stdout[-2000:] + proc.stderr[-3000:]
    assert json.loads(lines[-1][len("RESULT "):]) == {"wrapped": True}
