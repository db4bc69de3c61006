"""`npu-flashrl rehearse`: one run, phase by phase (see the package docstring).

`run` checks the arguments, then `_run` calls one function per phase: `_model` (1. tiny or
--model), `_trainer` (2. training steps and trainer log-probs), `_setup` (3. profile / setup /
activate), `_rollouts` (4. the rollout variants) and `_report` + `_write_output` (5. output).
"""
from __future__ import annotations

import dataclasses
import json
import os
import time
from typing import Any, Dict, List, Optional

from npu_flashrl.rehearsal.arguments import check_arguments, check_seq_len
from npu_flashrl.rehearsal.common import (DEFAULT_BASELINE_TOL, MOE_BASELINE_TOL, MOE_CONFIG_KEYS, VARIANT_BF16,
                                          VARIANT_INT8, VARIANT_INT8_FP32HEAD, VARIANT_W4A8, RehearsalError, default_cache_root,
                                          RunBase, json_safe, process_seconds, progress_bar, versions)
from npu_flashrl.rehearsal.device import prepare_environment, quiet_logs, resolve_device
from npu_flashrl.rehearsal.model import check_model_dir, is_moe


def run(args) -> int:
    if getattr(args, "grpo", False):  # a GRPO run instead (npu_flashrl.rehearsal.grpo)
        from npu_flashrl.rehearsal.grpo import run as run_grpo

        return run_grpo(args)
    t_start = time.perf_counter()
    device, emulated = resolve_device(args.device)
    model_cfg = check_model_dir(args.model) if args.model is not None else None
    check_arguments(args)
    if args.model is None:
        from npu_flashrl.rehearsal.model import tiny_model_config

        model_cfg = tiny_model_config(args)  # a MoE tiny model's config drives the MoE checks
    check_seq_len(args, model_cfg)
    if args.baseline_tol is None:
        args.baseline_tol = MOE_BASELINE_TOL if is_moe(model_cfg) else DEFAULT_BASELINE_TOL
    if is_moe(model_cfg) and args.mode == "profile":
        raise RehearsalError(f"--mode profile with {_what(args)}: a mixture-of-experts model; FlashRL's "
                             "int8 profile covers dense layers only (npu_flashrl refuses it for MoE). Use "
                             "--mode profile-free (fresh per-channel scales per expert at every sync)")
    from npu_flashrl.rehearsal.user_setup import check_w4a8

    check_w4a8(args, model_cfg)
    from npu_flashrl.sim import faults

    try:
        faults.active()  # an unknown fault name is refused before anything starts
    except faults.FaultError as exc:
        raise RehearsalError(str(exc)) from None
    from npu_flashrl.rehearsal import transport as transport_mod

    transport = transport_mod.resolve(args.transport)  # a refused --transport verl: before anything starts
    prepare_environment(device, args.verbose)
    with quiet_logs(args.verbose):
        return _run(Run(args, device, emulated, t_start, model_cfg, transport))


def _what(args) -> str:
    return f"--model {args.model}" if args.model is not None else f"--arch {args.arch}"


@dataclasses.dataclass
class Run(RunBase):
    """One rehearsal: the checked arguments, and what the phases found (filled in as they go)."""
    args: Any
    device: str
    emulated: bool
    t_start: float
    model_cfg: Optional[dict]
    transport: Dict[str, Any]


@dataclasses.dataclass
class Model:
    """Phase 1: the bf16 checkpoint the rollout loads, the fp32 master the trainer starts from."""
    bf16_dir: str
    master_dir: str
    info: Dict[str, Any]
    step_lr: float
    vocab_size: int = 0


@dataclasses.dataclass
class Trained:
    """Phase 2: per step, the weights the trainer pushes and its log-probs on the eval sequences."""
    pushed: List[Any]
    train_logps: List[Dict[str, Any]]
    step_losses: List[Any]
    step_update: List[Any]


def _run(r: Run) -> int:
    import torch

    from npu_flashrl.sim.synthetic_task import MarkovTask

    r.prepare_output()
    task = MarkovTask()
    model = _model(r, task)
    eval_ids = task.sample(r.args.num_seqs, r.args.seq_len, torch.Generator().manual_seed(r.args.seed + 999))
    trained = _trainer(r, model, task, eval_ids)
    setup, applied = _setup(r, model)
    _setup_w4a8(r, model, setup)
    rows, infos, layer_results, entry_info = _rollouts(r, model, trained, eval_ids, setup)
    report, checks, summary = _report(r, task, model, trained, eval_ids, setup, applied, rows, infos,
                                      layer_results, entry_info)
    return _write_output(r, report, rows, summary, checks, layer_results)


def _model(r: Run, task) -> Model:
    """1. The tiny model (cached, trained on a miss) or the --model dir; its vocab fits the task."""
    from npu_flashrl.rehearsal.model import ensure_tiny_model, tiny_settings

    args = r.args
    t = time.perf_counter()
    if args.model is None:
        cache_root = os.path.abspath(os.path.expanduser(args.cache_dir or default_cache_root()))
        settings = tiny_settings(args, task)
        tiny = ensure_tiny_model(cache_root, settings, task, r.progress)
        model = Model(tiny["bf16_dir"], tiny["master_dir"],
                      {"source": "tiny", "dir": tiny["bf16_dir"], "cache_dir": tiny["dir"],
                       "cache_hit": tiny["cache_hit"], "cache_key": tiny["key"],
                       "trained_this_run": not tiny["cache_hit"], "pretrain": tiny["train"], "settings": settings},
                      args.step_lr if args.step_lr is not None else 5e-4)
    else:
        bf16_dir = os.path.abspath(args.model)
        cfg = r.model_cfg
        info = {"source": "local", "dir": bf16_dir, "cache_hit": None, "trained_this_run": False,
                "architectures": cfg.get("architectures"), "moe": is_moe(cfg)}
        if is_moe(cfg):
            # transformers 5 writes Qwen3-MoE's num_experts as num_local_experts
            info.update(num_experts=next((cfg[k] for k in MOE_CONFIG_KEYS if k in cfg), None),
                        num_experts_per_tok=cfg.get("num_experts_per_tok"))
        model = Model(bf16_dir, bf16_dir, info, args.step_lr if args.step_lr is not None else 1e-5)
    r.timings["model_s"] = time.perf_counter() - t
    r.timings["pretrain_s"] = (model.info.get("pretrain") or {}).get("seconds", 0.0) if model.info.get(
        "trained_this_run") else 0.0

    with open(os.path.join(model.bf16_dir, "config.json")) as f:
        model.vocab_size = int(json.load(f)["vocab_size"])
    if model.vocab_size < task.min_vocab_size:
        raise RehearsalError(f"--model {model.bf16_dir}: vocab_size {model.vocab_size} < {task.min_vocab_size} "
                             "needed by the synthetic task")
    return model


def _trainer(r: Run, model: Model, task, eval_ids) -> Trained:
    """2. The training steps on the fp32 master, then the trainer's log-probs after each."""
    import torch

    from npu_flashrl.adapters.verl.moe_names import sync_names
    from npu_flashrl.rehearsal.trainer import hf_load, simulate_training, trainer_logps

    args = r.args
    t = time.perf_counter()
    master = hf_load(model.master_dir, torch.float32, r.device)
    snapshots, step_losses, step_update = simulate_training(master, task, args.steps, args.inner_iters,
                                                            model.step_lr, args.seed, r.device, r.progress)
    model_type = getattr(master.config, "model_type", None)
    del master
    # what the trainer sends: verl's FSDP engine unfuses transformers 5's packed MoE experts into
    # per-expert checkpoint names (a dense model's names are unchanged)
    pushed = [sync_names(snap, model_type) for snap in snapshots]
    trainer = hf_load(model.bf16_dir, torch.bfloat16, r.device)
    train_logps = trainer_logps(trainer, snapshots, eval_ids, fp32_head=not args.no_fp32_head,
                                progress=r.progress)
    del trainer
    r.timings["trainer_s"] = time.perf_counter() - t
    return Trained(pushed, train_logps, step_losses, step_update)


def _setup(r: Run, model: Model):
    """3. profile / setup as a user runs them, then activation; returns (setup, activation result)."""
    import npu_flashrl
    from npu_flashrl.rehearsal.user_setup import prepare_config

    t = time.perf_counter()
    with progress_bar(3, "profile / setup / activate", r.progress) as bar:
        if r.device == "cpu":
            from npu_flashrl.sim import cpu_vllm

            cpu_vllm.prepare_process()  # torch_npu emulation + vLLM CPU platform, before vLLM loads
        bar.update(1)
        setup = prepare_config(r.args, model.bf16_dir, r.work, progress=False)
        bar.update(1)
        applied = npu_flashrl.activate(setup["config"])
        bar.update(1)
    r.timings["setup_s"] = time.perf_counter() - t
    return setup, applied


def _setup_w4a8(r: Run, model: Model, setup: Dict[str, Any]) -> None:
    """3b. With --w4a8: the W4A8 rollout model (a bf16 checkpoint under a W4A8_DYNAMIC
    description) and its config (`setup --fn w4a8_profile_free`)."""
    from npu_flashrl.rehearsal.user_setup import check_w4a8_line, prepare_w4a8, w4a8_group_size

    if not r.args.w4a8:
        return
    with open(os.path.join(model.bf16_dir, "config.json")) as f:
        cfg = json.load(f)
    check_w4a8_line(cfg)
    setup["w4a8"] = prepare_w4a8(model.bf16_dir, r.work, w4a8_group_size(cfg, r.args.group_size))


def _rollouts(r: Run, model: Model, trained: Trained, eval_ids, setup: Dict[str, Any]):
    """4. The rollout variants (bf16, int8, w4a8, int8+fp32head), every sync through the run's transport.
    Returns (rows, infos, per-layer results, the engine args the INT8 entry produced)."""
    from npu_flashrl.rehearsal import transport as transport_mod
    from npu_flashrl.rehearsal.rollout import Rollouts, Variant, make_rollout, run_variant
    from npu_flashrl.rehearsal.user_setup import activate_entry

    args, device = r.args, r.device
    # the state check's own copy of the profile (read from the file setup wrote, not the loader's)
    profile = None
    if setup.get("profile"):
        from npu_flashrl.profile import load_profile

        profile = load_profile(setup["profile"])

    def bf16_build():  # an engine without npu_flashrl's choice: vLLM's own bf16 model
        return make_rollout(device, model.bf16_dir, None)

    entry_info: Dict[str, Any] = {}

    def build(config_path: str, model_dir: str, info: Dict[str, Any]):
        """The engine of one FlashRL config (activated for this engine: the process's config is
        the last one activated; each engine carries its own choice)."""
        engine_args, entry, _, _ = activate_entry(config_path, model_dir)
        info.update(fn=entry.fn, model=engine_args.model, quantization=engine_args.quantization,
                    load_format=engine_args.load_format)
        return make_rollout(device, engine_args.model, engine_args.quantization, engine_args.load_format or "auto",
                            additional_config=getattr(engine_args, "additional_config", None))

    def int8_build():
        return build(setup["config"], model.bf16_dir, entry_info)

    w4a8 = setup.get("w4a8") or {}
    w4a8_entry: Dict[str, Any] = {}

    def w4a8_build():
        return build(w4a8["config"], w4a8["model"], w4a8_entry)

    rows: List[Dict[str, Any]] = []
    infos: Dict[str, Dict[str, Any]] = {}
    layer_results: Dict[str, List[Dict[str, Any]]] = {}
    t = time.perf_counter()
    # every variant's syncs take the same path (the bf16 baseline included)
    with transport_mod.make(r.transport, args.buckets, r.work, device) as sync:
        shared = Rollouts(trained.pushed, eval_ids, trained.train_logps, model.vocab_size, device, args.seed,
                          r.progress, sync, profile=profile, model_config=r.model_cfg)
        variant_rows, infos[VARIANT_BF16], _ = run_variant(Variant(VARIANT_BF16, bf16_build, "bf16"), shared)
        rows += variant_rows
        variant_rows, infos[VARIANT_INT8], layer_results[VARIANT_INT8] = run_variant(
            Variant(VARIANT_INT8, int8_build, "bf16", setup["fn"]), shared)
        rows += variant_rows
        if "config" in w4a8:
            variant_rows, infos[VARIANT_W4A8], layer_results[VARIANT_W4A8] = run_variant(
                Variant(VARIANT_W4A8, w4a8_build, "bf16", w4a8["fn"]), shared)
            rows += variant_rows
            w4a8["entry"] = w4a8_entry
        if not args.no_fp32_head:
            # FLASHRL_LMHEAD_FP32 on the rollout side: the patches are process-global, so this variant
            # runs last (the models above were built and measured without them).
            from npu_flashrl.adapters import vllm_lm_head as vllm_fp32

            vllm_fp32.enable_lm_head_fp32()
            variant_rows, infos[VARIANT_INT8_FP32HEAD], layer_results[VARIANT_INT8_FP32HEAD] = run_variant(
                Variant(VARIANT_INT8_FP32HEAD, int8_build, "fp32head", setup["fn"]), shared)
            rows += variant_rows
        r.transport.update(sync.info())
    r.timings["rollout_s"] = time.perf_counter() - t
    return rows, infos, layer_results, entry_info


def _report(r: Run, task, model: Model, trained: Trained, eval_ids, setup, applied, rows, infos, layer_results,
            entry_info):
    """5a. The checks' verdict, the plot and report.json's content; returns (report, checks, summary)."""
    from npu_flashrl import patches
    from npu_flashrl.rehearsal.checks import evaluate_checks, summaries
    from npu_flashrl.rehearsal.output import write_plot
    from npu_flashrl.rehearsal.state import by_type, state_rules
    from npu_flashrl.rehearsal.state_w4a8 import state_rules as w4a8_state_rules

    args, device, emulated = r.args, r.device, r.emulated
    checks = evaluate_checks(rows, infos, args, layer_results, device)
    ok = all(c["ok"] for c in checks)
    plot_path = None
    plot_note = None
    if not args.no_plot:
        plot_path = write_plot(rows, os.path.join(r.output_dir, "mismatch.png"))
        if plot_path is None:
            plot_note = "matplotlib is not installed: no plot (pip install matplotlib)"
    r.timings["total_s"] = time.perf_counter() - r.t_start
    r.timings["process_s"] = process_seconds()  # including Python start-up and imports before run()
    status = patches.status()
    summary = summaries(rows)
    fault = next((i.get("fault_injected") for i in infos.values() if i.get("fault_injected")), None)
    report = {
        "ok": ok,
        "exit_code": 0 if ok else 1,
        "settings": {k: v for k, v in vars(args).items() if k != "func"},
        "resolved": {"device": device, "emulated_torch_npu": emulated, "threads": r.threads,
                     "step_lr": model.step_lr, "baseline_tol": args.baseline_tol,
                     "fn": setup["fn"], "entry": entry_info},
        "device": {"device": device, "emulated": emulated,
                   "note": ("CPU with emulated torch_npu kernels" if emulated
                            else "real NPU (not verified on hardware)")},
        "transport": r.transport,
        "model": model.info,
        "task": task.to_dict(),
        "eval": {"num_seqs": args.num_seqs, "seq_len": args.seq_len,
                 "scored_tokens": int(eval_ids[:, 1:].numel())},
        "setup": setup,
        "steps": json_safe(rows),
        "step_train_loss": trained.step_losses,
        "step_weight_update_rel": trained.step_update,
        "summary": summary,
        "variants": infos,
        "checks": checks,
        "rollout_state": {v: {"by_type": by_type(rs), "per_sync": [x["rollout_state"] for x in rows if x["variant"] == v],
                           "layers": rs} for v, rs in layer_results.items()},
        "int8_state_rules": state_rules(device, args.max_layer_error),
        "w4a8_state_rules": w4a8_state_rules(args.max_w4a8_layer_error) if VARIANT_W4A8 in layer_results else None,
        "fault_injected": fault,
        "timings": r.timings,
        "patches": {"applied": [p["name"] for p in status if p["applied"]], "activation_result": applied,
                    "status": status},
        "versions": versions(),
        "plot": plot_path,
        "plot_note": plot_note,
    }
    return report, checks, summary


def _write_output(r: Run, report, rows, summary, checks, layer_results) -> int:
    """5b. report.json (atomic), then the tables on stdout; the exit code."""
    from npu_flashrl.config import atomic_write
    from npu_flashrl.rehearsal.output import print_summary

    report_path = os.path.join(r.output_dir, "report.json")
    atomic_write(report_path, lambda f: json.dump(json_safe(report), f, indent=2))
    print_summary(rows, summary, checks, report["patches"]["applied"], report, report_path, layer_results)
    return report["exit_code"]
