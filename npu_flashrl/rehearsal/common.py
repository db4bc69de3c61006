"""Constants and small helpers shared by the rehearsal's modules (stdlib only)."""
from __future__ import annotations

import dataclasses
import math
import os
import sys
import time
from typing import Any, Dict, List, Optional

from npu_flashrl.errors import CliError

RECIPE_VERSION = 1  # bump when the tiny model / task / pre-training recipe changes (cache key)
DEFAULT_OUTPUT_DIR = "rehearsal_out"
VARIANT_BF16 = "bf16"
VARIANT_INT8 = "int8"
VARIANT_INT8_FP32HEAD = "int8+fp32head"
VARIANT_W4A8 = "w4a8"
VARIANT_ORDER = {VARIANT_BF16: 0, VARIANT_INT8: 1, VARIANT_W4A8: 2, VARIANT_INT8_FP32HEAD: 3}
SUPPORTED_ARCHITECTURES = ("Qwen2ForCausalLM", "LlamaForCausalLM", "MistralForCausalLM", "Qwen3ForCausalLM")
# --model only: mixture-of-experts decoders whose fused-MoE experts npu_flashrl reloads in INT8
# (vllm-ascend W8A8_DYNAMIC fused MoE) and whose router / experts the state check knows.
MOE_ARCHITECTURES = ("Qwen3MoeForCausalLM",)
MOE_CONFIG_KEYS = ("num_experts", "num_local_experts", "n_routed_experts")

# Per-layer output error: fixed random activations of this many tokens per layer; the default bound
# is ~4x the INT8 error measured on the tiny model (1.0-1.3%); broken layers are 10-100%.
LAYER_ERROR_TOKENS = 32
DEFAULT_MAX_LAYER_ERROR = 0.05
# The W4A8 variant's limits (int4 in groups, `state_w4a8.py`): its state check is exact, so these
# bound only what the state check cannot see.
DEFAULT_MAX_W4A8_LAYER_ERROR = 0.25
DEFAULT_MAX_W4A8_ERROR = 1.5

# --baseline-tol: bf16 vLLM vs bf16 transformers. A MoE's floor is higher: a token whose router
# logits nearly tie can take another expert in one of them (bf16 rounding of the router logits in
# different kernels). Measured on the random tiny Qwen3-MoE (16 x 48 tokens, 4 syncs): max 1.0105
# (current line) / 1.0146 (lines.v0_11_0), with one such token in 256 carrying most of a block's 2% bf16
# difference; INT8 was 1.029 / 1.034.
DEFAULT_BASELINE_TOL = 0.01
MOE_BASELINE_TOL = 0.02

# Pre-training of the default tiny model (about 250 x 40 ms on one CPU core).
TINY_TRAIN = dict(iters=250, lr=1e-2, batch=16, length=32)


class RehearsalError(CliError):
    """A setup problem (bad --model, missing package): message printed, exit code 1."""


def progress_bar(total: Optional[int], desc: str, enabled: bool):
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


def finite(x: Any) -> bool:
    return isinstance(x, (int, float)) and math.isfinite(x)


def json_safe(obj: Any) -> Any:
    """Non-finite floats become None (strict JSON)."""
    if isinstance(obj, float):
        return obj if math.isfinite(obj) else None
    if isinstance(obj, dict):
        return {str(k): json_safe(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [json_safe(v) for v in obj]
    return obj


def versions() -> Dict[str, Optional[str]]:
    from importlib.metadata import PackageNotFoundError, version

    import npu_flashrl

    out: Dict[str, Optional[str]] = {"python": sys.version.split()[0], "npu_flashrl": npu_flashrl.__version__}
    for dist in ("torch", "transformers", "vllm", "vllm-ascend", "verl", "compressed-tensors", "torch_npu"):
        try:
            out[dist] = version(dist)
        except PackageNotFoundError:
            out[dist] = None
    if out["vllm-ascend"] is None:  # a source tree on the path has no distribution metadata
        try:
            from npu_flashrl import lines
            out["vllm-ascend"] = f"{lines.current().name} (source tree)"
        except Exception:  # noqa: BLE001 - not installed at all: stays None
            pass
    return out


def process_seconds() -> Optional[float]:
    try:
        import psutil

        return time.time() - psutil.Process().create_time()
    except Exception:  # noqa: BLE001 - psutil is a vLLM dependency, but optional here
        return None


def default_cache_root() -> str:
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return os.path.join(base, "npu_flashrl", "rehearsal")


@dataclasses.dataclass(kw_only=True)
class RunBase:
    """What every rehearsal's `Run` keeps beside its checked arguments (the subclass's fields,
    `args` among them): the phases' timings, the thread count, the output and work folders."""
    timings: Dict[str, float] = dataclasses.field(default_factory=dict)
    threads: Optional[int] = None
    output_dir: str = ""
    work: str = ""

    @property
    def progress(self) -> bool:
        return not self.args.no_progress

    def prepare_output(self) -> None:
        """The run's first step: torch's thread count (--threads; one on a CPU unless given) and
        the output folder with its work folder, made."""
        import torch

        threads = self.args.threads
        self.threads = threads if threads is not None else (1 if self.device == "cpu" else None)
        if self.threads:
            torch.set_num_threads(self.threads)
        self.output_dir = os.path.abspath(self.args.output_dir)
        self.work = os.path.join(self.output_dir, "work")
        os.makedirs(self.work, exist_ok=True)


def moved_since_cold(layer, tensors: Dict[str, Any], cold_ptr, cold_format: Dict[str, str]) -> List[str]:
    """What of `layer` is no longer where the cold load left it: each of its checked `tensors`
    whose data pointer changed, and each attribute of `cold_format` ({name: storage format at the
    cold load}: a linear layer's weight, a fused-MoE layer's w13 / w2) whose storage format did."""
    from npu_flashrl import kernels

    moved = [f"{n} data_ptr" for n, t in tensors.items() if cold_ptr.get(n) not in (None, t.data_ptr())]
    for n, fmt in cold_format.items():
        now = kernels.storage_format(getattr(layer, n))
        if now != fmt:
            moved.append(f"{n} storage format ({fmt} -> {now})")
    return moved


def note_in_place(problems: Dict[str, Any], res: Dict[str, Any], layer, tensors: Dict[str, Any],
                  cold_ptr, cold_format: Dict[str, str]) -> None:
    """A layer check's in-place verdict: `res["moved"]` lists what `moved_since_cold` found,
    and `problems["in_place"]` names it when anything moved."""
    moved = moved_since_cold(layer, tensors, cold_ptr, cold_format)
    if moved:
        problems["in_place"] = f"not written in place: {', '.join(moved)} changed since the cold load"
    res["moved"] = moved
