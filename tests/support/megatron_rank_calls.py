"""What tests/adapters/megatron/test_megatron_engine.py runs inside each trainer-rank process on verl 0.9.1's
Megatron engine (`{"call": "megatron_rank_calls:<fn>"}`, see npu_flashrl/sim/megatron_engine.py).
Every function takes the engine and returns JSON-able facts for the test to assert on; none of
them asserts itself (a failed rank would hang the other one in a collective).

The batches are made the way verl's trainer makes them: a left-padded prompt and a right-padded
response per row, then verl's own `left_right_2_no_padding` (ray_trainer: `_compute_old_log_prob`,
`_update_actor`) and the non-tensor keys those steps assign.
"""
import torch

B, PROMPT, RESPONSE, VOCAB = 3, 4, 5, 512


def _batch(seed=0, **tensors):
    from tensordict import TensorDict

    from verl.utils import tensordict_utils as tu
    from verl.workers.utils.padding import left_right_2_no_padding

    g = torch.Generator().manual_seed(seed)
    attn = torch.ones(B, PROMPT + RESPONSE, dtype=torch.long)
    attn[0, :1] = 0  # left padding of a prompt
    attn[1, -2:] = 0  # a shorter response
    input_ids = torch.randint(3, VOCAB, (B, PROMPT + RESPONSE), generator=g) * attn
    position_ids = (attn.cumsum(-1) - 1).clamp(min=0)
    response_mask = attn[:, PROMPT:].clone()
    td = TensorDict({"input_ids": input_ids, "attention_mask": attn, "position_ids": position_ids,
                     "response_mask": response_mask, "prompts": input_ids[:, :PROMPT],
                     "responses": input_ids[:, PROMPT:], **tensors}, batch_size=[B])
    td = left_right_2_no_padding(td)
    tu.assign_non_tensor(td, use_remove_padding=False, use_dynamic_bsz=False,
                         micro_batch_size_per_gpu=B, use_fused_kernels=False,
                         calculate_entropy=False, global_batch_size=B)
    td["temperature"] = torch.ones(B)
    return td


def _capture(engine):
    """Hooks on the last stage's output_layer (its input, weight shard and output) and on the
    engine's `_lm_head_logits_processor` (the labels it is given and the log-probs it returns)."""
    from npu_flashrl.adapters.megatron import engine_patches

    seen = {}
    head = engine_patches._unwrap(engine.module[0]).output_layer
    hooks = [head.register_forward_hook(lambda mod, args, out: seen.update(
        hidden=args[0].detach(), weight=mod.weight.detach().clone(),
        logits=(out[0] if isinstance(out, tuple) else out).detach()))]
    processor = engine._lm_head_logits_processor

    def spy(logits, label, temperature, **kw):
        ret = processor(logits, label, temperature, **kw)
        seen.update(label=label.detach().clone(), log_probs=ret["log_probs"].detach())
        return ret

    engine._lm_head_logits_processor = spy
    return head, seen, hooks


def _reference_log_probs(seen):
    """float64 log-probs of the same head on the same hidden states: each rank's vocab shard of
    the logits gathered over the TP group, then a plain log-softmax."""
    import torch.distributed as dist
    from megatron.core import parallel_state as mpu

    local = (seen["hidden"].double() @ seen["weight"].double().T).transpose(0, 1).contiguous()
    group = mpu.get_tensor_model_parallel_group()
    shards = [torch.empty_like(local) for _ in range(dist.get_world_size(group))]
    dist.all_gather(shards, local, group=group)
    full = torch.cat(shards, dim=-1).log_softmax(-1)
    return full.gather(-1, seen["label"].long().unsqueeze(-1)).squeeze(-1)


def lmhead_fp32(engine, seed=0):
    """verl's log-prob pass (`infer_batch`, what `compute_log_prob` runs) with the head as built
    (fp32 when FLASHRL_LMHEAD_FP32=1 reached the engine patch), then with the fp32 head removed."""
    from megatron.core import parallel_state as mpu

    from npu_flashrl.adapters.megatron import disable_fp32_output_layer, is_fp32_output_layer
    from npu_flashrl.adapters.megatron import engine_patches

    head, seen, hooks = _capture(engine)
    gpt = engine_patches._unwrap(engine.module[0])
    from verl.workers.engine.megatron.transformer_impl import MegatronEngine

    from npu_flashrl import patches

    result = {"tp": mpu.get_tensor_model_parallel_world_size(), "fp32_head": is_fp32_output_layer(gpt),
              "param_dtype": str(head.weight.dtype),
              "patched": [getattr(getattr(MegatronEngine, m), patches.ORIGINAL_ATTR, None) is not None
                          for m in ("__init__", "_build_megatron_module")]}

    def run():
        data = _batch(seed)
        lens = data["input_ids"].offsets().diff()
        out = engine.infer_batch(data)
        ref = _reference_log_probs(seen)
        # the positions that predict a real next token (bshd rows are right-padded)
        pos = torch.arange(ref.shape[1])
        mask = pos.unsqueeze(0) < (lens - 1).unsqueeze(1)
        err = (seen["log_probs"].double() - ref)[mask].abs().max()
        return {"logits_dtype": str(seen["logits"].dtype), "local_vocab": seen["logits"].shape[-1],
                "log_probs_dtype": str(out["model_output"]["log_probs"].dtype),
                "hidden_dtype": str(seen["hidden"].dtype), "err": float(err)}

    with engine.eval_mode():
        result["on"] = run()
        result["disabled"] = disable_fp32_output_layer(gpt)
        result["off"] = run()
    for h in hooks:
        h.remove()
    return result


def tis_loss(engine, overrides, seed=0):
    """The actor's loss on the Megatron engine with and without the driver's `rollout_is_weights`:
    verl's `ppo_loss` configured from verl's own `ppo_megatron_trainer` config with `overrides`
    (as `engine_workers` builds it), through `forward_backward_batch(..., forward_only=False)`
    (the loss path of `train_batch`, before the optimizer step). Returns the losses, the engine's
    own log-probs, the IS weights and the output layer's gradient norm of each run."""
    import os
    from functools import partial

    from omegaconf import OmegaConf

    import verl
    from verl.utils.config import omega_conf_to_dataclass
    from verl.workers.utils.losses import ppo_loss

    cfg = OmegaConf.load(os.path.join(os.path.dirname(verl.__file__), "trainer", "config",
                                      "_generated_ppo_megatron_trainer.yaml"))
    cfg = OmegaConf.merge(cfg, OmegaConf.from_dotlist(list(overrides)))
    actor = omega_conf_to_dataclass(cfg.actor_rollout_ref.actor)
    g = torch.Generator().manual_seed(seed + 1)
    old = -torch.rand(B, RESPONSE, generator=g)
    adv = torch.randn(B, RESPONSE, generator=g)
    rollout = old + 0.8 * torch.randn(B, RESPONSE, generator=g)  # an INT8 rollout disagreeing
    # the driver's decoupled-mode step (RayPPOTrainer.fit), on verl's own function
    from verl import DataProto
    from verl.trainer.ppo.rollout_corr_helper import compute_rollout_correction_and_add_to_batch

    mask = _batch(seed)["response_mask"]
    mask = mask.to_padded_tensor(0) if mask.is_nested else mask
    proto = DataProto.from_dict(tensors={"old_log_probs": old, "rollout_log_probs": rollout,
                                         "response_mask": mask.float()})
    proto, _ = compute_rollout_correction_and_add_to_batch(proto, cfg.algorithm.rollout_correction)
    weights = proto.batch["rollout_is_weights"]
    from npu_flashrl.adapters.megatron import engine_patches

    head = engine_patches._unwrap(engine.module[0]).output_layer
    out = {"loss_mode": actor.policy_loss.loss_mode, "weights": weights.tolist(),
           "old": old.tolist(), "adv": adv.tolist()}
    for name, extra in (("weighted", {"rollout_is_weights": weights}), ("plain", {})):
        data = _batch(seed, old_log_probs=old, advantages=adv, **extra)
        for p in engine.module[0].parameters():
            p.grad = None
        # the train-mode half of `train_batch` (EngineTrainModeCtx zeroes the grads through the
        # optimizer on exit, which this forward_only-built engine has none of)
        for m in engine.module:
            m.train()
        res = engine.forward_backward_batch(data, partial(ppo_loss, config=actor), forward_only=False)
        for m in engine.module:
            m.eval()
        grad = head.weight.grad
        out[name] = {"loss": [float(x) for x in res["loss"]] if isinstance(res["loss"], list)
                     else float(res["loss"]),
                     "log_probs": [t.tolist() for t in res["model_output"]["log_probs"].unbind()],
                     "grad_norm": float(grad.float().norm()) if grad is not None else None}
    out["response_mask"] = mask.tolist()
    out["threshold"] = float(cfg.algorithm.rollout_correction.rollout_is_threshold)
    return out


def mindspeed_repatch(engine, seed=0):
    """What MindSpeed's repatch left in place (stand-in adaptor, tests/support/mindspeed_standin.py)."""
    import mindspeed.megatron_adaptor as adaptor
    from megatron.core.models.gpt.gpt_model import GPTModel
    from verl.workers.engine.megatron.transformer_impl import MegatronEngine

    from npu_flashrl import patches
    from npu_flashrl.adapters.megatron import engine_patches, ensure_mindspeed_before_megatron
    from npu_flashrl.adapters.megatron import is_fp32_output_layer

    head, seen, hooks = _capture(engine)
    before = adaptor.CALLS["column_parallel_forward"]
    with engine.eval_mode():
        engine.infer_batch(_batch(seed))
    for h in hooks:
        h.remove()
    return {"engine": type(engine).__name__, "order": ensure_mindspeed_before_megatron("npu"),
            "repatched": adaptor.REPATCHED, "wrapped_before": adaptor.WRAPPED_BEFORE,
            "gpt_init_wrapped_after": getattr(GPTModel.__dict__["__init__"], patches.ORIGINAL_ATTR,
                                              None) is not None,
            "patched": [getattr(getattr(MegatronEngine, m), patches.ORIGINAL_ATTR, None) is not None
                        for m in ("__init__", "_build_megatron_module")],
            "fp32_head": is_fp32_output_layer(engine_patches._unwrap(engine.module[0])),
            "logits_dtype": str(seen["logits"].dtype),
            "column_parallel_calls": adaptor.CALLS["column_parallel_forward"] - before}
