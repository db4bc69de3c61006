"""`npu-flashrl rehearse`: the whole INT8 rollout pipeline end to end, without an NPU.

What one run does (each phase with a progress bar):

1. **Model.** By default a tiny Qwen2 (hidden 128, 2 layers, GQA, q/k/v bias, vocab 512) built
   offline and pre-trained for a few seconds (plain torch AdamW, CPU) on a synthetic Markov-chain
   task (`npu_flashrl.testing.synthetic_task`) so that its next-token distributions are peaked like a
   real LM's: a random-init model has near-uniform logits and hides INT8 error. The trained
   checkpoint is cached (`--cache-dir`, default ``~/.cache/npu_flashrl/rehearsal/<hash of the
   settings>``); a second run skips training. `--model DIR` uses a local dense Qwen2/Llama-style
   safetensors checkpoint instead.
2. **Setup, as a user does it.** `npu-flashrl profile` (``--mode profile``: on a compressed-tensors
   w8a8 checkpoint written from the bf16 one, or ``--w8a8 DIR``) and `npu-flashrl setup` write a
   FlashRL config; `npu_flashrl.activate(config)` applies the patches; the config entry is applied
   to a real `vllm.engine.arg_utils.EngineArgs` by the engine adapter (`apply_entry`), which picks the
   rollout checkpoint, `quantization="ascend"` and the online quantizer (profile loaded).
3. **Rollout models**, built by vLLM's own loader through the real vLLM + vllm-ascend code (vLLM
   attention replaced by plain causal attention; on CPU the torch_npu kernels are the project's
   reference kernels): ``bf16`` (unquantized, the noise floor), ``int8`` (vllm-ascend W8A8_DYNAMIC
   layers with npu_flashrl's online-quantizing loader) and ``int8+fp32head`` (the same with
   FLASHRL_LMHEAD_FP32's lm head in fp32; the trainer computes its logits in fp32 too).
4. **K simulated training steps** (`--steps`): a few real AdamW iterations on the fp32 master weights
   per step; the bf16 weights (what an FSDP trainer with param_dtype bf16 holds and syncs) are pushed
   into each rollout model through the real reload path in `--buckets` shuffled buckets
   (`load_weights` per bucket, then `end_weight_sync` for INT8), timed.
5. **Metrics** after each step on a fixed set of task sequences, teacher-forced: rollout log-probs =
   log-softmax of the vLLM model's logits at the target tokens; trainer log-probs = the transformers
   model in bf16 with the same weights; `npu_flashrl.metrics.mismatch_metrics` between them.

Output: a per-step table and the patch summary on stdout, ``report.json`` (atomic) and
``mismatch.png`` (when matplotlib is installed) in `--output-dir`. Exit code 1 when a check fails:
INT8 token_mult_prob_error above `--max-error`, the bf16 baseline not within `--baseline-tol` of
1.0, INT8 not above the baseline (quantization not in the path), non-finite metrics. So it doubles
as an installation check.

Process-global state: vLLM's process group, the torch_npu emulation and npu_flashrl's patches stay
in the process after `run()` (the FP32 lm-head patches included); run it in its own process.
"""
from __future__ import annotations

import contextlib
import hashlib
import io
import json
import logging
import math
import os
import random
import sys
import time
from typing import Any, Dict, List, Optional, Sequence, Tuple

HELP = ("rehearse the INT8 rollout end to end (default: a tiny Qwen2 trained for a few seconds; "
        "CPU with emulated torch_npu, or --device npu [not verified on hardware]) and report the "
        "rollout-vs-trainer mismatch per simulated training step; non-zero exit when a check fails")

RECIPE_VERSION = 1  # bump when the tiny model / task / pre-training recipe changes (cache key)
DEFAULT_OUTPUT_DIR = "rehearsal_out"
VARIANT_BF16 = "bf16"
VARIANT_INT8 = "int8"
VARIANT_INT8_FP32HEAD = "int8+fp32head"
TABLE_COLUMNS = ("step", "variant", "token_mult_prob_error", "kl_k1", "kl_k3", "prob_diff_max", "reload_s")
SUPPORTED_ARCHITECTURES = ("Qwen2ForCausalLM", "LlamaForCausalLM", "MistralForCausalLM", "Qwen3ForCausalLM")

# Pre-training of the default tiny model (about 250 x 40 ms on one CPU core).
TINY_TRAIN = dict(iters=250, lr=1e-2, batch=16, length=32)


# ============================================================================ arguments

def _number(kind, lo, lo_ok=True):
    """argparse type: a finite `kind` >= lo (> lo when not lo_ok); bad values are usage errors
    (exit 2) before anything runs, not a failure at the end of a long run (`--max-error nan`)."""
    import argparse

    def parse(text: str):
        try:
            value = kind(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{text!r} is not {'an integer' if kind is int else 'a number'}") from None
        if not math.isfinite(value) or value < lo or (value == lo and not lo_ok):
            raise argparse.ArgumentTypeError(f"{text!r}: expected a finite number {'>=' if lo_ok else '>'} {lo}")
        return value
    parse.__name__ = kind.__name__  # argparse names the type in its messages
    return parse


def add_arguments(p) -> None:
    p.add_argument("--model", metavar="DIR",
                   help="a local bf16/fp16 HF safetensors checkpoint of a dense Qwen2/Llama-style decoder "
                        "(default: the built-in tiny Qwen2, pre-trained on a synthetic task and cached)")
    p.add_argument("--mode", choices=("profile-free", "profile"), default="profile-free",
                   help="profile-free: fn=int8_profile_free (fresh per-channel scales every sync); "
                        "profile: fn=int8 with a FlashRL profile (a w8a8 checkpoint is written from the "
                        "bf16 one unless --w8a8 is given, then `npu-flashrl profile`). Default profile-free")
    p.add_argument("--w8a8", metavar="DIR", help="--mode profile: an existing compressed-tensors w8a8 "
                   "checkpoint of --model (else one is written)")
    p.add_argument("--device", choices=("auto", "cpu", "npu"), default="auto",
                   help="npu: real torch_npu/CANN, no emulation (NOT VERIFIED ON HARDWARE); cpu: emulated "
                        "torch_npu kernels; auto (default): npu when torch_npu works, else cpu")
    p.add_argument("--steps", type=_number(int, 1), default=4, help="simulated training steps (weight syncs); default 4")
    p.add_argument("--buckets", type=_number(int, 1), default=4,
                   help="each sync is pushed as this many shuffled load_weights calls; default 4")
    p.add_argument("--inner-iters", type=_number(int, 1), default=2,
                   help="AdamW iterations on the synthetic task per simulated step; default 2")
    p.add_argument("--step-lr", type=_number(float, 0, lo_ok=False), default=None,
                   help="AdamW learning rate of the simulated steps (default 5e-4 for the tiny model, "
                        "1e-5 for --model)")
    p.add_argument("--num-seqs", type=_number(int, 1), default=16, help="evaluation sequences; default 16")
    p.add_argument("--seq-len", type=_number(int, 2), default=48, help="tokens per evaluation sequence; default 48")
    p.add_argument("--train-iters", type=_number(int, 1), default=TINY_TRAIN["iters"],
                   help=f"pre-training iterations of the tiny model; default {TINY_TRAIN['iters']}")
    p.add_argument("--no-fp32-head", action="store_true",
                   help="skip the INT8 + FP32 lm-head variant")
    p.add_argument("--max-error", type=_number(float, 1.0), default=1.05,
                   help="fail when an INT8 token_mult_prob_error exceeds this; default 1.05")
    p.add_argument("--baseline-tol", type=_number(float, 0.0), default=0.01,
                   help="fail when the bf16 baseline's token_mult_prob_error exceeds 1 + this; default 0.01 "
                        "(bf16 vLLM and bf16 transformers differ only by kernel rounding)")
    p.add_argument("--seed", type=int, default=0, help="seed of pre-training, steps and data; default 0")
    p.add_argument("--threads", type=_number(int, 1), default=None,
                   help="torch CPU threads (default 1 on CPU: these tiny ops are latency-bound and "
                        "several threads spin against each other on a busy machine)")
    p.add_argument("--cache-dir", default=None,
                   help="where the pre-trained tiny model is cached (default $XDG_CACHE_HOME or "
                        "~/.cache, /npu_flashrl/rehearsal)")
    p.add_argument("--output-dir", default=DEFAULT_OUTPUT_DIR,
                   help=f"report.json, mismatch.png and the work files; default ./{DEFAULT_OUTPUT_DIR}")
    p.add_argument("--no-plot", action="store_true", help="do not write mismatch.png")
    p.add_argument("--no-progress", action="store_true", help="no progress bars")
    p.add_argument("--verbose", action="store_true", help="keep npu_flashrl/vLLM INFO logging")


# ============================================================================ small helpers

class RehearsalError(Exception):
    """A setup problem (bad --model, missing package): message printed, exit code 1."""


def _cli_error(message: str):
    from npu_flashrl.cli import CliError

    return CliError(message)


def _bar(total: Optional[int], desc: str, enabled: bool):
    try:
        from tqdm.auto import tqdm
    except ImportError:  # tqdm is a vLLM dependency; stay usable without it
        class _NoBar:
            def __init__(self, *a, **k): pass
            def update(self, n=1): pass
            def set_postfix_str(self, s): pass
            def close(self): pass
            def __enter__(self): return self
            def __exit__(self, *exc): return False
        return _NoBar()
    return tqdm(total=total, desc=desc, disable=not enabled, file=sys.stderr, leave=True,
                dynamic_ncols=True, bar_format="{l_bar}{bar}| {n_fmt}/{total_fmt} [{elapsed}]{postfix}")


def _finite(x: Any) -> bool:
    return isinstance(x, (int, float)) and math.isfinite(x)


def _json_safe(obj: Any) -> Any:
    """Non-finite floats become None (strict JSON)."""
    if isinstance(obj, float):
        return obj if math.isfinite(obj) else None
    if isinstance(obj, dict):
        return {str(k): _json_safe(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [_json_safe(v) for v in obj]
    return obj


def _versions() -> Dict[str, Optional[str]]:
    from importlib.metadata import PackageNotFoundError, version

    import npu_flashrl

    out: Dict[str, Optional[str]] = {"python": sys.version.split()[0], "npu_flashrl": npu_flashrl.__version__}
    for dist in ("torch", "transformers", "vllm", "vllm-ascend", "compressed-tensors", "torch_npu"):
        try:
            out[dist] = version(dist)
        except PackageNotFoundError:
            out[dist] = None
    if out["vllm-ascend"] is None:  # a source tree on the path has no distribution metadata
        try:
            from npu_flashrl import compat

            out["vllm-ascend"] = f"{compat.vllm_ascend_line()} (source tree)"
        except Exception:  # noqa: BLE001 - not installed at all: stays None
            pass
    return out


def _process_seconds() -> Optional[float]:
    try:
        import psutil

        return time.time() - psutil.Process().create_time()
    except Exception:  # noqa: BLE001 - psutil is a vLLM dependency, but optional here
        return None


def default_cache_root() -> str:
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return os.path.join(base, "npu_flashrl", "rehearsal")


# ============================================================================ device / environment

def resolve_device(choice: str) -> Tuple[str, bool]:
    """(device, emulated). npu needs a real, working torch_npu; the CPU emulation refuses to shadow a
    real torch_npu, so --device cpu needs an environment without one."""
    from npu_flashrl.kernels import emulation

    if not emulation.real_torch_npu_importable():
        if choice == "npu":
            raise RehearsalError("--device npu: torch_npu is not installed (install torch_npu + CANN, "
                                 "scripts/install_pinned.sh; or use --device cpu)")
        return "cpu", True
    if choice == "cpu":
        raise RehearsalError("--device cpu: a real torch_npu is installed here and the CPU emulation will "
                             "not shadow it; use --device npu, or a venv without torch_npu "
                             "(scripts/bootstrap_cpu_stack.sh)")
    try:
        import torch
        import torch_npu  # noqa: F401

        works = bool(torch.npu.is_available())
        problem = "no NPU is visible (torch.npu.is_available() is False)"
    except Exception as exc:  # noqa: BLE001 - e.g. CANN missing: libhccl.so not found
        works, problem = False, f"importing torch_npu failed: {type(exc).__name__}: {exc}"
    if not works:
        raise RehearsalError(f"--device {choice}: torch_npu is installed but not working: {problem} "
                             "(`source /usr/local/Ascend/ascend-toolkit/set_env.sh`?)")
    return "npu", False


def _prepare_environment(device: str, verbose: bool) -> None:
    """Environment read at import time by vLLM (not imported yet when this runs); set only what the user
    did not set. TORCH_DEVICE_BACKEND_AUTOLOAD only matters to a process that has not imported torch yet
    (scripts/run.sh exports it)."""
    if not verbose:
        os.environ.setdefault("VLLM_LOGGING_LEVEL", "WARNING")
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    if device == "cpu":
        # Autoloading a stray torch_npu breaks `import torch` on CPU; vllm-ascend's platform plugin
        # needs the real torch_npu. cpu_vllm selects vLLM's CPU platform itself.
        os.environ.setdefault("TORCH_DEVICE_BACKEND_AUTOLOAD", "0")
        os.environ.setdefault("VLLM_PLUGINS", "none")
        os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")  # no KV cache is used; silences a warning


@contextlib.contextmanager
def _quiet_logs(verbose: bool):
    """npu_flashrl and transformers at WARNING for the run (restored after)."""
    if verbose:
        yield
        return
    ours = logging.getLogger("npu_flashrl")
    old = ours.level
    ours.setLevel(logging.WARNING)
    tf_old = None
    try:
        import transformers

        tf_old = transformers.logging.get_verbosity()
        transformers.logging.set_verbosity_error()
    except ImportError:
        transformers = None  # type: ignore
    try:
        yield
    finally:
        ours.setLevel(old)
        if tf_old is not None:
            transformers.logging.set_verbosity(tf_old)


# ============================================================================ model (tiny / --model)

def check_model_dir(path: str) -> Dict[str, Any]:
    """A usable local checkpoint for the rehearsal, or RehearsalError naming the dir and the problem."""
    if not os.path.isdir(path):
        raise RehearsalError(f"--model {path}: no such directory")
    cfg_path = os.path.join(path, "config.json")
    if not os.path.exists(cfg_path):
        raise RehearsalError(f"--model {path}: no config.json (expected a Hugging Face checkpoint dir)")
    try:
        with open(cfg_path) as f:
            cfg = json.load(f)
    except (OSError, json.JSONDecodeError) as exc:
        raise RehearsalError(f"--model {path}: config.json is not readable JSON ({exc})") from None
    if not any(n.endswith(".safetensors") for n in os.listdir(path)):
        raise RehearsalError(f"--model {path}: no *.safetensors files (a safetensors checkpoint is needed)")
    archs = cfg.get("architectures") or []
    if not any(a in SUPPORTED_ARCHITECTURES for a in archs):
        raise RehearsalError(f"--model {path}: architectures {archs or '(none)'} is not a Qwen2-like dense "
                             f"decoder; supported: {', '.join(SUPPORTED_ARCHITECTURES)}")
    if any(k in cfg for k in ("num_experts", "num_local_experts", "n_routed_experts")):
        raise RehearsalError(f"--model {path}: a mixture-of-experts model; the rehearsal supports dense "
                             "decoders only")
    if cfg.get("quantization_config") or cfg.get("compression_config"):
        raise RehearsalError(f"--model {path}: already quantized (quantization_config in config.json); "
                             "pass the bf16 checkpoint (and --w8a8 DIR for --mode profile)")
    return cfg


def _tiny_settings(args, task) -> Dict[str, Any]:
    from npu_flashrl.testing.tiny_models import TINY_QWEN2

    return {"recipe": RECIPE_VERSION, "model": dict(TINY_QWEN2), "task": task.to_dict(),
            "train": dict(TINY_TRAIN, iters=args.train_iters, seed=args.seed)}


def settings_hash(settings: Dict[str, Any]) -> str:
    return hashlib.sha256(json.dumps(settings, sort_keys=True).encode()).hexdigest()[:16]


def ensure_tiny_model(cache_root: str, settings: Dict[str, Any], task, progress: bool) -> Dict[str, Any]:
    """The pre-trained tiny model in `cache_root/<hash>` ({bf16,master}/ + meta.json); trains on a miss."""
    import shutil

    import torch
    from transformers import Qwen2ForCausalLM

    from npu_flashrl.testing import synthetic_task
    from npu_flashrl.testing.tiny_models import save_tiny_tokenizer, tiny_qwen2_config

    key = settings_hash(settings)
    final = os.path.join(cache_root, key)
    meta_path = os.path.join(final, "meta.json")
    if os.path.exists(meta_path):
        with open(meta_path) as f:
            meta = json.load(f)
        return {"dir": final, "bf16_dir": os.path.join(final, "bf16"), "master_dir": os.path.join(final, "master"),
                "cache_hit": True, "key": key, "train": meta.get("train_result"), "train_s": 0.0}

    os.makedirs(cache_root, exist_ok=True)
    tmp = os.path.join(cache_root, f".{key}.tmp-{os.getpid()}")
    shutil.rmtree(tmp, ignore_errors=True)
    train = settings["train"]
    torch.manual_seed(train["seed"])
    model = Qwen2ForCausalLM(tiny_qwen2_config(**settings["model"])).float()
    bar = _bar(train["iters"], "pre-train tiny Qwen2", progress)

    def cb(i, loss):
        bar.update(1)
        if i % 10 == 0:
            bar.set_postfix_str(f"loss {loss:.3f} (entropy {task.entropy:.3f})")

    try:
        result = synthetic_task.train(model, task, iters=train["iters"], lr=train["lr"], batch=train["batch"],
                                      length=train["length"], seed=train["seed"], callback=cb)
    finally:
        bar.close()
    model.config.torch_dtype = torch.float32
    model.save_pretrained(os.path.join(tmp, "master"), safe_serialization=True)
    bf16 = model.to(torch.bfloat16)
    bf16.config.torch_dtype = torch.bfloat16
    bf16.save_pretrained(os.path.join(tmp, "bf16"), safe_serialization=True)
    save_tiny_tokenizer(os.path.join(tmp, "bf16"), bf16.config.vocab_size)
    from npu_flashrl.config import atomic_write

    atomic_write(os.path.join(tmp, "meta.json"),
                 lambda f: json.dump({"settings": settings, "train_result": result}, f, indent=2))
    try:
        os.rename(tmp, final)
    except OSError:  # another process finished first: use its copy
        shutil.rmtree(tmp, ignore_errors=True)
        if not os.path.exists(meta_path):
            raise
    return {"dir": final, "bf16_dir": os.path.join(final, "bf16"), "master_dir": os.path.join(final, "master"),
            "cache_hit": False, "key": key, "train": result, "train_s": result["seconds"]}


# ============================================================================ trainer side

def _hf_load(model_dir: str, dtype, device: str):
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=dtype)
    return model.to(device).eval()


def _target_logp(logits, ids):
    """Teacher-forced log-probs [B, T-1] of ids[:, 1:] from logits [B, T, V] (fp32)."""
    import torch

    logp = torch.log_softmax(logits[:, :-1].float(), dim=-1)
    return logp.gather(-1, ids[:, 1:, None].to(logp.device)).squeeze(-1).cpu()


def simulate_training(master, task, steps: int, inner: int, lr: float, seed: int, device: str,
                      progress: bool) -> Tuple[List[List[Tuple[str, Any]]], List[float], List[float]]:
    """K optimizer-like changes: `inner` AdamW iterations per step on the fp32 master weights.

    Returns the bf16 weights after each step (HF names; what an FSDP trainer with param_dtype bf16
    holds and syncs), the training loss per step and the relative weight change per step
    (||W_k - W_k-1|| / ||W_k-1|| over all parameters)."""
    import torch

    from npu_flashrl.testing import synthetic_task

    opt = torch.optim.AdamW(master.parameters(), lr=lr, betas=(0.9, 0.98), weight_decay=0.0)
    data = task.batches(16, 32, seed + 1)
    snapshots, losses = [], []
    update_rel: List[float] = []
    prev = [p.detach().clone() for p in master.parameters()]
    master.train()
    with _bar(steps, "simulated training steps", progress) as bar:
        for _ in range(steps):
            step_loss = 0.0
            for _ in range(inner):
                loss = synthetic_task.lm_loss(master, next(data).to(device))
                loss.backward()
                opt.step()
                opt.zero_grad(set_to_none=True)
                step_loss += float(loss.detach()) / inner
            losses.append(step_loss)
            with torch.no_grad():
                num = sum(float((p.detach() - q).float().norm() ** 2) for p, q in zip(master.parameters(), prev))
                den = sum(float(q.float().norm() ** 2) for q in prev)
                update_rel.append(math.sqrt(num / den) if den > 0 else float("nan"))
                prev = [p.detach().clone() for p in master.parameters()]
            snapshots.append([(n, p.detach().to(torch.bfloat16).clone()) for n, p in master.named_parameters()])
            bar.update(1)
    master.eval()
    return snapshots, losses, update_rel


@contextlib.contextmanager
def _no_grad():
    import torch

    with torch.no_grad():
        yield


def trainer_logps(trainer, snapshots, eval_ids, fp32_head: bool, progress: bool) -> List[Dict[str, Any]]:
    """Per step: trainer log-probs with the bf16 weights (bf16 lm head, and fp32 lm head if asked)."""
    from npu_flashrl.adapters import transformers as hf_fp32

    params = dict(trainer.named_parameters())
    out = []
    with _bar(len(snapshots), "trainer log-probs (transformers bf16)", progress) as bar, _no_grad():
        for snap in snapshots:
            for name, t in snap:
                params[name].data.copy_(t.to(params[name].device))
            ids = eval_ids.to(next(trainer.parameters()).device)
            row = {"bf16": _target_logp(trainer(input_ids=ids).logits, eval_ids)}
            if fp32_head:
                hf_fp32.enable_fp32_lm_head(trainer)
                try:
                    row["fp32head"] = _target_logp(trainer(input_ids=ids).logits, eval_ids)
                finally:
                    hf_fp32.disable_fp32_lm_head(trainer)
            out.append(row)
            bar.update(1)
    return out


# ============================================================================ rollout side

class _NpuVllm:
    """The rollout model built by vLLM's loader on a real Ascend NPU (vllm-ascend's own platform,
    real torch_npu kernels, hccl). NOT VERIFIED ON HARDWARE: written to mirror CpuVllm."""

    def __init__(self, model_dir: str, dtype, quantization: Optional[str] = None, load_format: str = "auto"):
        self.model_dir, self.dtype, self.quantization, self.load_format = model_dir, dtype, quantization, load_format
        self._stack = contextlib.ExitStack()
        self.model = None

    def __enter__(self):
        import torch
        import torch_npu  # noqa: F401
        from vllm.config import (CompilationConfig, DeviceConfig, LoadConfig, ModelConfig, ParallelConfig,
                                 VllmConfig, set_current_vllm_config)
        from vllm.model_executor.model_loader import get_model

        from npu_flashrl import compat
        from npu_flashrl.testing import cpu_vllm

        torch.npu.set_device(0)
        mc = ModelConfig(model=self.model_dir, dtype=self.dtype, skip_tokenizer_init=True,
                         quantization=self.quantization, enforce_eager=True)
        self.vllm_config = VllmConfig(model_config=mc, device_config=DeviceConfig(device="npu"),
                                      load_config=LoadConfig(load_format=self.load_format,
                                                             use_tqdm_on_load=False),
                                      parallel_config=ParallelConfig(tensor_parallel_size=1),
                                      compilation_config=CompilationConfig(level=0))
        self._stack.enter_context(set_current_vllm_config(self.vllm_config))
        if not cpu_vllm._dist_state["initialized"]:
            from vllm.distributed import parallel_state as ps

            ps.init_distributed_environment(world_size=1, rank=0, local_rank=0, backend="hccl",
                                            distributed_init_method=f"tcp://127.0.0.1:{cpu_vllm.free_port()}")
            ps.initialize_model_parallel(1, 1)
            cpu_vllm._dist_state.update(initialized=True, world_size=1)
        compat.init_vllm_ascend_config(self.vllm_config)
        cpu_vllm.use_plain_attention()
        self.model = get_model(vllm_config=self.vllm_config)
        return self

    def __exit__(self, *exc):
        self._stack.close()


def _cpu_rollout_cls():
    from npu_flashrl.testing import cpu_vllm

    class _CpuRollout(cpu_vllm.CpuVllm):
        """CpuVllm without vLLM's own "Loading safetensors checkpoint shards" bar (the rehearsal has its
        own per-variant bars): the config CpuVllm makes gets use_tqdm_on_load=False before loading."""

        def __enter__(self):
            original = cpu_vllm.make_vllm_config

            def make_vllm_config(*args, **kwargs):
                cfg = original(*args, **kwargs)
                cfg.load_config.use_tqdm_on_load = False
                return cfg

            cpu_vllm.make_vllm_config = make_vllm_config
            try:
                return super().__enter__()
            finally:
                cpu_vllm.make_vllm_config = original

    return _CpuRollout


def _rollout(device: str, model_dir: str, quantization: Optional[str], load_format: str = "auto"):
    import torch

    if device == "npu":
        return _NpuVllm(model_dir, torch.bfloat16, quantization, load_format)
    return _cpu_rollout_cls()(model_dir, dtype=torch.bfloat16, quantization=quantization, load_format=load_format)


def rollout_logp(model, eval_ids, vocab_size: int, device: str):
    """Teacher-forced rollout log-probs [B, T-1]: the vLLM model's own layers, one sequence at a time."""
    import torch

    from npu_flashrl import compat

    rows = []
    with torch.no_grad():
        for seq in eval_ids:
            seq = seq.to(device)
            positions = torch.arange(seq.shape[0], device=device)
            hidden = model.model(seq, positions)
            logits = compat.compute_logits(model, hidden).float()[:, :vocab_size]
            rows.append(_target_logp(logits[None], seq[None]))
    return torch.cat(rows)


def _buckets(weights: List[Tuple[str, Any]], n: int, rng: random.Random) -> List[List[Tuple[str, Any]]]:
    items = list(weights)
    rng.shuffle(items)
    n = max(1, min(n, len(items)))
    size = math.ceil(len(items) / n)
    return [items[i:i + size] for i in range(0, len(items), size)]


def run_variant(name: str, build, snapshots, eval_ids, train_logps, logp_key: str, args, vocab_size: int,
                device: str, int8: bool, progress: bool) -> Tuple[List[Dict[str, Any]], Dict[str, Any]]:
    """Build one rollout model, push every step's weights through its reload path, measure."""
    import torch

    from npu_flashrl.adapters import vllm_ascend
    from npu_flashrl.metrics import mismatch_metrics

    rows: List[Dict[str, Any]] = []
    info: Dict[str, Any] = {"name": name}
    with _bar(len(snapshots) + 1, f"rollout {name}", progress) as bar:
        t0 = time.perf_counter()
        ctx = build()
        with ctx as v:
            info["build_s"] = time.perf_counter() - t0
            model = v.model
            info["model_dir"] = getattr(v, "model_dir", None)
            info["quantization"] = getattr(v, "quantization", None)
            loader = getattr(model, "_npu_flashrl_loader", None)
            info["int8_loader"] = loader is not None
            info["quantized_layers"] = len({t.path for t in loader.targets.values()}) if loader else 0
            info["online_quantizer"] = getattr(getattr(loader, "quantizer", None), "name", None)
            info["layer0_qkv_weight_dtype"] = str(model.model.layers[0].self_attn.qkv_proj.weight.dtype)
            head = getattr(model, "lm_head", None)
            info["lm_head_dtype"] = str(head.weight.dtype) if head is not None else None
            if int8 and (loader is None or not loader.targets):
                raise RehearsalError(f"rollout {name}: the vLLM model has no npu_flashrl INT8 loader / no "
                                     "vllm-ascend W8A8 layers: npu_flashrl was not active when it was built")
            bar.update(1)
            rng = random.Random(args.seed + 7)
            for step, snap in enumerate(snapshots, start=1):
                buckets = _buckets(snap, args.buckets, rng)
                if device == "npu":
                    torch.npu.synchronize()
                t = time.perf_counter()
                for bucket in buckets:
                    model.load_weights(iter(bucket))
                if int8:
                    vllm_ascend.end_weight_sync(model)
                if device == "npu":
                    torch.npu.synchronize()
                reload_s = time.perf_counter() - t
                logp_r = rollout_logp(model, eval_ids, vocab_size, device)
                logp_t = train_logps[step - 1][logp_key]
                mask = torch.ones_like(logp_t, dtype=torch.bool)
                m = mismatch_metrics(logp_t, logp_r, mask, tis_threshold=2.0, prefix="")
                rows.append({"step": step, "variant": name, "reload_s": reload_s, "buckets": len(buckets),
                             "metrics": m})
                bar.set_postfix_str(f"tmpe {m['token_mult_prob_error']:.4f}")
                bar.update(1)
        del model
    return rows, info


# ============================================================================ output

def format_table(rows: List[Dict[str, Any]]) -> str:
    header = ("step", "variant", "token_mult_prob_error", "kl_k1", "kl_k3", "prob_diff_max", "reload_s")
    body = []
    for r in sorted(rows, key=lambda r: (r["step"], _VARIANT_ORDER.get(r["variant"], 9))):
        m = r["metrics"]
        body.append((str(r["step"]), r["variant"], f"{m['token_mult_prob_error']:.5f}", f"{m['kl_k1']:+.2e}",
                     f"{m['kl_k3']:.2e}", f"{m['prob_diff_max']:.4f}", f"{r['reload_s']:.4f}"))
    widths = [max(len(h), *(len(b[i]) for b in body)) if body else len(h) for i, h in enumerate(header)]
    lines = ["  ".join(h.rjust(w) if i != 1 else h.ljust(w) for i, (h, w) in enumerate(zip(header, widths)))]
    lines.append("  ".join("-" * w for w in widths))
    for b in body:
        lines.append("  ".join(c.rjust(w) if i != 1 else c.ljust(w) for i, (c, w) in enumerate(zip(b, widths))))
    return "\n".join(lines)


_VARIANT_ORDER = {VARIANT_BF16: 0, VARIANT_INT8: 1, VARIANT_INT8_FP32HEAD: 2}


def _summaries(rows) -> Dict[str, Dict[str, float]]:
    out: Dict[str, Dict[str, float]] = {}
    for variant in sorted({r["variant"] for r in rows}, key=lambda v: _VARIANT_ORDER.get(v, 9)):
        rs = [r for r in rows if r["variant"] == variant]
        tm = [r["metrics"]["token_mult_prob_error"] for r in rs]
        out[variant] = {
            "token_mult_prob_error_mean": sum(tm) / len(tm),
            "token_mult_prob_error_max": max(tm),
            "kl_k3_mean": sum(r["metrics"]["kl_k3"] for r in rs) / len(rs),
            "reload_s_mean": sum(r["reload_s"] for r in rs) / len(rs),
        }
    return out


def write_plot(rows, path: str) -> Optional[str]:
    """mismatch.png: token_mult_prob_error and KL (k3) per step and variant. None when matplotlib is missing."""
    try:
        import matplotlib

        matplotlib.use("Agg", force=True)
        import matplotlib.pyplot as plt
    except ImportError:
        return None
    fig, axes = plt.subplots(1, 2, figsize=(10, 4))
    for variant in sorted({r["variant"] for r in rows}, key=lambda v: _VARIANT_ORDER.get(v, 9)):
        rs = sorted((r for r in rows if r["variant"] == variant), key=lambda r: r["step"])
        steps = [r["step"] for r in rs]
        axes[0].plot(steps, [r["metrics"]["token_mult_prob_error"] for r in rs], marker="o", label=variant)
        axes[1].plot(steps, [max(r["metrics"]["kl_k3"], 1e-12) for r in rs], marker="o", label=variant)
    axes[0].set_title("token_mult_prob_error (1.0 = exact)")
    axes[1].set_title("KL(rollout || trainer), k3")
    axes[1].set_yscale("log")
    for ax in axes:
        ax.set_xlabel("training step (weight sync)")
        ax.grid(True, alpha=0.3)
        ax.legend()
    fig.tight_layout()
    buf = io.BytesIO()
    fig.savefig(buf, format="png", dpi=100)
    plt.close(fig)
    from npu_flashrl.config import atomic_write

    atomic_write(path, lambda f: f.write(buf.getvalue()), binary=True)
    return path


def evaluate_checks(rows, infos, args) -> List[Dict[str, Any]]:
    checks = []

    def add(name, ok, detail):
        checks.append({"check": name, "ok": bool(ok), "detail": detail})

    bad = [(r["step"], r["variant"], k) for r in rows for k, v in r["metrics"].items() if not _finite(v)]
    add("finite metrics", not bad, "all finite" if not bad else f"non-finite: {bad[:5]}")
    summ = _summaries(rows)
    base = summ.get(VARIANT_BF16)
    if base is not None:
        limit = 1.0 + args.baseline_tol
        add("bf16 baseline ~ 1.0", base["token_mult_prob_error_max"] <= limit,
            f"max token_mult_prob_error {base['token_mult_prob_error_max']:.5f} (limit {limit:.4f})")
    for variant in (VARIANT_INT8, VARIANT_INT8_FP32HEAD):
        s = summ.get(variant)
        if s is None:
            continue
        add(f"{variant} error <= --max-error", s["token_mult_prob_error_max"] <= args.max_error,
            f"max token_mult_prob_error {s['token_mult_prob_error_max']:.5f} (limit {args.max_error})")
        if base is not None:
            add(f"{variant} above baseline (quantization in the path)",
                s["token_mult_prob_error_mean"] > base["token_mult_prob_error_mean"],
                f"mean {s['token_mult_prob_error_mean']:.5f} vs bf16 {base['token_mult_prob_error_mean']:.5f}")
        info = infos.get(variant, {})
        add(f"{variant} rollout model is INT8", info.get("quantized_layers", 0) > 0
            and info.get("layer0_qkv_weight_dtype") == "torch.int8",
            f"{info.get('quantized_layers', 0)} vllm-ascend W8A8 layers, qkv weight "
            f"{info.get('layer0_qkv_weight_dtype')}, online quantizer {info.get('online_quantizer')}")
    fp = infos.get(VARIANT_INT8_FP32HEAD)
    if fp is not None:
        add("int8+fp32head lm_head is fp32", fp.get("lm_head_dtype") == "torch.float32",
            f"lm_head weight {fp.get('lm_head_dtype')}")
    return checks


# ============================================================================ setup through the CLI

def _cli(argv: Sequence[str]) -> str:
    """Run `npu-flashrl <argv>` in-process (the user's code path); its output is returned, a failure raises."""
    from npu_flashrl import cli

    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        code = cli.main(list(argv))
    if code != 0:
        raise RehearsalError(f"`npu-flashrl {' '.join(argv)}` failed ({code}): {err.getvalue().strip()}")
    return out.getvalue()


def prepare_config(args, bf16_dir: str, work: str, progress: bool) -> Dict[str, Any]:
    """profile (profile mode) and setup, as a user runs them; returns paths and timings."""
    out: Dict[str, Any] = {"mode": args.mode}
    config_path = os.path.join(work, "flashrl_config.yaml")
    t0 = time.perf_counter()
    if args.mode == "profile":
        w8a8 = args.w8a8
        if w8a8 is None:
            from npu_flashrl.testing.checkpoints import write_w8a8_compressed_tensors

            w8a8 = os.path.join(work, "w8a8")
            import shutil

            shutil.rmtree(w8a8, ignore_errors=True)
            write_w8a8_compressed_tensors(bf16_dir, w8a8)
            out["w8a8_written"] = True
        profile = os.path.join(work, "profile.pt")
        argv = ["profile", "-m", bf16_dir, "-q", w8a8, "-o", profile]
        if not progress:
            argv.append("--no-progress")
        _cli(argv)
        _cli(["setup", "-m", w8a8, "-p", profile, "--fn", "int8", "-o", config_path])
        out.update(w8a8_dir=w8a8, profile=profile, fn="int8")
    else:
        _cli(["setup", "-m", bf16_dir, "--fn", "int8_profile_free", "-o", config_path])
        out["fn"] = "int8_profile_free"
    out["config"] = config_path
    out["setup_s"] = time.perf_counter() - t0
    return out


def activate_entry(config_path: str, bf16_dir: str):
    """npu_flashrl.activate(config) + the engine adapter applying the entry to real EngineArgs."""
    from vllm.engine.arg_utils import EngineArgs

    import npu_flashrl
    from npu_flashrl.adapters import vllm_engine
    from npu_flashrl.config import EXTERNAL_LAUNCHER, load_config

    applied = npu_flashrl.activate(config_path)
    failed = [n for n, ok in (applied or {}).items() if not ok]
    engine_args = EngineArgs(model=bf16_dir, distributed_executor_backend=EXTERNAL_LAUNCHER)
    entry = vllm_engine.apply_entry(engine_args, load_config(config_path))
    return engine_args, entry, applied, failed


# ============================================================================ run

def run(args) -> int:
    t_start = time.perf_counter()
    try:
        device, emulated = resolve_device(args.device)
        model_cfg = check_model_dir(args.model) if args.model is not None else None
        if args.mode != "profile" and args.w8a8:
            raise RehearsalError("--w8a8 is only used with --mode profile")
        if args.w8a8 and not os.path.isdir(args.w8a8):
            raise RehearsalError(f"--w8a8 {args.w8a8}: no such directory")
        for flag, value, lo in (("--steps", args.steps, 1), ("--buckets", args.buckets, 1),
                                ("--num-seqs", args.num_seqs, 1), ("--seq-len", args.seq_len, 2),
                                ("--inner-iters", args.inner_iters, 1), ("--train-iters", args.train_iters, 1)):
            if value < lo:
                raise RehearsalError(f"{flag} must be >= {lo}, got {value}")
        from npu_flashrl.config import output_path_problem

        for flag, where in (("--output-dir", args.output_dir), ("--cache-dir", args.cache_dir)):
            problem = where and output_path_problem(os.path.join(os.path.expanduser(where), "probe"))
            if problem:  # found now, not after pre-training
                raise RehearsalError(f"{flag} {where}: cannot be used as a directory ({problem})")
        _prepare_environment(device, args.verbose)
        with _quiet_logs(args.verbose):
            return _run(args, device, emulated, t_start, model_cfg)
    except RehearsalError as exc:
        raise _cli_error(str(exc)) from None


def _run(args, device: str, emulated: bool, t_start: float, model_cfg: Optional[dict]) -> int:
    import torch

    from npu_flashrl import patches
    from npu_flashrl.testing.synthetic_task import MarkovTask

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
        settings = _tiny_settings(args, task)
        tiny = ensure_tiny_model(cache_root, settings, task, progress)
        bf16_dir, master_dir = tiny["bf16_dir"], tiny["master_dir"]
        model_info = {"source": "tiny", "dir": bf16_dir, "cache_dir": tiny["dir"], "cache_hit": tiny["cache_hit"],
                      "cache_key": tiny["key"], "trained_this_run": not tiny["cache_hit"],
                      "pretrain": tiny["train"], "settings": settings}
        step_lr = args.step_lr if args.step_lr is not None else 5e-4
    else:
        bf16_dir = master_dir = os.path.abspath(args.model)
        model_info = {"source": "local", "dir": bf16_dir, "cache_hit": None, "trained_this_run": False,
                      "architectures": model_cfg.get("architectures")}
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
    master = _hf_load(master_dir, torch.float32, device)
    snapshots, step_losses, step_update = simulate_training(master, task, args.steps, args.inner_iters, step_lr,
                                               args.seed, device, progress)
    del master
    trainer = _hf_load(bf16_dir, torch.bfloat16, device)
    train_logps = trainer_logps(trainer, snapshots, eval_ids, fp32_head=not args.no_fp32_head, progress=progress)
    del trainer
    timings["trainer_s"] = time.perf_counter() - t

    # ---------------------------------------------------------------- 3. setup + activation
    t = time.perf_counter()
    with _bar(3, "profile / setup / activate", progress) as bar:
        if device == "cpu":
            from npu_flashrl.testing import cpu_vllm

            cpu_vllm.prepare_process()  # torch_npu emulation + vLLM CPU platform, before vLLM loads
        bar.update(1)
        setup = prepare_config(args, bf16_dir, work, progress=False)
        bar.update(1)
        from npu_flashrl.adapters import vllm_ascend

        vllm_ascend.configure_online_quantization(None)  # the bf16 baseline is built first
        import npu_flashrl

        applied = npu_flashrl.activate(setup["config"])
        bar.update(1)
    timings["setup_s"] = time.perf_counter() - t

    # ---------------------------------------------------------------- 4. rollout variants
    rows: List[Dict[str, Any]] = []
    infos: Dict[str, Dict[str, Any]] = {}

    def bf16_build():
        vllm_ascend.configure_online_quantization(None)
        return _rollout(device, bf16_dir, None)

    entry_info: Dict[str, Any] = {}

    def int8_build():
        engine_args, entry, _, _ = activate_entry(setup["config"], bf16_dir)
        entry_info.update(fn=entry.fn, model=engine_args.model, quantization=engine_args.quantization,
                          load_format=engine_args.load_format)
        return _rollout(device, engine_args.model, engine_args.quantization, engine_args.load_format or "auto")

    t = time.perf_counter()
    r, infos[VARIANT_BF16] = run_variant(VARIANT_BF16, bf16_build, snapshots, eval_ids, train_logps, "bf16",
                                         args, vocab_size, device, int8=False, progress=progress)
    rows += r
    r, infos[VARIANT_INT8] = run_variant(VARIANT_INT8, int8_build, snapshots, eval_ids, train_logps, "bf16",
                                         args, vocab_size, device, int8=True, progress=progress)
    rows += r
    if not args.no_fp32_head:
        # FLASHRL_LMHEAD_FP32 on the rollout side: the patches are process-global, so this variant runs
        # last (the models above were built and measured without them).
        from npu_flashrl.adapters import vllm as vllm_fp32

        vllm_fp32.enable_lm_head_fp32()
        r, infos[VARIANT_INT8_FP32HEAD] = run_variant(VARIANT_INT8_FP32HEAD, int8_build, snapshots, eval_ids,
                                                      train_logps, "fp32head", args, vocab_size, device,
                                                      int8=True, progress=progress)
        rows += r
    vllm_ascend.configure_online_quantization(None)
    timings["rollout_s"] = time.perf_counter() - t

    # ---------------------------------------------------------------- 5. output
    checks = evaluate_checks(rows, infos, args)
    ok = all(c["ok"] for c in checks)
    plot_path = None
    plot_note = None
    if not args.no_plot:
        plot_path = write_plot(rows, os.path.join(output_dir, "mismatch.png"))
        if plot_path is None:
            plot_note = "matplotlib is not installed: no plot (pip install matplotlib)"
    timings["total_s"] = time.perf_counter() - t_start
    timings["process_s"] = _process_seconds()  # including Python start-up and imports before run()
    status = patches.status()
    applied_names = [p["name"] for p in status if p["applied"]]
    summary = _summaries(rows)
    report = {
        "ok": ok,
        "exit_code": 0 if ok else 1,
        "settings": {k: v for k, v in vars(args).items() if k != "func"},
        "resolved": {"device": device, "emulated_torch_npu": emulated, "threads": threads, "step_lr": step_lr,
                     "fn": setup["fn"], "entry": entry_info},
        "device": {"device": device, "emulated": emulated,
                   "note": ("CPU with emulated torch_npu kernels" if emulated
                            else "real NPU (not verified on hardware)")},
        "model": model_info,
        "task": task.to_dict(),
        "eval": {"num_seqs": args.num_seqs, "seq_len": args.seq_len,
                 "scored_tokens": int(eval_ids[:, 1:].numel())},
        "setup": setup,
        "steps": _json_safe(rows),
        "step_train_loss": step_losses,
        "step_weight_update_rel": step_update,
        "summary": summary,
        "variants": infos,
        "checks": checks,
        "timings": timings,
        "patches": {"applied": applied_names, "activation_result": applied, "status": status},
        "versions": _versions(),
        "plot": plot_path,
        "plot_note": plot_note,
    }
    from npu_flashrl.config import atomic_write

    report_path = os.path.join(output_dir, "report.json")
    atomic_write(report_path, lambda f: json.dump(_json_safe(report), f, indent=2))

    _print_summary(rows, summary, checks, applied_names, report, report_path)
    return 0 if ok else 1


def _print_summary(rows, summary, checks, applied_names, report, report_path) -> None:
    out = sys.stdout
    model = report["model"]
    dev = report["device"]
    src = ("tiny Qwen2 " + ("(cached, not retrained)" if model.get("cache_hit") else
                            f"(pre-trained this run in {report['timings']['pretrain_s']:.1f}s)")
           if model["source"] == "tiny" else f"local model {model['dir']}")
    print(f"npu-flashrl rehearse: {src}; device {dev['device']} ({dev['note']}); fn {report['resolved']['fn']}; "
          f"{len({r['step'] for r in rows})} steps x {report['settings']['buckets']} buckets; "
          f"{report['eval']['scored_tokens']} scored tokens", file=out)
    print("", file=out)
    print(format_table(rows), file=out)
    print("", file=out)
    b = summary.get(VARIANT_BF16, {})
    for v, s in summary.items():
        ratio = ""
        if v != VARIANT_BF16 and b.get("reload_s_mean"):
            ratio = f" ({s['reload_s_mean'] / b['reload_s_mean']:.1f}x the bf16 reload)"
        print(f"{v:>14}: token_mult_prob_error mean {s['token_mult_prob_error_mean']:.5f} max "
              f"{s['token_mult_prob_error_max']:.5f}; reload mean {s['reload_s_mean'] * 1e3:.1f} ms{ratio}",
              file=out)
    print("", file=out)
    print(f"patches applied ({len(applied_names)}): {', '.join(applied_names) or '(none)'}", file=out)
    for c in checks:
        print(f"[{'OK' if c['ok'] else 'FAIL'}] {c['check']}: {c['detail']}", file=out)
    tm = report["timings"]
    proc = f"; process wall time {tm['process_s']:.1f}s" if tm.get("process_s") else ""
    print(f"time: total {tm['total_s']:.1f}s{proc} (model {tm['model_s']:.1f}s, trainer {tm['trainer_s']:.1f}s, "
          f"setup {tm['setup_s']:.1f}s, rollout {tm['rollout_s']:.1f}s)", file=out)
    upd = report.get("step_weight_update_rel") or []
    if upd:
        print("relative weight change per step: " + ", ".join(f"{u:.2e}" for u in upd), file=out)
    print(f"report: {report_path}" + (f"; plot: {report['plot']}" if report["plot"] else
                                      (f"; {report['plot_note']}" if report["plot_note"] else "")), file=out)
    print("rehearsal " + ("passed" if report["ok"] else "FAILED"), file=out)
