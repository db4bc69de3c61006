"""verl 0.9.1's Megatron engine -> verl's bucketed sync -> npu_flashrl's INT8 rollout, on CPU.

Two trainer ranks (TP=2, gloo), each a process running verl 0.9.1's own `MegatronEngineWithLMHead`
(`npu_flashrl.sim.megatron_engine`: megatron-core 0.16.0 + mbridge 0.15.1): the engine builds the
tiny Qwen2 with megatron-core's tensor-parallel layers, loads the HF checkpoint through the
bridge, and for each sync loads the next checkpoint (the trainer's weights after a step) and
runs `get_per_tensor_param` (mbridge's `export_weights`: TP all-gather over gloo, q/k/v and
gate/up split, HF names). Rank 0 streams it with verl's real `BucketedWeightSender` into verl's
real `update_weights_from_ipc` in this process, on a vLLM model built on vllm-ascend's
W8A8_DYNAMIC layers through npu_flashrl (tests/support/verl_server_rig.py). The same for a
tiny Qwen3-MoE with expert parallel 2 (mbridge's EP all-gather; vllm-ascend's W8A8_DYNAMIC
fused-MoE layers on the receiver).

Stand-ins: the engine's are listed in `npu_flashrl/sim/megatron_engine.py` (CPU verl platform,
CPU RNG tracker, `torch.cuda.current_device`/`Module.cuda`, megatron-core's local layer spec
instead of TransformerEngine with mbridge reading its norm names, peft/datasets stubs, the engine
built `forward_only` (no optimizer: it allocates on 'cuda'), mbridge instead of Megatron-Bridge
(needs Python >= 3.12)); the receiver's in tests/support/verl_server_rig.py (verl's device helpers in
the transfer, the vLLM worker object, plain attention, emulated torch_npu).

megatron-core and mbridge are not in the current line's venv (the pinned-line Megatron tests
would pick them up): they live in an overlay directory, `<venv>/megatron-overlay`
(scripts/bootstrap_cpu_stack.sh, requirements/cpu-stack-current-megatron.txt) or
NPU_FLASHRL_MEGATRON_OVERLAY, put on the rank processes' PYTHONPATH only.
"""
import json
import os

import pytest

from npu_flashrl import lines
pytestmark = [
    pytest.mark.every_line,
    pytest.mark.skipif(not lines.verl_server_mode(),
                       reason="needs verl 0.9 (verl/workers/engine/megatron), e.g. 0.9.1"),
]

from helpers import forward_tensors  # noqa: E402
from megatron_engine_rig import (BUCKET_BYTES, EngineRanks, engine_rig,  # noqa: E402
                                 three_syncs_equal_fresh_loads)
from verl_server_rig import (SHAPE, assert_state, build_rollout, fresh_state, need_int8,  # noqa: E402
                             rollout_worker)
from verl_server_rig import int8_ready  # noqa: E402,F401  (a fixture)

SIZES = ("actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=1", "actor_rollout_ref.rollout.n=1")


@pytest.fixture(scope="module")
def megatron_rig(int8_ready):
    from npu_flashrl.sim.tiny_models import build_tiny_qwen2

    # the trainer side as activation leaves it with FLASHRL_LMHEAD_FP32=1: npu_flashrl's engine
    # patches applied before verl builds the engine (they do not change the exported weights)
    from npu_flashrl.adapters.megatron import ENGINE_PATCHES

    # bf16 checkpoints: Megatron's Float16Module holds bf16 parameters; with a tokenizer: verl's
    # engine reads its pad_token_id in forward_step
    with engine_rig(int8_ready, "npu_flashrl_megatron_", "qwen2",
                    lambda d, seed: build_tiny_qwen2(d, seed=seed, config_overrides=SHAPE,
                                                     tokenizer=seed == 0),
                    patches=ENGINE_PATCHES, environ={"FLASHRL_LMHEAD_FP32": "1"}) as rig:
        yield rig


def test_engine_exports_hf_names_full_shapes(megatron_rig):
    """What verl 0.9.1's Megatron engine hands the rollout at TP=2: every HF parameter of the
    checkpoint, once, at its full (unsharded) shape, bf16, q/k/v and gate/up separate, on both
    ranks (each rank's export all-gathers its TP group)."""
    ranks, model = megatron_rig["ranks"], megatron_rig["hf"][0]
    ranks.tell(names=True)
    per_rank = [json.loads(s) for s in ranks.expect("names")]
    want = {n: list(p.shape) for n, p in model.named_parameters()}
    for exported in per_rank:
        names = [n for n, _, _ in exported]
        assert len(names) == len(set(names))
        assert {n: s for n, s, _ in exported} == want
        assert {d for _, _, d in exported} == {"torch.bfloat16"}
    assert per_rank[0] == per_rank[1]


@pytest.mark.parametrize("fn", [None, "int8_profile_free"], ids=["bf16", "int8"])
def test_three_syncs_equal_fresh_load(megatron_rig, fn):
    """Three syncs from the TP=2 Megatron engine (checkpoints w1, w2, w3 loaded into it in turn):
    after each, the rollout model equals a fresh load of that checkpoint (INT8: the int8 weights,
    scales and vllm-ascend's fp32 scale copy requantized from the bf16 stream), every tensor at
    its old address, fused layers split across buckets."""
    if fn:
        need_int8(megatron_rig["int8_ready"])
    rig, ranks = megatron_rig, megatron_rig["ranks"]
    with build_rollout(rig, 0, fn) as v:
        worker, buckets = rollout_worker(v)
        assert worker._get_zmq_handle() == rig["handle"]
        if fn:
            assert getattr(v.model, "_npu_flashrl_loader", None) is not None
        ptrs = {n: t.data_ptr() for n, t in forward_tensors(v.model).items()}
        three_syncs_equal_fresh_loads(rig, ranks, worker, buckets, v.model, fn, ptrs, BUCKET_BYTES, "qwen2")


def test_lmhead_fp32_on_the_engine_log_prob_path(megatron_rig):
    """FLASHRL_LMHEAD_FP32=1 on verl 0.9.1's Megatron engine at TP=2 (vocab-parallel head): the
    patch `megatron_engine_lmhead_fp32` gave the built model's output_layer the fp32 forward;
    verl's log-prob pass (`infer_batch`: `forward_step` -> `_lm_head_logits_processor` ->
    `vocab_parallel_log_probs_from_logits`) then gets fp32 logits computed in fp32, each rank
    its half of the vocabulary, and log-probs >10x closer to a float64 head than verl's bf16
    head gives (whose logits Megatron's Float16Module only casts to fp32 afterwards)."""
    ranks = megatron_rig["ranks"]
    ranks.tell(call="megatron_rank_calls:lmhead_fp32")
    for raw in ranks.expect("result"):
        res = json.loads(raw)
        assert res["patched"] == [True, True]  # megatron_engine_checks, megatron_engine_lmhead_fp32
        assert res["tp"] == 2 and res["fp32_head"] and res["param_dtype"] == "torch.bfloat16"
        on, off = res["on"], res["off"]
        assert on["hidden_dtype"] == off["hidden_dtype"] == "torch.bfloat16"  # the body stays bf16
        assert on["local_vocab"] == off["local_vocab"] == 512 // 2  # vocab-parallel
        assert on["logits_dtype"] == "torch.float32" and off["logits_dtype"] == "torch.bfloat16"
        assert on["log_probs_dtype"] == "torch.float32"
        assert res["disabled"]
        assert on["err"] < 1e-4 and off["err"] > 10 * on["err"], (on, off)


def test_tis_reaches_the_megatron_loss(megatron_rig):
    """TIS as npu_flashrl recommends it on verl 0.9 (decoupled mode, rollout_is=token:
    `tis_overrides(verl="0.9")`) on verl's own ppo_megatron_trainer config: the actor's
    `ppo_loss` on the Megatron engine's loss path multiplies the driver's rollout_is_weights
    into the PPO-clip loss of the engine's own log-probs, and the gradient changes with them."""
    import torch

    from npu_flashrl.adapters import verl as ad
    from helpers import masked_mean, ppo_clip_per_token

    overrides = [*ad.tis_overrides(verl="0.9"), *SIZES]
    ranks = megatron_rig["ranks"]
    ranks.tell(call="megatron_rank_calls:tis_loss", kwargs={"overrides": list(overrides)})
    results = [json.loads(raw) for raw in ranks.expect("result")]
    res = results[0]
    assert res["loss_mode"] == "vanilla"
    w = torch.tensor(res["weights"])  # verl's driver step: truncated IS weights, not all 1
    assert (w <= res["threshold"]).all() and (w < 0.9).any() and (w > 1.1).any()
    cfg = _tis_actor_config(overrides)
    mask = torch.tensor(res["response_mask"], dtype=torch.float32)
    w = torch.tensor(res["weights"])
    old, adv = torch.tensor(res["old"]), torch.tensor(res["adv"])
    for name, weights in (("weighted", w), ("plain", torch.ones_like(w))):
        run = res[name]
        cur = torch.zeros_like(old)
        for i, lp in enumerate(run["log_probs"]):
            # no-padding row: prompt + valid response; the log-prob of response token j sits at
            # prompt - 1 + j (verl shifts the labels by one), so the response's are [-(n+1):-1]
            n = int(mask[i].sum())
            cur[i, :n] = torch.tensor(lp)[-(n + 1):-1]
        expected = masked_mean(ppo_clip_per_token(cfg, old, cur, adv) * weights, mask)
        loss = run["loss"][0] if isinstance(run["loss"], list) else run["loss"]
        assert abs(loss - float(expected)) < 1e-3 * max(1.0, abs(float(expected))), (name, loss, expected)
    assert res["weighted"]["loss"] != res["plain"]["loss"]
    assert res["weighted"]["grad_norm"] != res["plain"]["grad_norm"]
    assert results[1]["weighted"]["loss"] == res["weighted"]["loss"]  # both TP ranks, one loss


def _tis_actor_config(overrides):
    import os as _os

    from omegaconf import OmegaConf

    import verl
    from verl.utils.config import omega_conf_to_dataclass

    cfg = OmegaConf.load(_os.path.join(_os.path.dirname(verl.__file__), "trainer", "config",
                                       "_generated_ppo_megatron_trainer.yaml"))
    cfg = OmegaConf.merge(cfg, OmegaConf.from_dotlist(list(overrides)))
    return omega_conf_to_dataclass(cfg.actor_rollout_ref.actor)


def test_patches_survive_mindspeed_repatch(megatron_rig, tmp_path):
    """verl 0.9.1's NPU engine, `MindspeedEngineWithLMHead`, with a stand-in MindSpeed adaptor
    (tests/support/mindspeed_standin.py: patches Megatron attributes at import, `repatch` removes and
    re-applies them) and FLASHRL_LMHEAD_FP32=1. verl's `_init_device_mesh` runs `repatch` with
    its config; npu_flashrl's engine patches (on verl's classes) are still in place afterwards,
    the fp32 head (set on the built output_layer after the repatch) computes fp32 logits and
    goes through MindSpeed's re-applied ColumnParallelLinear.forward, and the engine check saw
    MindSpeed imported before Megatron. The pinned line's `megatron_lmhead_fp32` wrapper on
    `GPTModel.__init__` (a Megatron attribute MindSpeed patches too) does not survive the
    repatch: why the engine path enables the head after the model is built."""
    import mindspeed_standin

    from npu_flashrl.adapters.megatron import ENGINE_PATCHES, PATCH_LMHEAD

    ranks = EngineRanks(megatron_rig["dirs"][0], world=1, tp=1, handle="",
                        patches=(*ENGINE_PATCHES, PATCH_LMHEAD), engine="mindspeed",
                        environ={"FLASHRL_LMHEAD_FP32": "1"},
                        path=(mindspeed_standin.write(tmp_path),))
    try:
        ranks.tell(call="megatron_rank_calls:mindspeed_repatch")
        res = json.loads(ranks.expect("result")[0])
    finally:
        ranks.close()
    assert res["engine"] == "MindspeedEngineWithLMHead"
    assert res["order"] == "already"  # the adaptor came before Megatron in this process
    assert len(res["repatched"]) == 1 and res["repatched"][0]["use_flash_attn"] is True
    assert res["wrapped_before"] == [True]  # the pinned line's GPTModel.__init__ wrapper ...
    assert res["gpt_init_wrapped_after"] is False  # ... is gone after repatch
    assert res["patched"] == [True, True]  # the engine patches are not Megatron attributes
    assert res["fp32_head"] and res["logits_dtype"] == "torch.float32"
    assert res["column_parallel_calls"] > 0  # the head's fp32 forward ran MindSpeed's patch


MOE_BUCKET_BYTES = 256 << 10  # a layer's experts spread over several buckets (test_verl_server.py)


@pytest.fixture(scope="module")
def moe_rig(megatron_rig):
    """Tiny Qwen3-MoE (2 layers, 8 experts) checkpoints w0..w3 and verl's engine on them with
    expert parallel 2 (two rank processes, 4 experts each, TP 1)."""
    from npu_flashrl.sim.tiny_models import build_tiny_qwen3_moe

    dirs, hf = [], []
    for seed in range(4):
        d = os.path.join(megatron_rig["root"], f"qwen3_moe_w{seed}")
        hf.append(build_tiny_qwen3_moe(d, seed=seed, tokenizer=seed == 0))
        dirs.append(d)
    ranks = EngineRanks(dirs[0], world=2, tp=1, ep=2, handle=megatron_rig["handle"])
    yield dict(megatron_rig, dirs=dirs, hf=hf, ranks=ranks)
    ranks.close()


def test_moe_engine_with_ep2_exports_every_expert(moe_rig):
    """Expert parallel 2: each rank holds 4 of the 8 experts; the export (mbridge's EP
    all-gather) gives every rank all of them, per-expert HF names at full shape, once."""
    ranks, model = moe_rig["ranks"], moe_rig["hf"][0]
    ranks.tell(names=True)
    per_rank = [json.loads(s) for s in ranks.expect("names")]
    from safetensors import safe_open

    with safe_open(os.path.join(moe_rig["dirs"][0], "model.safetensors"), "pt") as f:
        want = {k: list(f.get_slice(k).get_shape()) for k in f.keys()}
    assert any(".mlp.experts.7.down_proj.weight" in k for k in want)
    for exported in per_rank:
        names = [n for n, _, _ in exported]
        assert len(names) == len(set(names))
        assert {n: sh for n, sh, _ in exported} == want
    assert per_rank[0] == per_rank[1]


def test_moe_three_syncs_equal_fresh_int8_load(moe_rig):
    """Three syncs from the EP=2 Megatron engine into vLLM's Qwen3-MoE on vllm-ascend's
    W8A8_DYNAMIC fused-MoE layers through npu_flashrl: each equals a fresh INT8 load of that
    checkpoint (int8 experts, scales, fp32 scale copies), every tensor at its old address, a
    layer's experts spread over several 256 KB buckets."""
    need_int8(moe_rig["int8_ready"])
    fn, rig, ranks = "int8_profile_free", moe_rig, moe_rig["ranks"]
    with build_rollout(rig, 0, fn) as v:
        worker, buckets = rollout_worker(v)
        assert getattr(v.model, "_npu_flashrl_loader", None) is not None
        ptrs = {n: t.data_ptr() for n, t in forward_tensors(v.model).items()}
        assert "model.layers.0.mlp.experts.w13_weight_scale_fp32" in ptrs
        three_syncs_equal_fresh_loads(rig, ranks, worker, buckets, v.model, fn, ptrs, MOE_BUCKET_BYTES, "qwen3_moe")


def test_pp2_engine_syncs_equal_fresh_int8_load(megatron_rig):
    """Pipeline parallel 2 (one decoder layer per stage, TP 1): the export (mbridge broadcasts each
    stage's tensors over the PP group, layer numbers made global) is every HF tensor once on both
    ranks, and two syncs from it into the INT8 rollout equal fresh INT8 loads."""
    need_int8(megatron_rig["int8_ready"])
    rig, fn = megatron_rig, "int8_profile_free"
    ranks = EngineRanks(rig["dirs"][0], world=2, tp=1, pp=2, handle=rig["handle"])
    try:
        ranks.tell(names=True)
        want = {n: list(p.shape) for n, p in rig["hf"][0].named_parameters()}
        for raw in ranks.expect("names"):
            exported = json.loads(raw)
            assert len(exported) == len(want) and {n: sh for n, sh, _ in exported} == want
        with build_rollout(rig, 0, fn) as v:
            worker, buckets = rollout_worker(v)
            ptrs = {n: t.data_ptr() for n, t in forward_tensors(v.model).items()}
            for i in (2, 1):
                ranks.tell(load=rig["dirs"][i])
                ranks.expect("loaded")
                ranks.tell(send=True, bucket_bytes=BUCKET_BYTES)
                worker.update_weights_from_ipc(use_shm=True)
                ranks.expect("sent")
                assert_state(v.model, fresh_state(rig, i, fn), ptrs)
    finally:
        ranks.close()
