"""`npu-flashrl rehearse --grpo`: one run, phase by phase (see the package docstring).

Phases: `_model` (the cached tiny model), `_setup` (npu-flashrl setup, activation, verl's imports),
`_runs` (every variant and control on its rollout model, each run's held-out score), `_report`
(statistics, verdict, report.json, grpo.png, the printed summary).
"""
from __future__ import annotations

import dataclasses
import json
import os
import resource
import time
from typing import Any, Callable, Dict, List, Optional, Tuple

from npu_flashrl.rehearsal.common import (
    RehearsalError, RunBase, default_cache_root, json_safe, process_seconds, versions)


STAND_INS = [
    "the trainer: transformers' Qwen2 with fp32 masters under bf16 autocast (one process), in place of verl's "
    "FSDP actor; verl's loss functions get its log-probs",
    "vLLM's attention backend: plain causal attention per sequence of the batch (no KV cache, the whole "
    "sequence re-run per sampled token), in place of the engine's paged attention",
    "sampling: softmax(logits) at temperature 1 with a private torch generator, in place of vLLM's sampler",
]


POSITIVE_STAND_IN = [
    "positive control: the quantized rollout's departure from the trainer made larger by sampling from its logits "
    "x a scale (temperature 1 / scale; log-probs of the distribution sampled, verl's logprobs_mode "
    "processed_logprobs), standing in for a larger quantization-driven mismatch (positive.SETTINGS)",
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
    from npu_flashrl.rehearsal.model import tiny_model_config
    from npu_flashrl.rehearsal.user_setup import check_w4a8

    check_w4a8(args, tiny_model_config(args))
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
        return _run(Run(args, settings, device, emulated, t_start, transport))


@dataclasses.dataclass
class Run(RunBase):
    """One GRPO rehearsal: the checked arguments, and what the phases found (filled in as they go)."""
    args: Any
    settings: Any
    device: str
    emulated: bool
    t_start: float
    transport: Dict[str, Any]


@dataclasses.dataclass
class Model:
    """Phase 1: the cached tiny model."""
    bf16_dir: str
    master_dir: str
    cache_hit: bool
    vocab_size: int


@dataclasses.dataclass
class Setup:
    """Phase 2: the written config, what activation applied, the FlashRL profile, the rollout builders."""
    fn: str
    applied: Any
    builders: Dict[str, Callable[[], Any]]
    profile: Any = None
    fns: Dict[str, Optional[str]] = dataclasses.field(default_factory=dict)  # rollout kind -> its config fn
    w4a8: Optional[Dict[str, Any]] = None  # --w4a8: the W4A8 rollout's model dir, config, group size


@dataclasses.dataclass
class Runs:
    """Phase 3: per variant its runs and rollout info, the INT8 state checks, the held-out scores; the
    positive control's runs (`positive.py`) and their held-out setup per task size."""
    results: Dict[str, Dict[str, Any]]
    infos: Dict[str, Dict[str, Any]]
    layer_results: Dict[str, List[Dict[str, Any]]]
    heldout: Dict[str, Any]
    positive: Dict[str, Dict[str, Any]] = dataclasses.field(default_factory=dict)
    positive_pretrained: Dict[Any, float] = dataclasses.field(default_factory=dict)


def _run(r: Run) -> int:
    from npu_flashrl.rehearsal.grpo.task import GreedyChainTask
    from npu_flashrl.sim.synthetic_task import MarkovTask

    r.prepare_output()
    markov = MarkovTask()
    task = GreedyChainTask(markov, r.settings.prompt_len, r.settings.response_len)
    model = _model(r, markov)
    setup = _setup(r, model)
    runs = _runs(r, task, model, setup)
    return _report(r, task, model, setup, runs)


def _model(r: Run, markov) -> Model:
    """The default rehearsal's pre-trained tiny model of `--arch` (cached)."""
    from npu_flashrl.rehearsal.model import ensure_tiny_model, tiny_settings

    t = time.perf_counter()
    cache_root = os.path.abspath(os.path.expanduser(r.args.cache_dir or default_cache_root()))
    tiny = ensure_tiny_model(cache_root, tiny_settings(r.args, markov), markov, r.progress)
    r.timings["model_s"] = time.perf_counter() - t
    with open(os.path.join(tiny["bf16_dir"], "config.json")) as f:
        vocab_size = int(json.load(f)["vocab_size"])
    return Model(tiny["bf16_dir"], tiny["master_dir"], tiny["cache_hit"], vocab_size)


def _setup(r: Run, model: Model) -> Setup:
    """`npu-flashrl setup` and activation as a user runs them; verl's imports once, before the timed runs."""
    import npu_flashrl
    from npu_flashrl.rehearsal.common import progress_bar
    from npu_flashrl.rehearsal.grpo.verl_algo import VerlGrpo
    from npu_flashrl.rehearsal.rollout import make_rollout
    from npu_flashrl.rehearsal.user_setup import activate_entry, prepare_config

    t = time.perf_counter()
    with progress_bar(3, "setup / activate / verl", r.progress) as bar:
        if r.device == "cpu":
            from npu_flashrl.sim import cpu_vllm

            cpu_vllm.prepare_process()
        bar.update(1)
        setup = prepare_config(r.args, model.bf16_dir, r.work, progress=False)
        applied = npu_flashrl.activate(setup["config"])
        bar.update(1)
        VerlGrpo(tis=True, mini_batch_size=1, group_size=1)
        bar.update(1)
    r.timings["setup_s"] = time.perf_counter() - t
    profile = None
    if setup.get("profile"):
        from npu_flashrl.profile import load_profile

        profile = load_profile(setup["profile"])

    def bf16_build():  # an engine without npu_flashrl's choice: vLLM's own bf16 model
        return make_rollout(r.device, model.bf16_dir, None)

    def build(config_path: str, model_dir: str):
        engine_args, _, _, _ = activate_entry(config_path, model_dir)
        return make_rollout(r.device, engine_args.model, engine_args.quantization, engine_args.load_format or "auto",
                            additional_config=getattr(engine_args, "additional_config", None))

    def int8_build():
        return build(setup["config"], model.bf16_dir)

    builders = {"bf16": bf16_build, "int8": int8_build, "int8+fp32head": int8_build}
    fns: Dict[str, Optional[str]] = {"bf16": None, "int8": setup["fn"], "int8+fp32head": setup["fn"]}
    if r.settings.w4a8:  # the W4A8 rollout as the default rehearsal's --w4a8 sets it up
        from npu_flashrl.rehearsal.user_setup import check_w4a8_line, prepare_w4a8, w4a8_group_size

        check_w4a8_line()
        with open(os.path.join(model.bf16_dir, "config.json")) as f:
            w4a8 = prepare_w4a8(model.bf16_dir, r.work, w4a8_group_size(json.load(f), r.args.group_size))

        def w4a8_build():
            return build(w4a8["config"], w4a8["model"])

        builders["w4a8"], fns["w4a8"] = w4a8_build, w4a8["fn"]
        setup["w4a8"] = w4a8
    return Setup(setup["fn"], applied, builders, profile, fns, setup.get("w4a8"))


def _runs(r: Run, task, model: Model, setup: Setup) -> Runs:
    """Every variant (and control, and the positive control's runs) on its rollout model, in the order
    of `plan`; one rollout model per rollout kind serves all its variants and seeds. The fp32-head
    rollout (process-global patches) last."""
    from npu_flashrl.rehearsal import transport as transport_mod
    from npu_flashrl.rehearsal.grpo import heldout as heldout_mod
    from npu_flashrl.rehearsal.grpo import positive
    from npu_flashrl.rehearsal.grpo.loop import RolloutHandle, run_variant_seeds
    from npu_flashrl.rehearsal.grpo.task import GreedyChainTask
    from npu_flashrl.rehearsal.grpo.trainer import GrpoTrainer
    from npu_flashrl.rehearsal.grpo.verl_algo import VerlGrpo

    s = r.settings
    t = time.perf_counter()
    trainer = GrpoTrainer(model.master_dir, r.device, s.lr)
    prompts, heldout_info = heldout_mod.heldout_prompts(task, s, r.args.seed)
    trainer.reset()
    heldout_info["pretrained"] = heldout_mod.score(trainer, task, prompts, False)

    def scorer(tk, ps):
        return lambda tr, fp32_head: heldout_mod.score(tr, tk, ps, fp32_head)

    # (variant, its settings, its task, its held-out scorer, where its results go)
    Job = Tuple[Any, Any, Any, Callable[[Any, bool], float], str]
    jobs: List[Job] = [(v, s, task, scorer(task, prompts), "main") for v in s.variants()
                       if not (r.args.no_fp32_head and v.fp32_head)]
    pc_pretrained: Dict[Any, float] = {}
    if s.positive_control:
        pc_tasks: Dict[Any, Any] = {}
        for job in positive.jobs(s, positive.table_for(s)):
            if job.task_key not in pc_tasks:  # the bf16 job of a task size comes first, with its most seeds
                tk = GreedyChainTask(task.markov, s.prompt_len, job.task_key[0])
                ps, _ = heldout_mod.heldout_prompts(tk, job.settings, r.args.seed)
                trainer.reset()
                pc_pretrained[job.task_key] = heldout_mod.score(trainer, tk, ps, False)
                pc_tasks[job.task_key] = (tk, scorer(tk, ps))
            tk, sc = pc_tasks[job.task_key]
            jobs.append((job.variant, job.settings, tk, sc, "positive"))
    kinds = ["bf16", "int8"] + sorted({v.rollout for v, *_ in jobs} - {"bf16", "int8", "int8+fp32head"}) + [
        "int8+fp32head"]
    unknown = [k for k in kinds if k not in setup.builders and any(v.rollout == k for v, *_ in jobs)]
    if unknown:
        raise RehearsalError(f"--grpo: no rollout model builder for {unknown} (a positive control setting's "
                             f"`rollout`); known: {sorted(setup.builders)}")
    results: Dict[str, Dict[str, Dict[str, Any]]] = {"main": {}, "positive": {}}
    infos: Dict[str, Dict[str, Any]] = {}
    layer_results: Dict[str, List[Dict[str, Any]]] = {}
    sync_counter = [0]
    with transport_mod.make(r.transport, r.args.buckets, r.work, r.device) as sync:
        for kind in kinds:
            on_it = [j for j in jobs if j[0].rollout == kind]
            if not on_it:
                continue
            if kind == "int8+fp32head":
                # FLASHRL_LMHEAD_FP32 on the rollout side: process-global, so this rollout model is built
                # (and used) last
                from npu_flashrl.adapters import vllm_lm_head as vllm_fp32

                vllm_fp32.enable_lm_head_fp32()
            t0 = time.perf_counter()
            with setup.builders[kind]() as v:
                handle = RolloutHandle(v, setup.fns.get(kind), r.device, r.args.seed, setup.profile, _faults())
                handle.info["build_s"] = time.perf_counter() - t0
                sync.attach(v)
                for variant, vs, vtask, vscore, where in on_it:
                    infos[variant.name] = dict(handle.info, rollout=kind)
                    lr_list: List[Dict[str, Any]] = []
                    results[where][variant.name] = run_variant_seeds(
                        variant, handle, trainer, vtask, vs, sync, model.vocab_size, r.device, r.args.seed,
                        sync_counter, lr_list, r.progress, VerlGrpo, vscore)
                    if variant.int8:
                        layer_results[variant.name] = lr_list
                del handle
        r.transport.update(sync.info())
    r.timings["grpo_s"] = time.perf_counter() - t
    return Runs(results["main"], infos, layer_results, heldout_info, results["positive"], pc_pretrained)


def _cpu_seconds() -> Dict[str, float]:
    """CPU time of the run: this process's, its children's, and their sum: on a shared machine the wall
    time says little about the run's own cost. Children: the finished ones (RUSAGE_CHILDREN) and the
    ones still alive, read through psutil (the verl transport's sender process stays up until this
    process exits, so RUSAGE_CHILDREN alone does not see it)."""
    own = resource.getrusage(resource.RUSAGE_SELF)
    kids = resource.getrusage(resource.RUSAGE_CHILDREN)
    own_s, done_s = own.ru_utime + own.ru_stime, kids.ru_utime + kids.ru_stime
    live_s, live_n, note = 0.0, 0, None
    try:
        import psutil

        for child in psutil.Process().children(recursive=True):
            try:
                t = child.cpu_times()
            except psutil.Error:  # it ended meanwhile: RUSAGE_CHILDREN has it once it is reaped
                continue
            live_s += t.user + t.system
            live_n += 1
    except ImportError:
        note = "psutil not installed: children still running are not counted"
    out = {"own_cpu_s": own_s, "children_cpu_s": done_s + live_s, "finished_children_cpu_s": done_s,
           "live_children_cpu_s": live_s, "live_children": live_n, "cpu_s": own_s + done_s + live_s}
    if note:
        out["cpu_note"] = note
    return out


def _report(r: Run, task, model: Model, setup: Setup, runs: Runs) -> int:
    """Statistics, verdict, report.json, grpo.png, the summary; the exit code."""
    from npu_flashrl import patches
    from npu_flashrl.config import atomic_write
    from npu_flashrl.rehearsal.grpo import checks as grpo_checks
    from npu_flashrl.rehearsal.grpo import positive
    from npu_flashrl.rehearsal.grpo import report as grpo_report
    from npu_flashrl.rehearsal.grpo.settings import ALL
    from npu_flashrl.rehearsal.state import by_type, state_rules
    from npu_flashrl.rehearsal.state_w4a8 import state_rules as w4a8_state_rules

    args, s = r.args, r.settings
    summary = grpo_report.summarize(runs.results, s, runs.heldout)
    layer_limits = {"int8": args.max_layer_error, "w4a8": args.max_w4a8_layer_error}
    checks, controls = grpo_checks.evaluate(runs.results, summary, runs.infos, runs.layer_results, s, r.device,
                                            layer_limits)
    if s.positive_control:
        table = positive.table_for(s)
        pc = {"run": True, "table": positive.describe_table(table), "quick": s.quick,
              "settings": positive.summarize(runs.positive, s, runs.positive_pretrained, table)}
        checks.extend(grpo_checks.positive_checks(runs.positive, runs.infos, runs.layer_results, r.device,
                                                  layer_limits))
    else:
        pc = positive.not_run("run `npu-flashrl rehearse --grpo --positive-control` to measure it")
    ok = all(c["ok"] for c in checks)
    plot_path = plot_note = None
    if not args.no_plot:
        plot_path = grpo_report.write_plot(summary, s, os.path.join(r.output_dir, "grpo.png"))
        if plot_path is None:
            plot_note = "matplotlib is not installed: no plot (pip install matplotlib)"
    r.timings["total_s"] = time.perf_counter() - r.t_start
    r.timings["process_s"] = process_seconds()
    r.timings.update(_cpu_seconds())
    fault = next((i.get("fault_injected") for i in runs.infos.values() if i.get("fault_injected")), None)
    report = {
        "ok": ok, "exit_code": 0 if ok else 1, "mode": "grpo",
        "settings": {k: v for k, v in vars(args).items() if k != "func"},
        "grpo": {"settings": s.to_dict(), "task": task.to_dict(), "variants": summary["variants"],
                 "variant_specs": {n: ALL[n].to_dict() for n in runs.results},
                 "bounds": summary["bounds"], "paired": summary["paired"], "heldout": summary["heldout"],
                 "tis_effect": summary["tis_effect"],
                 "controls": controls, "positive_control": pc,
                 "algorithm": {v: res["algo"] for v, res in runs.results.items()},
                 "rows": [row for res in runs.results.values() for row in res["rows"]],
                 "positive_rows": [row for res in runs.positive.values() for row in res["rows"]],
                 "stand_ins": STAND_INS + (POSITIVE_STAND_IN if s.positive_control else [])},
        "resolved": {"device": r.device, "emulated_torch_npu": r.emulated, "threads": r.threads, "fn": setup.fn},
        "transport": r.transport, "model": {"source": "tiny", "arch": args.arch, "dir": model.bf16_dir, "cache_hit": model.cache_hit},
        "rollouts": runs.infos, "checks": checks,
        "rollout_state": {v: {"by_type": by_type(rs), "syncs": len({x["step"] for x in rs})}
                       for v, rs in runs.layer_results.items()},
        "int8_state_rules": state_rules(r.device, args.max_layer_error),
        "w4a8_state_rules": w4a8_state_rules(args.max_w4a8_layer_error) if s.w4a8 else None,
        "w4a8_setup": setup.w4a8,
        "fault_injected": fault, "timings": r.timings,
        "patches": {"applied": [p["name"] for p in patches.status() if p["applied"]],
                    "activation_result": setup.applied},
        "versions": versions(), "plot": plot_path, "plot_note": plot_note,
    }
    report_path = os.path.join(r.output_dir, "report.json")
    atomic_write(report_path, lambda f: json.dump(json_safe(report), f, indent=2))
    grpo_report.print_summary(report, summary, checks, report_path)
    return 0 if ok else 1
