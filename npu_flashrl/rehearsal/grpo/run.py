"""`npu-flashrl rehearse --grpo`: one run, phase by phase (see the package docstring)."""
from __future__ import annotations

import json
import os
import time
from typing import Any, Dict, List

from npu_flashrl.rehearsal.common import RehearsalError, default_cache_root, json_safe, process_seconds, versions


STAND_INS = [
    "the trainer: transformers' Qwen2 with fp32 masters under bf16 autocast (one process), in place of verl's "
    "FSDP actor; verl's loss functions get its log-probs",
    "vLLM's attention backend: plain causal attention per sequence of the batch (no KV cache, the whole "
    "sequence re-run per sampled token), in place of the engine's paged attention",
    "sampling: softmax(logits) at temperature 1 with a private torch generator, in place of vLLM's sampler",
]


def _faults():
    """The rehearsal's fault seam (NPU_FLASHRL_REHEARSAL_FAULT), part of the CPU simulation."""
    from npu_flashrl.sim import faults

    return faults


def run(args) -> int:
    from npu_flashrl.rehearsal.arguments import check_arguments
    from npu_flashrl.rehearsal.device import prepare_environment, quiet_logs, resolve_device
    from npu_flashrl.rehearsal.grpo.settings import resolve

    t_start = time.perf_counter()
    if args.model is not None:
        raise RehearsalError(f"--grpo with --model {args.model}: the GRPO task is the synthetic chain the "
                             "built-in tiny model was pre-trained on; run --grpo without --model")
    device, emulated = resolve_device(args.device)
    check_arguments(args)
    settings = resolve(args)
    if settings.steps < 2:
        raise RehearsalError(f"--grpo needs --steps >= 2 (first and final rewards), got {settings.steps}")
    faults = _faults()
    try:
        faults.active()  # an unknown fault name is refused before anything starts
    except faults.FaultError as exc:
        raise RehearsalError(str(exc)) from None
    from npu_flashrl.rehearsal import transport as transport_mod

    transport = transport_mod.resolve(args.transport)
    prepare_environment(device, args.verbose)
    with quiet_logs(args.verbose):
        return _run(args, settings, device, emulated, t_start, transport)


def _run(args, settings, device: str, emulated: bool, t_start: float, transport: Dict[str, Any]) -> int:
    import torch

    from npu_flashrl import patches
    from npu_flashrl.config import atomic_write
    from npu_flashrl.rehearsal import transport as transport_mod
    from npu_flashrl.rehearsal.user_setup import activate_entry, prepare_config
    from npu_flashrl.rehearsal.common import progress_bar
    from npu_flashrl.rehearsal.grpo import checks as grpo_checks
    from npu_flashrl.rehearsal.grpo import report as grpo_report
    from npu_flashrl.rehearsal.grpo.loop import RolloutHandle, run_variant_seeds
    from npu_flashrl.rehearsal.grpo.settings import (VARIANT_BF16, VARIANT_INT8, VARIANT_INT8_TIS,
                                                     VARIANT_INT8_TIS_FP32HEAD)
    from npu_flashrl.rehearsal.grpo.task import GreedyChainTask
    from npu_flashrl.rehearsal.grpo.trainer import GrpoTrainer
    from npu_flashrl.rehearsal.grpo.verl_algo import VerlGrpo
    from npu_flashrl.rehearsal.model import ensure_tiny_model, tiny_settings
    from npu_flashrl.rehearsal.rollout import make_rollout
    from npu_flashrl.sim.synthetic_task import MarkovTask

    faults = _faults()
    progress = not args.no_progress
    threads = args.threads if args.threads is not None else (1 if device == "cpu" else None)
    if threads:
        torch.set_num_threads(threads)
    timings: Dict[str, float] = {}
    output_dir = os.path.abspath(args.output_dir)
    work = os.path.join(output_dir, "work")
    os.makedirs(work, exist_ok=True)
    markov = MarkovTask()
    task = GreedyChainTask(markov, settings.prompt_len, settings.response_len)

    # ---------------------------------------------------------------- 1. model (the default rehearsal's)
    t = time.perf_counter()
    cache_root = os.path.abspath(os.path.expanduser(args.cache_dir or default_cache_root()))
    tiny = ensure_tiny_model(cache_root, tiny_settings(args, markov), markov, progress)
    bf16_dir = tiny["bf16_dir"]
    timings["model_s"] = time.perf_counter() - t
    with open(os.path.join(bf16_dir, "config.json")) as f:
        vocab_size = int(json.load(f)["vocab_size"])

    # ---------------------------------------------------------------- 2. setup + activation
    t = time.perf_counter()
    with progress_bar(3, "setup / activate / verl", progress) as bar:
        if device == "cpu":
            from npu_flashrl.sim import cpu_vllm

            cpu_vllm.prepare_process()
        bar.update(1)
        setup = prepare_config(args, bf16_dir, work, progress=False)
        import npu_flashrl

        applied = npu_flashrl.activate(setup["config"])
        bar.update(1)
        VerlGrpo(tis=True, mini_batch_size=1, group_size=1)  # verl's imports, once, before the timed runs
        bar.update(1)
    timings["setup_s"] = time.perf_counter() - t
    profile = None
    if setup.get("profile"):
        from npu_flashrl.profile import load_profile

        profile = load_profile(setup["profile"])

    def bf16_build():  # an engine without npu_flashrl's choice: vLLM's own bf16 model
        return make_rollout(device, bf16_dir, None)

    def int8_build():
        engine_args, _, _, _ = activate_entry(setup["config"], bf16_dir)
        return make_rollout(device, engine_args.model, engine_args.quantization, engine_args.load_format or "auto",
                            additional_config=getattr(engine_args, "additional_config", None))

    # ---------------------------------------------------------------- 3. GRPO runs
    t = time.perf_counter()
    trainer = GrpoTrainer(tiny["master_dir"], device, settings.lr)
    results: Dict[str, Dict[str, Any]] = {}
    infos: Dict[str, Dict[str, Any]] = {}
    layer_results: Dict[str, List[Dict[str, Any]]] = {}
    sync_counter = [0]
    plan = [("bf16", bf16_build, False, [VARIANT_BF16]),
            ("int8", int8_build, True, [VARIANT_INT8, VARIANT_INT8_TIS]),
            ("int8+fp32head", int8_build, True, [VARIANT_INT8_TIS_FP32HEAD])]
    if args.no_fp32_head:
        plan.pop()
    with transport_mod.make(transport, args.buckets, work, device) as sync:
        for rollout_name, build, int8, variants in plan:
            if rollout_name == "int8+fp32head":
                # FLASHRL_LMHEAD_FP32 on the rollout side: process-global, so this rollout model is built
                # (and used) last
                from npu_flashrl.adapters import vllm as vllm_fp32

                vllm_fp32.enable_lm_head_fp32()
            t0 = time.perf_counter()
            with build() as v:
                handle = RolloutHandle(v, int8, device, args.seed, profile, faults)
                handle.info["build_s"] = time.perf_counter() - t0
                sync.attach(v)
                for variant in variants:
                    infos[variant] = dict(handle.info, rollout=rollout_name)
                    lr_list: List[Dict[str, Any]] = []
                    results[variant] = run_variant_seeds(variant, handle, trainer, task, settings, sync, vocab_size,
                                                         device, args.seed, sync_counter, lr_list, progress, VerlGrpo)
                    if int8:
                        layer_results[variant] = lr_list
                del handle
        transport.update(sync.info())
    timings["grpo_s"] = time.perf_counter() - t

    # ---------------------------------------------------------------- 4. verdict + output
    summary = grpo_report.summarize(results, settings)
    checks = grpo_checks.evaluate(results, summary, infos, layer_results, settings, device, args.max_layer_error)
    ok = all(c["ok"] for c in checks)
    plot_path = plot_note = None
    if not args.no_plot:
        plot_path = grpo_report.write_plot(summary, settings, os.path.join(output_dir, "grpo.png"))
        if plot_path is None:
            plot_note = "matplotlib is not installed: no plot (pip install matplotlib)"
    timings["total_s"] = time.perf_counter() - t_start
    timings["process_s"] = process_seconds()
    status = patches.status()
    fault = next((i.get("fault_injected") for i in infos.values() if i.get("fault_injected")), None)
    from npu_flashrl.rehearsal.state import by_type, state_rules

    report = {
        "ok": ok, "exit_code": 0 if ok else 1, "mode": "grpo",
        "settings": {k: v for k, v in vars(args).items() if k != "func"},
        "grpo": {"settings": settings.to_dict(), "task": task.to_dict(), "variants": summary["variants"],
                 "bounds": summary["bounds"], "algorithm": {v: r["algo"] for v, r in results.items()},
                 "rows": [r for res in results.values() for r in res["rows"]], "stand_ins": STAND_INS},
        "resolved": {"device": device, "emulated_torch_npu": emulated, "threads": threads, "fn": setup["fn"]},
        "transport": transport, "model": {"source": "tiny", "dir": bf16_dir, "cache_hit": tiny["cache_hit"]},
        "rollouts": infos, "checks": checks,
        "int8_state": {v: {"by_type": by_type(rs), "syncs": len({r["step"] for r in rs})}
                       for v, rs in layer_results.items()},
        "int8_state_rules": state_rules(device, args.max_layer_error),
        "fault_injected": fault, "timings": timings,
        "patches": {"applied": [p["name"] for p in status if p["applied"]], "activation_result": applied},
        "versions": versions(), "plot": plot_path, "plot_note": plot_note,
    }
    report_path = os.path.join(output_dir, "report.json")
    atomic_write(report_path, lambda f: json.dump(json_safe(report), f, indent=2))
    grpo_report.print_summary(report, summary, checks, report_path)
    return 0 if ok else 1
