"""`npu-flashrl rehearse`: one run, phase by phase (see the package docstring)."""
from __future__ import annotations

import json
import os
import time
from typing import Any, Dict, List, Optional

from npu_flashrl.rehearsal import faults
from npu_flashrl.rehearsal.arguments import check_arguments
from npu_flashrl.rehearsal.common import (DEFAULT_BASELINE_TOL, MOE_BASELINE_TOL, MOE_CONFIG_KEYS, VARIANT_BF16,
                                          VARIANT_INT8, VARIANT_INT8_FP32HEAD, RehearsalError, default_cache_root,
                                          json_safe, process_seconds, progress_bar, versions)
from npu_flashrl.rehearsal.device import prepare_environment, quiet_logs, resolve_device
from npu_flashrl.rehearsal.model import check_model_dir, is_moe


def run(args) -> int:
    if getattr(args, "grpo", False):  # issue 25: a GRPO run instead (npu_flashrl.rehearsal.grpo)
        from npu_flashrl.rehearsal.grpo import run as run_grpo

        return run_grpo(args)
    t_start = time.perf_counter()
    device, emulated = resolve_device(args.device)
    model_cfg = check_model_dir(args.model) if args.model is not None else None
    check_arguments(args)
    if args.baseline_tol is None:
        args.baseline_tol = MOE_BASELINE_TOL if is_moe(model_cfg) else DEFAULT_BASELINE_TOL
    if is_moe(model_cfg) and args.mode == "profile":
        raise RehearsalError(f"--mode profile with --model {args.model}: a mixture-of-experts model; FlashRL's "
                             "int8 profile covers dense layers only (npu_flashrl refuses it for MoE). Use "
                             "--mode profile-free (fresh per-channel scales per expert at every sync)")
    faults.active()  # an unknown fault name is refused before anything starts
    from npu_flashrl.rehearsal import transport as transport_mod

    transport = transport_mod.resolve(args.transport)  # a refused --transport verl: before anything starts
    prepare_environment(device, args.verbose)
    with quiet_logs(args.verbose):
        return _run(args, device, emulated, t_start, model_cfg, transport)


def _run(args, device: str, emulated: bool, t_start: float, model_cfg: Optional[dict],
         transport: Dict[str, Any]) -> int:
    import torch

    from npu_flashrl import patches
    from npu_flashrl.config import atomic_write
    from npu_flashrl.rehearsal.checks import evaluate_checks, summaries
    from npu_flashrl.rehearsal.cli_setup import activate_entry, prepare_config
    from npu_flashrl.rehearsal.model import ensure_tiny_model, tiny_settings
    from npu_flashrl.rehearsal.output import print_summary, write_plot
    from npu_flashrl.rehearsal import transport as transport_mod
    from npu_flashrl.rehearsal.rollout import make_rollout, run_variant
    from npu_flashrl.rehearsal.state import by_type, state_rules
    from npu_flashrl.adapters.verl.moe_names import sync_names
    from npu_flashrl.rehearsal.trainer import hf_load, simulate_training, trainer_logps
    from npu_flashrl.sim.synthetic_task import MarkovTask

    progress = not args.no_progress
    threads = args.threads if args.threads is not None else (1 if device == "cpu" else None)
    if threads:
        torch.set_num_threads(threads)
    timings: Dict[str, float] = {}
    output_dir = os.path.abspath(args.output_dir)
    work = os.path.join(output_dir, "work")
    os.makedirs(work, exist_ok=True)
    task = MarkovTask()

    # ---------------------------------------------------------------- 1. model
    t = time.perf_counter()
    if args.model is None:
        cache_root = os.path.abspath(os.path.expanduser(args.cache_dir or default_cache_root()))
        settings = tiny_settings(args, task)
        tiny = ensure_tiny_model(cache_root, settings, task, progress)
        bf16_dir, master_dir = tiny["bf16_dir"], tiny["master_dir"]
        model_info = {"source": "tiny", "dir": bf16_dir, "cache_dir": tiny["dir"], "cache_hit": tiny["cache_hit"],
                      "cache_key": tiny["key"], "trained_this_run": not tiny["cache_hit"],
                      "pretrain": tiny["train"], "settings": settings}
        step_lr = args.step_lr if args.step_lr is not None else 5e-4
    else:
        bf16_dir = master_dir = os.path.abspath(args.model)
        model_info = {"source": "local", "dir": bf16_dir, "cache_hit": None, "trained_this_run": False,
                      "architectures": model_cfg.get("architectures"), "moe": is_moe(model_cfg)}
        if is_moe(model_cfg):
            # transformers 5 writes Qwen3-MoE's num_experts as num_local_experts
            model_info.update(num_experts=next((model_cfg[k] for k in MOE_CONFIG_KEYS if k in model_cfg), None),
                              num_experts_per_tok=model_cfg.get("num_experts_per_tok"))
        step_lr = args.step_lr if args.step_lr is not None else 1e-5
    timings["model_s"] = time.perf_counter() - t
    timings["pretrain_s"] = (model_info.get("pretrain") or {}).get("seconds", 0.0) if model_info.get(
        "trained_this_run") else 0.0

    with open(os.path.join(bf16_dir, "config.json")) as f:
        vocab_size = int(json.load(f)["vocab_size"])
    if vocab_size < task.min_vocab_size:
        raise RehearsalError(f"--model {bf16_dir}: vocab_size {vocab_size} < {task.min_vocab_size} needed by "
                             "the synthetic task")
    eval_ids = task.sample(args.num_seqs, args.seq_len, torch.Generator().manual_seed(args.seed + 999))

    # ---------------------------------------------------------------- 2. trainer: steps + log-probs
    t = time.perf_counter()
    master = hf_load(master_dir, torch.float32, device)
    snapshots, step_losses, step_update = simulate_training(master, task, args.steps, args.inner_iters, step_lr,
                                               args.seed, device, progress)
    model_type = getattr(master.config, "model_type", None)
    del master
    # what the trainer sends: verl's FSDP engine unfuses transformers 5's packed MoE experts into
    # per-expert checkpoint names (a dense model's names are unchanged)
    pushed = [sync_names(snap, model_type) for snap in snapshots]
    trainer = hf_load(bf16_dir, torch.bfloat16, device)
    train_logps = trainer_logps(trainer, snapshots, eval_ids, fp32_head=not args.no_fp32_head, progress=progress)
    del trainer
    timings["trainer_s"] = time.perf_counter() - t

    # ---------------------------------------------------------------- 3. setup + activation
    t = time.perf_counter()
    with progress_bar(3, "profile / setup / activate", progress) as bar:
        if device == "cpu":
            from npu_flashrl.sim import cpu_vllm

            cpu_vllm.prepare_process()  # torch_npu emulation + vLLM CPU platform, before vLLM loads
        bar.update(1)
        setup = prepare_config(args, bf16_dir, work, progress=False)
        bar.update(1)
        import npu_flashrl

        applied = npu_flashrl.activate(setup["config"])
        bar.update(1)
    timings["setup_s"] = time.perf_counter() - t

    # ---------------------------------------------------------------- 4. rollout variants
    rows: List[Dict[str, Any]] = []
    infos: Dict[str, Dict[str, Any]] = {}
    layer_results: Dict[str, List[Dict[str, Any]]] = {}
    # the state check's own copy of the profile (read from the file setup wrote, not the loader's)
    profile = None
    if setup.get("profile"):
        from npu_flashrl.profile import load_profile

        profile = load_profile(setup["profile"])

    def bf16_build():  # an engine without npu_flashrl's choice: vLLM's own bf16 model
        return make_rollout(device, bf16_dir, None)

    entry_info: Dict[str, Any] = {}

    def int8_build():
        engine_args, entry, _, _ = activate_entry(setup["config"], bf16_dir)
        entry_info.update(fn=entry.fn, model=engine_args.model, quantization=engine_args.quantization,
                          load_format=engine_args.load_format)
        return make_rollout(device, engine_args.model, engine_args.quantization, engine_args.load_format or "auto",
                            additional_config=getattr(engine_args, "additional_config", None))

    t = time.perf_counter()
    # every variant's syncs take the same path (the bf16 baseline included)
    with transport_mod.make(transport, args.buckets, work, device) as sync:
        r, infos[VARIANT_BF16], _ = run_variant(VARIANT_BF16, bf16_build, pushed, eval_ids, train_logps,
                                                "bf16", args, vocab_size, device, int8=False, progress=progress,
                                                sync=sync, model_config=model_cfg)
        rows += r
        r, infos[VARIANT_INT8], layer_results[VARIANT_INT8] = run_variant(
            VARIANT_INT8, int8_build, pushed, eval_ids, train_logps, "bf16", args, vocab_size, device,
            int8=True, progress=progress, sync=sync, profile=profile, model_config=model_cfg)
        rows += r
        if not args.no_fp32_head:
            # FLASHRL_LMHEAD_FP32 on the rollout side: the patches are process-global, so this variant
            # runs last (the models above were built and measured without them).
            from npu_flashrl.adapters import vllm as vllm_fp32

            vllm_fp32.enable_lm_head_fp32()
            r, infos[VARIANT_INT8_FP32HEAD], layer_results[VARIANT_INT8_FP32HEAD] = run_variant(
                VARIANT_INT8_FP32HEAD, int8_build, pushed, eval_ids, train_logps, "fp32head", args,
                vocab_size, device, int8=True, progress=progress, sync=sync, profile=profile,
                model_config=model_cfg)
            rows += r
        transport.update(sync.info())
    timings["rollout_s"] = time.perf_counter() - t

    # ---------------------------------------------------------------- 5. output
    checks = evaluate_checks(rows, infos, args, layer_results, device)
    ok = all(c["ok"] for c in checks)
    plot_path = None
    plot_note = None
    if not args.no_plot:
        plot_path = write_plot(rows, os.path.join(output_dir, "mismatch.png"))
        if plot_path is None:
            plot_note = "matplotlib is not installed: no plot (pip install matplotlib)"
    timings["total_s"] = time.perf_counter() - t_start
    timings["process_s"] = process_seconds()  # including Python start-up and imports before run()
    status = patches.status()
    applied_names = [p["name"] for p in status if p["applied"]]
    summary = summaries(rows)
    fault = next((i.get("fault_injected") for i in infos.values() if i.get("fault_injected")), None)
    report = {
        "ok": ok,
        "exit_code": 0 if ok else 1,
        "settings": {k: v for k, v in vars(args).items() if k != "func"},
        "resolved": {"device": device, "emulated_torch_npu": emulated, "threads": threads, "step_lr": step_lr,
                     "baseline_tol": args.baseline_tol,
                     "fn": setup["fn"], "entry": entry_info},
        "device": {"device": device, "emulated": emulated,
                   "note": ("CPU with emulated torch_npu kernels" if emulated
                            else "real NPU (not verified on hardware)")},
        "transport": transport,
        "model": model_info,
        "task": task.to_dict(),
        "eval": {"num_seqs": args.num_seqs, "seq_len": args.seq_len,
                 "scored_tokens": int(eval_ids[:, 1:].numel())},
        "setup": setup,
        "steps": json_safe(rows),
        "step_train_loss": step_losses,
        "step_weight_update_rel": step_update,
        "summary": summary,
        "variants": infos,
        "checks": checks,
        "int8_state": {v: {"by_type": by_type(rs), "per_sync": [r["int8_state"] for r in rows if r["variant"] == v],
                           "layers": rs} for v, rs in layer_results.items()},
        "int8_state_rules": state_rules(device, args.max_layer_error),
        "fault_injected": fault,
        "timings": timings,
        "patches": {"applied": applied_names, "activation_result": applied, "status": status},
        "versions": versions(),
        "plot": plot_path,
        "plot_note": plot_note,
    }
    report_path = os.path.join(output_dir, "report.json")
    atomic_write(report_path, lambda f: json.dump(json_safe(report), f, indent=2))

    print_summary(rows, summary, checks, applied_names, report, report_path, layer_results)
    return 0 if ok else 1
