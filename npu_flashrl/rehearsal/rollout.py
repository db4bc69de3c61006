"""Rollout side: the vLLM rollout model (CPU harness or NPU), weight syncs, rollout log-probs."""
from __future__ import annotations

import contextlib
import dataclasses
import random
import time
from typing import Any, Callable, Dict, List, Optional, Tuple

from npu_flashrl import lines
from npu_flashrl.rehearsal.common import RehearsalError, progress_bar
from npu_flashrl.rehearsal.trainer import target_logp


class _NpuVllm:
    """The rollout model built by vLLM's loader on a real Ascend NPU (vllm-ascend's own platform,
    real torch_npu kernels, hccl). NOT VERIFIED ON HARDWARE: written to mirror CpuVllm."""

    def __init__(self, model_dir: str, dtype, quantization: Optional[str] = None, load_format: str = "auto",
                 additional_config: Optional[dict] = None):
        self.model_dir, self.dtype, self.quantization, self.load_format = model_dir, dtype, quantization, load_format
        self.additional_config = additional_config
        self._stack = contextlib.ExitStack()
        self.model = None

    def __enter__(self):
        import torch
        import torch_npu  # noqa: F401
        from vllm.config import (DeviceConfig, LoadConfig, ModelConfig, ParallelConfig,
                                 VllmConfig, set_current_vllm_config)
        from vllm.model_executor.model_loader import get_model

        from npu_flashrl.sim import ascend_harness, cpu_vllm

        from npu_flashrl.adapters import engine_choice

        torch.npu.set_device(0)
        with engine_choice.building(engine_choice.choice_in(self.additional_config)):
            mc = ModelConfig(model=self.model_dir, dtype=self.dtype, skip_tokenizer_init=True,
                             quantization=self.quantization, enforce_eager=True)
            self.vllm_config = VllmConfig(
                model_config=mc, device_config=DeviceConfig(device="npu"),
                load_config=LoadConfig(load_format=self.load_format, use_tqdm_on_load=False),
                parallel_config=ParallelConfig(tensor_parallel_size=1),
                compilation_config=ascend_harness.eager_compilation_config(native_ops=False),
                additional_config=dict(self.additional_config or {}))
        self._stack.enter_context(set_current_vllm_config(self.vllm_config))
        cpu_vllm.ensure_distributed(1, backend="hccl")
        ascend_harness.init_vllm_ascend_config(self.vllm_config)
        cpu_vllm.use_plain_attention()
        self.model = get_model(vllm_config=self.vllm_config)
        return self

    def __exit__(self, *exc):
        self._stack.close()

    def forward_context(self, num_tokens: int):
        """vllm-ascend's forward context around a direct call of the model's layers (its MoE
        layers need one), as its model runner sets it."""
        from npu_flashrl.sim import ascend_harness

        return ascend_harness.ascend_forward_context(self.vllm_config, num_tokens, self.model)


def forward_context_of(rollout, moe: bool):
    """`num_tokens -> context manager` for direct forwards of `rollout`'s layers: vllm-ascend's
    forward context for a MoE model (its fused-MoE layers read the MoE comm method from it), None
    for a dense model (its layers need none, and the dense path stays as it was on every line)."""
    if not moe:
        return None

    def ctx(num_tokens: int):
        try:
            return rollout.forward_context(num_tokens)
        except NotImplementedError as exc:
            raise RehearsalError(f"the MoE forward cannot run on this stack line: {exc}") from None
    return ctx


def make_rollout(device: str, model_dir: str, quantization: Optional[str], load_format: str = "auto",
                 additional_config: Optional[dict] = None):
    """The rollout model; `additional_config`: what the engine patch recorded in the engine args
    (`additional_config['npu_flashrl']`, read by the server-mode sync patch in verl's receiver)."""
    import torch

    if device == "npu":
        return _NpuVllm(model_dir, torch.bfloat16, quantization, load_format, additional_config)
    from npu_flashrl.sim import cpu_vllm

    if _is_mla(model_dir):
        # MLA (DeepSeek-V2/V3): vllm-ascend's MLA layer and backend on the CPU platform, its
        # NPU-kernel forward replaced by the same absorbed attention in plain torch
        from npu_flashrl.sim import mla_harness

        mla_harness.enable_ascend_mla()
    # no vLLM "Loading safetensors checkpoint shards" bar: the rehearsal has its own per-variant bars
    vc = cpu_vllm.make_vllm_config(model_dir, torch.bfloat16, quantization, load_format=load_format,
                                   use_tqdm_on_load=False, additional_config=additional_config)
    return cpu_vllm.CpuVllm(model_dir, dtype=torch.bfloat16, quantization=quantization, load_format=load_format,
                            use_tqdm_on_load=False, vllm_config=vc)


def _is_mla(model_dir: str) -> bool:
    import json
    import os

    try:
        with open(os.path.join(model_dir, "config.json")) as f:
            return bool(json.load(f).get("kv_lora_rank"))
    except (OSError, ValueError):
        return False


def rollout_logp(model, eval_ids, vocab_size: int, device: str, forward_context=None):
    """Teacher-forced rollout log-probs [B, T-1]: the vLLM model's own layers, one sequence at a time
    (each inside `forward_context(num_tokens)` when given: MoE models)."""
    import torch

    from npu_flashrl.sim import ascend_harness

    rows = []
    with torch.no_grad():
        for seq in eval_ids:
            seq = seq.to(device)
            positions = torch.arange(seq.shape[0], device=device)
            if forward_context is None:
                hidden = model.model(seq, positions, None)  # Llama: intermediate_tensors has no default
            else:
                with forward_context(seq.shape[0]):
                    hidden = model.model(seq, positions, None)
            logits = ascend_harness.compute_logits(model, hidden).float()[:, :vocab_size]
            rows.append(target_logp(logits[None], seq[None]))
    return torch.cat(rows)


@dataclasses.dataclass(frozen=True)
class Variant:
    """One rollout model to measure: `build()` returns its context manager (`make_rollout`);
    `logp_key`: which trainer log-probs it is compared with ("bf16" or "fp32head"); `fn`: the
    config fn its engine is set up with (None: vLLM's own bf16 model), which names its precision
    (`precisions.of_fn`: its state check)."""
    name: str
    build: Callable[[], Any]
    logp_key: str
    fn: Optional[str] = None


@dataclasses.dataclass
class Rollouts:
    """What every variant of a run shares. `snapshots`: per step, the weights as the trainer sends
    them (MoE: per-expert names); `train_logps`: per step, {logp_key: trainer log-probs};
    `sync`: how syncs reach the model (`transport.py`); `profile`: the state check's own copy of
    the int8 profile (profile mode); `model_config`: the checkpoint's config.json (MoE top-k)."""
    snapshots: List[Any]
    eval_ids: Any
    train_logps: List[Dict[str, Any]]
    vocab_size: int
    device: str
    seed: int
    progress: bool
    sync: Any
    profile: Optional[Dict[str, dict]] = None
    model_config: Optional[Dict[str, Any]] = None


def run_variant(variant: Variant, run: Rollouts
                ) -> Tuple[List[Dict[str, Any]], Dict[str, Any], List[Dict[str, Any]]]:
    """Build one rollout model, push every step's weights into it through `run.sync`, measure; for
    a quantized variant, check its state and every quantized layer's output error after each sync
    (its precision's state check: INT8 `state.py`, fused-MoE layers `state_moe.py`, W4A8
    `state_w4a8.py`). Returns (rows, info, per-layer state results)."""
    import torch

    from npu_flashrl.metrics import mismatch_metrics
    from npu_flashrl.rehearsal.model import is_moe
    from npu_flashrl.rehearsal.precisions import of_fn
    from npu_flashrl.rehearsal.state import summarize_step
    from npu_flashrl.sim import faults

    name, device, sync, model_config = variant.name, run.device, run.sync, run.model_config
    precision = of_fn(variant.fn)
    int8 = precision is not None  # quantized: npu_flashrl's loader ends each sync
    rows: List[Dict[str, Any]] = []
    layer_results: List[Dict[str, Any]] = []
    info: Dict[str, Any] = {"name": name, "fn": variant.fn, "precision": precision.name if precision else None}
    with progress_bar(len(run.snapshots) + 1, f"rollout {name}", run.progress) as bar:
        t0 = time.perf_counter()
        ctx = variant.build()
        with ctx as v:
            info["build_s"] = time.perf_counter() - t0
            model = v.model
            info["model_dir"] = getattr(v, "model_dir", None)
            info["quantization"] = getattr(v, "quantization", None)
            loader = getattr(model, lines.SYNC_ATTR, None)
            info["int8_loader"] = loader is not None
            experts = getattr(loader, "experts", None) or {}
            info["quantized_layers"] = len({t.path for t in loader.targets.values()} |
                                           {t.path for t in experts.values()}) if loader else 0
            info["expert_layers"] = len({t.path for t in experts.values()})
            moe = is_moe(model_config)
            info["moe"] = moe
            if int8 and moe and not experts:
                raise RehearsalError(f"rollout {name}: a MoE checkpoint, but the INT8 loader found no "
                                     "vllm-ascend W8A8_DYNAMIC fused-MoE layers to reload")
            fwd = forward_context_of(v, moe)
            info["online_quantizer"] = getattr(getattr(loader, "quantizer", None), "name", None)
            attn0 = model.model.layers[0].self_attn
            qkv = getattr(attn0, "qkv_proj", None) or getattr(attn0, "fused_qkv_a_proj", None)  # MLA: the latter
            info["layer0_qkv_weight_dtype"] = str(qkv.weight.dtype) if qkv is not None else None
            # the first MoE layer's experts (DeepSeek-V3's first layers are dense)
            w13 = next((w for layer in model.model.layers
                        if (w := getattr(getattr(getattr(layer, "mlp", None), "experts", None), "w13_weight", None))
                        is not None), None)
            info["layer0_w13_weight_dtype"] = str(w13.dtype) if w13 is not None else None
            head = getattr(model, "lm_head", None)
            info["lm_head_dtype"] = str(head.weight.dtype) if head is not None else None
            emb = getattr(getattr(model, "model", None), "embed_tokens", None)
            info["lm_head_tied"] = head is not None and getattr(emb, "weight", None) is head.weight
            if int8 and (loader is None or not loader.targets):
                raise RehearsalError(f"rollout {name}: the vLLM model has no npu_flashrl loader / no "
                                     f"vllm-ascend {'/'.join(precision.quant_types)} layers: npu_flashrl was not "
                                     "active when it was built")
            if int8:
                info["quant_types"] = sorted({t.scheme.key[0] for t in loader.targets.values()})
            checker = fault = None
            if int8:
                # right after the cold load: pointers, formats and cold scales are the reference
                checker = precision.state_check()(model, loader.targets, device, profile=run.profile,
                                                  seed=run.seed, experts=experts, moe_config=model_config,
                                                  forward_context=fwd)
                try:
                    fault = faults.install(model, loader)
                except faults.FaultError as exc:
                    raise RehearsalError(str(exc)) from None
                info["fault_injected"] = fault.name if fault else None
            from npu_flashrl.rehearsal.state_mla import MlaAbsorbedCheck

            mla = MlaAbsorbedCheck(model)  # empty without MLA layers
            if mla:
                info["mla"] = []
            sync.attach(v)
            bar.update(1)
            rng = random.Random(run.seed + 7)
            for step, snap in enumerate(run.snapshots, start=1):
                prepared = sync.prepare(snap, rng)  # the trainer's side, not timed
                if device == "npu":
                    torch.npu.synchronize()
                t = time.perf_counter()
                n_buckets = sync.push(v, prepared, int8)
                if device == "npu":
                    torch.npu.synchronize()
                reload_s = time.perf_counter() - t
                state = None
                if checker is not None:
                    if fault is not None:
                        fault.after_sync()
                    results = checker.check(dict(snap), step)
                    for r in results:
                        r["variant"] = name
                    layer_results += results
                    state = summarize_step(results)
                if mla:
                    info["mla"].append(mla.check(dict(snap), step))
                logp_r = rollout_logp(model, run.eval_ids, run.vocab_size, device, forward_context=fwd)
                logp_t = run.train_logps[step - 1][variant.logp_key]
                mask = torch.ones_like(logp_t, dtype=torch.bool)
                m = mismatch_metrics(logp_t, logp_r, mask, tis_threshold=2.0, prefix="")
                rows.append({"step": step, "variant": name, "reload_s": reload_s, "buckets": n_buckets,
                             "transport": sync.name,
                             "metrics": m, "rollout_state": state})
                bar.set_postfix_str(f"tmpe {m['token_mult_prob_error']:.4f}")
                bar.update(1)
        del model
    return rows, info, layer_results
