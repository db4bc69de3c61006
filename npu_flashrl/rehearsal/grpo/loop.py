"""The GRPO runs: per rollout model, every variant it serves, every seed, every step.

One step (as verl's trainer does it, `ray_trainer.fit` in decoupled mode):
1. the step's prompts (the same for every variant: drawn from (seed, step) only), `group`
   responses each, sampled from the rollout model (`sampling.py`), with their rollout log-probs;
2. the verifiable reward (`task.py`), verl's GRPO advantages;
3. the trainer's log-probs of the responses (`old_log_prob`), verl's rollout correction (TIS weights
   in the TIS variants), verl's vanilla policy loss per mini-batch, AdamW on the fp32 masters;
4. the bf16 weights pushed into the rollout model through the line's transport (`transport.py`),
   and for INT8 the rollout model's INT8 state checked against the trainer's weights (`state.py`).

Recorded per step for the checks: the largest difference between the rollout log-probs verl is
handed and a replay of some sampled rows through the rollout model (are they the rollout's own?),
and between the TIS weights the loss got and min(pi_trainer / pi_rollout, 2) from the two models' own
log-probs. After a run's last step the trainer's policy is scored on the held-out prompts
(`heldout.py`). A negative control (`settings.CONTROLS`) switches one thing wrong inside `_step` or
`push`, by name.

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

from npu_flashrl import lines
from npu_flashrl.rehearsal.common import RehearsalError, progress_bar
from npu_flashrl.rehearsal.grpo import sampling
from npu_flashrl.rehearsal.grpo.settings import GrpoSettings, Variant
from npu_flashrl.rehearsal.grpo.verl_algo import TIS_THRESHOLD
from npu_flashrl.rehearsal.state import summarize_step


def prompt_generator(base_seed: int, seed: int, step: int) -> torch.Generator:
    """Prompts depend on (seed, step) only: the same for every variant."""
    return torch.Generator().manual_seed(1_000_003 * (base_seed + 1) + 10_007 * seed + step)


def sample_generator(base_seed: int, seed: int, step: int) -> torch.Generator:
    """Sampling noise: the same random stream for every variant at (seed, step), so variants differ
    by their models' probabilities, not by luck."""
    return torch.Generator().manual_seed(7_000_001 * (base_seed + 1) + 30_011 * seed + step + 17)


class RolloutHandle:
    """A built rollout model with what the loop needs from it (quantized: its precision's state
    checker and the fault). `fn`: the config fn its engine was set up with (None: vLLM's own bf16
    model); its precision (`rehearsal.precisions.of_fn`) picks the state check."""

    def __init__(self, v, fn: Optional[str], device: str, seed: int, profile, faults_mod):
        from npu_flashrl.rehearsal.precisions import of_fn

        precision = of_fn(fn)
        self.v, self.model, self.int8 = v, v.model, precision is not None
        loader = getattr(self.model, lines.SYNC_ATTR, None)
        self.info: Dict[str, Any] = {
            "model_dir": getattr(v, "model_dir", None), "quantization": getattr(v, "quantization", None),
            "fn": fn, "precision": precision.name if precision else None,
            "int8_loader": loader is not None,
            "quantized_layers": len({t.path for t in loader.targets.values()}) if loader else 0,
            "quant_types": sorted({t.scheme.key[0] for t in loader.targets.values()}) if loader else [],
            "online_quantizer": getattr(getattr(loader, "quantizer", None), "name", None),
            "layer0_qkv_weight_dtype": str(self.model.model.layers[0].self_attn.qkv_proj.weight.dtype),
            "lm_head_dtype": str(getattr(getattr(self.model, "lm_head", None), "weight", torch.empty(0)).dtype)}
        self.checker = self.fault = None
        if precision is not None:
            if loader is None or not loader.targets:
                raise RehearsalError(f"GRPO rollout: the vLLM model has no npu_flashrl loader / no vllm-ascend "
                                     f"{'/'.join(precision.quant_types)} layers: npu_flashrl was not active when "
                                     "it was built")
            self.checker = precision.state_check()(self.model, loader.targets, device, profile=profile, seed=seed)
            self.fault = faults_mod.install(self.model, loader)
        self.info["fault_injected"] = self.fault.name if self.fault else None


def run_variant_seeds(variant: Variant, handle: RolloutHandle, trainer, task, settings: GrpoSettings, sync,
                      vocab_size: int, device: str, base_seed: int, sync_counter: List[int],
                      layer_results: List[Dict[str, Any]], progress: bool,
                      algo_factory: Callable[..., Any],
                      heldout_score: Optional[Callable[[Any, bool], float]] = None) -> Dict[str, Any]:
    """All seeds of one variant on `handle`'s rollout model, its negative control (if any) switched on.
    Returns {"rows": [...], "algo": info, "heldout": [score of each seed's trained policy], "seeds",
    "steps", "variant"}."""
    s = settings
    seeds, steps = s.size_of(variant)
    batch = s.prompts * s.group
    algo = algo_factory(tis=variant.tis, mini_batch_size=-(-batch // s.mini_batches), group_size=s.group)
    rows: List[Dict[str, Any]] = []
    scores: List[float] = []

    def push(snap, current, rng) -> Dict[str, Any]:
        """Push `snap` into the rollout model; the INT8 state is checked against `current`, the trainer's
        weights now (the same tensors unless the stale-rollout control holds `snap` back a step)."""
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
            results = handle.checker.check(dict(current), sync_counter[0])
            check_s = time.perf_counter() - t
            for r in results:
                r["variant"] = variant.name
            layer_results.extend(results)
            state = summarize_step(results)
        return {"sync_s": sync_s, "buckets": n_buckets, "rollout_state": state, "state_check_s": check_s}

    with progress_bar(seeds * steps, f"GRPO {variant.name}", progress) as bar:
        for seed in range(seeds):
            trainer.reset(lr_scale=variant.lr_scale)
            rng = random.Random(base_seed * 1000 + seed)
            snap = trainer.snapshot()
            initial = push(snap, snap, rng)  # the run starts from the pre-trained weights
            for step in range(1, steps + 1):
                rows.append(_step(variant, handle, trainer, task, s, algo, vocab_size, device, base_seed, seed, step))
                before, snap = snap, trainer.snapshot()
                rows[-1].update(push(before if variant.control == "stale_rollout" else snap, snap, rng))
                if step == 1:
                    rows[-1]["initial_sync"] = initial
                bar.set_postfix_str(f"seed {seed} reward {rows[-1]['reward']:.2f}")
                bar.update(1)
            if heldout_score is not None:
                scores.append(heldout_score(trainer, variant.fp32_head))
    return {"rows": rows, "algo": algo.info(), "heldout": scores, "seeds": seeds, "steps": steps, "variant": variant}


def _step(variant: Variant, handle: RolloutHandle, trainer, task, s: GrpoSettings, algo, vocab_size: int,
          device: str, base_seed: int, seed: int, step: int) -> Dict[str, Any]:
    """One GRPO step (rollout, reward, advantages, rollout correction, update); its row."""
    from npu_flashrl.metrics import mismatch_metrics

    batch = s.prompts * s.group
    prompts = task.prompts(s.prompts, prompt_generator(base_seed, seed, step))
    t0 = time.perf_counter()
    rows_p, responses, own_logp = sampling.sample(handle.model, prompts, s.group, s.response_len,
                                                  sample_generator(base_seed, seed, step), vocab_size, device,
                                                  variant.logit_scale)
    rollout_s = time.perf_counter() - t0
    reward = task.reward(rows_p, responses)
    ids = torch.cat([rows_p, responses], dim=1)
    mask = torch.ones(responses.shape, dtype=torch.float32)
    t0 = time.perf_counter()
    old = trainer.logp(ids, s.prompt_len, variant.fp32_head, grad=False)
    rollout_logp = own_logp
    if variant.control == "logp_from_trainer":
        rollout_logp = trainer.logp(ids, s.prompt_len, variant.fp32_head, grad=False, autocast=False)
    # the rollout's own log-probs: a sample of rows replayed through the rollout model now (its weights
    # are those it sampled with), against what verl is handed
    n = min(s.replay_rows, batch)
    replayed = sampling.replay(handle.model, rows_p[:n], responses[:n], vocab_size, device, variant.logit_scale)
    own_diff = float((replayed - rollout_logp[:n]).abs().max())
    adv = algo.advantages(reward, mask, [i // s.group for i in range(batch)])
    if variant.control == "tis_inverted":
        weights, loss_mask, rc_metrics = algo.rollout_correction(rollout_logp, old, mask)
    else:
        weights, loss_mask, rc_metrics = algo.rollout_correction(old, rollout_logp, mask)
    if variant.control == "tis_ones" and weights is not None:
        weights = torch.ones_like(weights)
    upd = trainer.update(algo, ids, s.prompt_len, variant.fp32_head, old, adv, loss_mask, weights, s.mini_batches)
    train_s = time.perf_counter() - t0
    m = mismatch_metrics(old, own_logp, mask, tis_threshold=TIS_THRESHOLD, prefix="")
    return {"variant": variant.name, "seed": seed, "step": step, "reward": float(reward.mean()),
            "token_correct": float(task.token_correct(rows_p, responses).float().mean()),
            "token_mult_prob_error": m["token_mult_prob_error"], "kl_k3": m["kl_k3"],
            "tis": variant.tis, "tis_weights": _weight_stats(weights, mask),
            "tis_ratio_max_err": _ratio_error(weights, old, own_logp, mask),
            "own_logp_max_diff": own_diff, "own_logp_rows": n,
            "verl_rollout_corr": {k: v for k, v in rc_metrics.items() if isinstance(v, float)},
            "rollout_s": rollout_s, "train_s": train_s, **upd}


def _ratio_error(weights: Optional[torch.Tensor], old: torch.Tensor, rollout: torch.Tensor,
                 mask: torch.Tensor) -> Optional[float]:
    """Largest |w - min(pi_trainer / pi_rollout, C)| over the response tokens: what token-level TIS is,
    from the trainer's and the rollout model's own log-probs (verl clamps the log ratio to +-20 first)."""
    if weights is None:
        return None
    expected = torch.exp((old.double() - rollout.double()).clamp(-20, 20)).clamp(max=TIS_THRESHOLD)
    valid = mask.bool()
    return float((weights.double()[valid] - expected[valid]).abs().max())


def _weight_stats(weights: Optional[torch.Tensor], mask: torch.Tensor) -> Optional[Dict[str, float]]:
    """What the loss got as rollout_is_weights (None: no weights were passed)."""
    if weights is None:
        return None
    valid = mask.bool()
    w = weights[valid].double()
    return {"mean": float(w.mean()), "min": float(w.min()), "max": float(w.max()),
            "frac_not_1": float(((w - 1).abs() > 1e-6).double().mean()),
            "clip_frac": float((w >= TIS_THRESHOLD - 1e-9).double().mean()), "n": int(w.numel())}
