"""The GRPO runs: per rollout model, every variant it serves, every seed, every step.

One step (as verl's trainer does it, `ray_trainer.fit` in decoupled mode):
1. the step's prompts (the same for every variant: drawn from (seed, step) only), `group`
   responses each, sampled from the rollout model (`sampling.py`), with their rollout log-probs;
2. the verifiable reward (`task.py`), verl's GRPO advantages;
3. the trainer's log-probs of the responses (`old_log_prob`), verl's rollout correction (TIS weights
   in the TIS variants), verl's vanilla policy loss per mini-batch, AdamW on the fp32 masters;
4. the bf16 weights pushed into the rollout model through the line's transport (`transport.py`),
   and for INT8 the rollout model's INT8 state checked against the pushed weights (`state.py`).

A run (variant, seed) starts from the pre-trained weights: the trainer is reset and its weights are
pushed into the rollout model first (sync 0 of the run, checked like the others), so one rollout
model serves all seeds of its variants. `int8` and `int8+tis` share the INT8 rollout model; the
fp32-head rollout (process-global patches) is built last, as the default rehearsal does.
"""
from __future__ import annotations

import random
import time
from typing import Any, Callable, Dict, List, Optional

import torch

from npu_flashrl.rehearsal.common import RehearsalError, progress_bar
from npu_flashrl.rehearsal.grpo import sampling
from npu_flashrl.rehearsal.grpo.settings import VARIANT_SPEC, GrpoSettings


def prompt_generator(base_seed: int, seed: int, step: int) -> torch.Generator:
    """Prompts depend on (seed, step) only: the same for every variant."""
    return torch.Generator().manual_seed(1_000_003 * (base_seed + 1) + 10_007 * seed + step)


def sample_generator(base_seed: int, seed: int, step: int) -> torch.Generator:
    """Sampling noise: the same random stream for every variant at (seed, step), so variants differ
    by their models' probabilities, not by luck."""
    return torch.Generator().manual_seed(7_000_001 * (base_seed + 1) + 30_011 * seed + step + 17)


class RolloutHandle:
    """A built rollout model with what the loop needs from it (INT8: state checker and fault)."""

    def __init__(self, v, int8: bool, device: str, seed: int, profile, faults_mod):
        from npu_flashrl.rehearsal.state import Int8StateCheck

        self.v, self.model, self.int8 = v, v.model, int8
        loader = getattr(self.model, "_npu_flashrl_loader", None)
        self.info: Dict[str, Any] = {
            "model_dir": getattr(v, "model_dir", None), "quantization": getattr(v, "quantization", None),
            "int8_loader": loader is not None,
            "quantized_layers": len({t.path for t in loader.targets.values()}) if loader else 0,
            "online_quantizer": getattr(getattr(loader, "quantizer", None), "name", None),
            "layer0_qkv_weight_dtype": str(self.model.model.layers[0].self_attn.qkv_proj.weight.dtype),
            "lm_head_dtype": str(getattr(getattr(self.model, "lm_head", None), "weight", torch.empty(0)).dtype)}
        self.checker = self.fault = None
        if int8:
            if loader is None or not loader.targets:
                raise RehearsalError("GRPO rollout: the vLLM model has no npu_flashrl INT8 loader / no vllm-ascend "
                                     "W8A8 layers: npu_flashrl was not active when it was built")
            self.checker = Int8StateCheck(self.model, loader.targets, device, profile=profile, seed=seed)
            self.fault = faults_mod.install(self.model, loader)
        self.info["fault_injected"] = self.fault.name if self.fault else None


def run_variant_seeds(variant: str, handle: RolloutHandle, trainer, task, settings: GrpoSettings, sync,
                      vocab_size: int, device: str, base_seed: int, sync_counter: List[int],
                      layer_results: List[Dict[str, Any]], progress: bool,
                      algo_factory: Callable[..., Any]) -> Dict[str, Any]:
    """All seeds of one variant on `handle`'s rollout model. Returns {"rows": [...], "algo": info}."""
    from npu_flashrl.metrics import mismatch_metrics
    from npu_flashrl.rehearsal.state import summarize_step

    _, tis, fp32_head = VARIANT_SPEC[variant]
    s = settings
    batch = s.prompts * s.group
    algo = algo_factory(tis=tis, mini_batch_size=-(-batch // s.mini_batches), group_size=s.group)
    rows: List[Dict[str, Any]] = []

    def push(snap, rng) -> Dict[str, Any]:
        prepared = sync.prepare(snap, rng)
        t = time.perf_counter()
        n_buckets = sync.push(handle.v, prepared, handle.int8)
        sync_s = time.perf_counter() - t
        state, check_s = None, 0.0
        if handle.checker is not None:
            if handle.fault is not None:
                handle.fault.after_sync()
            sync_counter[0] += 1
            t = time.perf_counter()
            results = handle.checker.check(dict(snap), sync_counter[0])
            check_s = time.perf_counter() - t
            for r in results:
                r["variant"] = variant
            layer_results.extend(results)
            state = summarize_step(results)
        return {"sync_s": sync_s, "buckets": n_buckets, "int8_state": state, "state_check_s": check_s}

    with progress_bar(s.seeds * s.steps, f"GRPO {variant}", progress) as bar:
        for seed in range(s.seeds):
            trainer.reset()
            rng = random.Random(base_seed * 1000 + seed)
            initial = push(trainer.snapshot(), rng)  # the run starts from the pre-trained weights
            for step in range(1, s.steps + 1):
                prompts = task.prompts(s.prompts, prompt_generator(base_seed, seed, step))
                t0 = time.perf_counter()
                rows_p, responses, rollout_logp = sampling.sample(
                    handle.model, prompts, s.group, s.response_len, sample_generator(base_seed, seed, step),
                    vocab_size, device)
                rollout_s = time.perf_counter() - t0
                reward = task.reward(rows_p, responses)
                ids = torch.cat([rows_p, responses], dim=1)
                mask = torch.ones(responses.shape, dtype=torch.float32)
                t0 = time.perf_counter()
                old = trainer.logp(ids, s.prompt_len, fp32_head, grad=False)
                group_index = [i // s.group for i in range(batch)]
                adv = algo.advantages(reward, mask, group_index)
                weights, loss_mask, rc_metrics = algo.rollout_correction(old, rollout_logp, mask)
                upd = trainer.update(algo, ids, s.prompt_len, fp32_head, old, adv, loss_mask, weights,
                                     s.mini_batches)
                train_s = time.perf_counter() - t0
                synced = push(trainer.snapshot(), rng)
                m = mismatch_metrics(old, rollout_logp, mask, tis_threshold=2.0, prefix="")
                row = {"variant": variant, "seed": seed, "step": step, "reward": float(reward.mean()),
                       "token_correct": float(task.token_correct(rows_p, responses).float().mean()),
                       "token_mult_prob_error": m["token_mult_prob_error"], "kl_k3": m["kl_k3"],
                       "tis": tis, "tis_weights": _weight_stats(weights, mask), "verl_rollout_corr": {
                           k: v for k, v in rc_metrics.items() if isinstance(v, float)},
                       "rollout_s": rollout_s, "train_s": train_s, **upd, **synced}
                if step == 1:
                    row["initial_sync"] = initial
                rows.append(row)
                bar.set_postfix_str(f"seed {seed} reward {row['reward']:.2f}")
                bar.update(1)
    return {"rows": rows, "algo": algo.info()}


def _weight_stats(weights: Optional[torch.Tensor], mask: torch.Tensor) -> Optional[Dict[str, float]]:
    """What the loss got as rollout_is_weights (None: no weights were passed)."""
    if weights is None:
        return None
    valid = mask.bool()
    w = weights[valid].double()
    return {"mean": float(w.mean()), "min": float(w.min()), "max": float(w.max()),
            "frac_not_1": float(((w - 1).abs() > 1e-6).double().mean()),
            "clip_frac": float((w >= 2.0 - 1e-9).double().mean()), "n": int(w.numel())}
