"""Megatron / MindSpeed trainer side: import order, weight stream to the INT8 rollout, FP32 lm-head.

Written against verl 51d2104ecb61563c41123a8f0bce2f06b18387dc (the pin), megatron-core 0.12.1 and
MindSpeed (source install at the pinned commit). Nothing here imports Megatron, MindSpeed or verl at
module import time: ``npu_flashrl.adapters.load_all()`` imports this module in every process.

1. Import order (MindSpeed before Megatron)
-------------------------------------------
MindSpeed adapts Megatron to Ascend by replacing attributes of Megatron modules when
``mindspeed.megatron_adaptor`` is imported; names Megatron modules already bound with ``from x import
y`` before that keep the CUDA versions. verl 51d2104 handles this itself at the top of
``verl/workers/megatron_workers.py``::

    try:
        from mindspeed.megatron_adaptor import repatch
    except ImportError:
        repatch = None
    from megatron.core import parallel_state as mpu

and ``ActorRolloutRefWorker.__init__`` calls ``repatch(actor.megatron.override_transformer_config)``
(MindSpeed re-applies its feature patches for that config, e.g. ``use_flash_attn``,
``context_parallel_size``). Two silent failure modes remain, and :func:`ensure_mindspeed_before_megatron`
turns both into errors:

* MindSpeed missing, or failing to import for another reason (``except ImportError`` swallows a broken
  MindSpeed install too): verl runs plain Megatron on the NPU and fails later, far from the cause.
* Something imported ``megatron`` earlier in the process (a reward module, a user plugin, an earlier
  ``verl.models.mcore`` import): MindSpeed then patches too late. Detected from the order of
  ``sys.modules`` (a dict: a module's key is inserted when its import *starts*).

Hooks, lightest first:

* :func:`install_import_guard` puts a one-shot finder on ``sys.meta_path``: the first ``import megatron``
  in the process runs :func:`ensure_mindspeed_before_megatron` first, whoever imports it.
* :func:`worker_process_setup` is a Ray ``worker_process_setup_hook``: it runs in *every* Ray worker
  process before any actor class is unpickled (i.e. before ``verl.workers.megatron_workers`` is
  imported), installs the import guard, and applies the patches below as soon as verl's Megatron worker
  module is imported. Enable it with
  ``+ray_kwargs.ray_init.runtime_env.worker_process_setup_hook=npu_flashrl.adapters.megatron.worker_process_setup``
  (verl merges ``ray_kwargs.ray_init.runtime_env`` into its default runtime env).
* The registered patch ``megatron_mindspeed_guard`` wraps the ``__init__`` of verl's Megatron workers
  (``ActorRolloutRefWorker``, ``CriticWorker``, ``RewardModelWorker``): in each worker process that
  builds a Megatron model, the order is checked before verl's own ``repatch`` runs, and a missing
  MindSpeed on NPU (``verl.utils.device.is_npu_available``) is an error. Applying it never imports verl's
  Megatron worker module (that would import Megatron): if the module is not imported yet, the wrap is
  deferred to its import (a post-import hook), so the patch is safe to apply in FSDP and vLLM processes.
  The vLLM general plugin alone activates npu_flashrl too late in a trainer worker (vLLM loads plugins
  when the rollout is built, after Megatron is imported): use the Ray hook for the import order; the
  worker-init check still reports a wrong order then.

2. Weight stream: what verl 51d2104 sends and what the INT8 reload needs
------------------------------------------------------------------------
``ActorRolloutRefWorker.rollout_mode`` sends ``per_tensor_generator(actor_module, actor_model_config,
weight_converter, tf_config, layer_name_mapping)`` (``verl/utils/megatron_utils.py``) to
``rollout.update_weights`` -> ``model.load_weights``. That generator already: broadcasts each tensor from
its PP stage, renumbers layers globally (``normalize_model_name`` + ``get_transformer_layer_offset``),
all-gathers TP shards and merges them (``default_tp_concat_fn``: QKV split per KV group into q, k, v;
``linear_fc1`` split per shard into gate, up; row-parallel tensors concatenated on dim 1), and maps names
with ``McoreToHFWeightConverterDense.convert_param`` (``verl/models/mcore/weight_converter.py``). So it
yields HF names with full, unsharded shapes, q/k/v (+bias) and gate/up separate, in the model's param
dtype (bf16 under Megatron's Float16Module; FSDP sends fp32 masters). With ``use_mbridge=True``,
``bridge.export_weights`` yields HF names as well.

:func:`megatron_to_hf_stream` is the one place that converts for the INT8 reload
(``vllm_ascend.Int8WeightLoader``): HF-named tensors are validated (full shapes from the HF config, layer
index in range) and passed through unchanged; Megatron-named tensors (full, or as a list of TP shards in
rank order, with a PP ``layer_offset``) are merged and split exactly as verl does and renamed with verl's
converter when importable. The patch ``megatron_weight_stream`` routes verl's ``per_tensor_generator``
through it, so a malformed stream fails with the tensor's name before vLLM sees it.

3. FP32 lm-head (``FLASHRL_LMHEAD_FP32=1``)
-------------------------------------------
:func:`enable_fp32_output_layer` gives the GPT model's ``output_layer`` (a ``ColumnParallelLinear``) an
instance ``forward`` that calls the class forward with the input and weight upcast to fp32, so TP
communication, sequence parallel and MindSpeed's class-level patches still apply. Parameters keep their
dtype and identity (the distributed optimizer owns them); the gradient flows back through the cast. Per
call it turns off ``gradient_accumulation_fusion`` (that path writes ``weight.main_grad`` of the weight it
is given, which the transient fp32 copy lacks); the gradient then reaches ``param.grad`` and Megatron
DDP's hook adds it to ``main_grad``. Tied embeddings: the shared weight passed by ``GPTModel`` is upcast
the same way. The patch ``megatron_lmhead_fp32`` applies it to every ``GPTModel`` built afterwards.
"""
from __future__ import annotations

import importlib
import importlib.abc
import importlib.util
import os
import re
import sys
import types
from typing import Any, Dict, Iterable, Iterator, List, Optional, Sequence, Tuple, Union

import torch

from npu_flashrl.config import lmhead_fp32_requested  # noqa: F401  (re-exported)
from npu_flashrl import patches
from npu_flashrl._logging import get_logger
from npu_flashrl.patches import PatchNotApplicable, register

logger = get_logger("adapters.megatron")

VERL_PIN = "51d2104ecb61563c41123a8f0bce2f06b18387dc"
ADAPTOR = "mindspeed.megatron_adaptor"
WORKER_MODULE = "verl.workers.megatron_workers"
WORKER_CLASSES = ("ActorRolloutRefWorker", "CriticWorker", "RewardModelWorker")

PATCH_GUARD = "megatron_mindspeed_guard"
PATCH_STREAM = "megatron_weight_stream"
PATCH_LMHEAD = "megatron_lmhead_fp32"
PATCHES = (PATCH_GUARD, PATCH_STREAM)

MARK = "_npu_flashrl_fp32_output_layer"
_WRAPPED = "__npu_flashrl_megatron__"

__all__ = [
    "MindSpeedError", "MindSpeedMissingError", "MindSpeedImportOrderError", "WeightStreamError",
    "ensure_mindspeed_before_megatron", "install_import_guard", "worker_process_setup",
    "megatron_to_hf_stream", "hf_shapes", "pp_layer_offset",
    "enable_fp32_output_layer", "disable_fp32_output_layer", "is_fp32_output_layer",
    "lmhead_fp32_requested", "PATCHES", "PATCH_GUARD", "PATCH_STREAM", "PATCH_LMHEAD",
]


# =========================================================================== 1. import order

class MindSpeedError(RuntimeError):
    """MindSpeed / Megatron set-up problem on the trainer side."""


class MindSpeedMissingError(MindSpeedError):
    pass


class MindSpeedImportOrderError(MindSpeedError):
    pass


def _importable(name: str) -> bool:
    try:
        return importlib.util.find_spec(name) is not None
    except (ImportError, ValueError):
        return False


def _npu_device(device: Optional[str]) -> bool:
    """`device` as verl's ``trainer.device`` ('npu', 'cuda', ...); None: torch_npu really importable."""
    if device is not None:
        return str(device).lower().startswith("npu")
    loaded = sys.modules.get("torch_npu")
    if loaded is not None:  # npu_flashrl's CPU emulation of torch_npu is no NPU
        return not getattr(loaded, "__npu_flashrl_emulated__", False)
    if not _importable("torch_npu"):
        return False
    try:
        mod = importlib.import_module("torch_npu")
    except Exception:  # noqa: BLE001 - a torch_npu that cannot load is no NPU
        return False
    # npu_flashrl's CPU emulation of torch_npu is no NPU either
    return not getattr(mod, "__npu_flashrl_emulated__", False)


def _mindspeed_pin() -> Tuple[str, str]:
    try:
        from npu_flashrl.pins import load_pins

        ms = load_pins()["packages"]["mindspeed"]
        return str(ms.get("repo", "https://gitee.com/ascend/MindSpeed.git")), str(ms["commit"])
    except Exception as exc:  # noqa: BLE001 - the message must still be produced
        return "https://gitee.com/ascend/MindSpeed.git", f"<pinned commit: pins.yaml unreadable: {exc}>"


def _missing_message() -> str:
    repo, commit = _mindspeed_pin()
    return ("verl's Megatron backend (actor_rollout_ref.actor.strategy=megatron) on Ascend NPU needs MindSpeed, "
            "and it is not installed in this Python environment. Install it from source at the pinned commit: "
            f"git clone {repo} MindSpeed && cd MindSpeed && git checkout {commit} && pip install -e . "
            "(scripts/install_pinned.sh does this), or use the FSDP backend (strategy=fsdp), which does not "
            "need MindSpeed.")


def _first_index(keys: Sequence[str], pred) -> Optional[int]:
    for i, k in enumerate(keys):
        if pred(k):
            return i
    return None


def _is_megatron(name: str) -> bool:
    return name == "megatron" or name.startswith("megatron.")


def import_order() -> Dict[str, Optional[int]]:
    """Positions in ``sys.modules`` (insertion = import start) of the first megatron module, of the
    ``mindspeed`` package and of ``mindspeed.megatron_adaptor`` (None when not imported)."""
    keys = list(sys.modules.keys())
    return {"megatron": _first_index(keys, _is_megatron),
            "mindspeed": _first_index(keys, lambda k: k == "mindspeed"),
            "adaptor": _first_index(keys, lambda k: k == ADAPTOR)}


def _order_error(what: str) -> MindSpeedImportOrderError:
    return MindSpeedImportOrderError(
        f"{what}. MindSpeed adapts Megatron to Ascend by patching Megatron modules when "
        f"`import {ADAPTOR}` runs; modules imported before that keep the CUDA code. Fix: import "
        f"{ADAPTOR} before anything imports megatron (first line of the entry point, or "
        "+ray_kwargs.ray_init.runtime_env.worker_process_setup_hook=npu_flashrl.adapters.megatron.worker_process_setup "
        "for verl's Ray workers), and do not import megatron/verl.models.mcore from reward or plugin modules "
        "loaded earlier.")


_ensure_busy = False


def ensure_mindspeed_before_megatron(device: Optional[str] = None) -> Optional[str]:
    """Make sure MindSpeed's Megatron adaptor is imported before Megatron in this process.

    * MindSpeed installed: imports ``mindspeed.megatron_adaptor`` if Megatron is not imported yet
      (returns ``"imported"``) or checks it was imported first (``"already"``); raises
      :class:`MindSpeedImportOrderError` when a megatron module was imported before it. An import
      error inside MindSpeed propagates (verl's ``except ImportError`` would hide it).
    * MindSpeed absent on NPU (``device`` 'npu', or ``device=None`` and torch_npu importable): raises
      :class:`MindSpeedMissingError` naming the pinned commit. Elsewhere returns None.
    """
    global _ensure_busy
    order = import_order()
    if not _importable("mindspeed") and order["mindspeed"] is None:
        if _npu_device(device):
            raise MindSpeedMissingError(_missing_message())
        return None
    if order["adaptor"] is not None:
        first_ms = min(i for i in (order["mindspeed"], order["adaptor"]) if i is not None)
        if order["megatron"] is not None and order["megatron"] < first_ms:
            raise _order_error(f"megatron was imported before {ADAPTOR} in this process")
        return "already"
    if order["megatron"] is not None:
        raise _order_error(f"megatron ({next(k for k in sys.modules if _is_megatron(k))}) is already imported "
                           f"and {ADAPTOR} is not")
    if _ensure_busy:
        return "importing"
    _ensure_busy = True
    try:
        importlib.import_module(ADAPTOR)
    finally:
        _ensure_busy = False
    logger.debug("npu_flashrl: imported %s before megatron", ADAPTOR)
    return "imported"


class _MegatronImportGuard(importlib.abc.MetaPathFinder):
    """One-shot: on the first ``import megatron`` run the guard, then let the normal finders work."""

    def __init__(self, device: Optional[str] = None):
        self.device = device

    def find_spec(self, fullname, path=None, target=None):
        if fullname != "megatron" or _ensure_busy:
            return None
        _remove_finder(_MegatronImportGuard)
        ensure_mindspeed_before_megatron(self.device)
        return None


class _PostImport(importlib.abc.MetaPathFinder):
    """Run ``callback(module)`` right after ``name`` is imported (wraps the real loader)."""

    def __init__(self, name: str, callback):
        self.name = name
        self.callback = callback
        self._busy = False

    def find_spec(self, fullname, path=None, target=None):
        if fullname != self.name or self._busy:
            return None
        self._busy = True
        try:
            spec = importlib.util.find_spec(fullname)
        finally:
            self._busy = False
        if spec is None or spec.loader is None or not hasattr(spec.loader, "exec_module"):
            return None
        loader, callback, me = spec.loader, self.callback, self

        class _Loader(importlib.abc.Loader):
            def create_module(self, spec_):
                return loader.create_module(spec_)

            def exec_module(self, module):
                loader.exec_module(module)
                _remove_finder(me)
                callback(module)

        spec.loader = _Loader()
        return spec


def _remove_finder(which) -> None:
    for f in list(sys.meta_path):
        if (isinstance(which, type) and isinstance(f, which)) or f is which:
            sys.meta_path.remove(f)


def install_import_guard(device: Optional[str] = None) -> bool:
    """Install the one-shot ``import megatron`` guard (idempotent). Returns False when Megatron is
    already imported (then only :func:`ensure_mindspeed_before_megatron` can tell, by raising)."""
    if import_order()["megatron"] is not None:
        return False
    if not any(isinstance(f, _MegatronImportGuard) for f in sys.meta_path):
        sys.meta_path.insert(0, _MegatronImportGuard(device))
    return True


def when_imported(name: str, callback) -> None:
    """``callback(module)`` now if ``name`` is imported, else right after its import."""
    mod = sys.modules.get(name)
    if mod is not None:
        callback(mod)
        return
    if not any(isinstance(f, _PostImport) and f.name == name and f.callback is callback for f in sys.meta_path):
        sys.meta_path.insert(0, _PostImport(name, callback))


def _worker_device() -> Optional[str]:
    try:
        from verl.utils.device import is_npu_available
    except Exception:  # noqa: BLE001
        return None
    return "npu" if is_npu_available else "cpu"


def _wrap_worker_init(original):
    def __init__(self, *args, **kwargs):
        ensure_mindspeed_before_megatron(_worker_device())
        if lmhead_fp32_requested():
            patches.apply_patch(PATCH_LMHEAD)
        return original(self, *args, **kwargs)

    __init__.__wrapped__ = original
    setattr(__init__, _WRAPPED, True)
    return __init__


def _patch_worker_module(module) -> None:
    for cls_name in WORKER_CLASSES:
        cls = getattr(module, cls_name, None)
        if cls is None:
            continue
        init = cls.__dict__.get("__init__")
        if init is None or getattr(init, _WRAPPED, False):
            continue
        new = _wrap_worker_init(init)
        setattr(new, patches.ORIGINAL_ATTR, init)
        cls.__init__ = new


@register(PATCH_GUARD, f"{WORKER_MODULE}:ActorRolloutRefWorker.__init__ (+CriticWorker, RewardModelWorker)",
          f"verl {VERL_PIN[:7]} / 0.6.1",
          doc="Megatron workers check MindSpeed was imported before Megatron (error on NPU without MindSpeed)")
def _apply_guard() -> None:
    install_import_guard()
    when_imported(WORKER_MODULE, _patch_worker_module)


def worker_process_setup() -> None:
    """Ray ``worker_process_setup_hook``: import guard + verl Megatron worker patches in every worker.

    ``+ray_kwargs.ray_init.runtime_env.worker_process_setup_hook=npu_flashrl.adapters.megatron.worker_process_setup``
    """
    install_import_guard()
    for name in PATCHES:
        patches.apply_patch(name)


# =========================================================================== 2. weight stream

class WeightStreamError(ValueError):
    """A tensor of the trainer's weight stream that the rollout cannot take."""


_LAYER = re.compile(r"^(?:.*\.)?layers\.(\d+)\.(.+)$")

# Megatron (TE spec and local spec) -> HF, for names verl's converter does not cover or when verl
# is not importable. {L}: decoder layer number.
_MCORE_TO_HF = {
    "embedding.word_embeddings.weight": "model.embed_tokens.weight",
    "decoder.final_layernorm.weight": "model.norm.weight",
    "output_layer.weight": "lm_head.weight",
}
_MCORE_LAYER_TO_HF = {
    "input_layernorm.weight": "input_layernorm.weight",                          # local spec
    "self_attention.linear_qkv.layer_norm_weight": "input_layernorm.weight",     # TE spec
    "pre_mlp_layernorm.weight": "post_attention_layernorm.weight",               # local spec
    "mlp.linear_fc1.layer_norm_weight": "post_attention_layernorm.weight",       # TE spec
    "self_attention.linear_proj.weight": "self_attn.o_proj.weight",
    "self_attention.q_layernorm.weight": "self_attn.q_norm.weight",
    "self_attention.k_layernorm.weight": "self_attn.k_norm.weight",
    "mlp.linear_fc2.weight": "mlp.down_proj.weight",
    "self_attention.linear_qkv.weight": ("self_attn.q_proj.weight", "self_attn.k_proj.weight",
                                         "self_attn.v_proj.weight"),
    "self_attention.linear_qkv.bias": ("self_attn.q_proj.bias", "self_attn.k_proj.bias",
                                       "self_attn.v_proj.bias"),
    "mlp.linear_fc1.weight": ("mlp.gate_proj.weight", "mlp.up_proj.weight"),
}
# How Megatron shards each tensor over TP ranks: dim of the concatenation (None: replicated).
_ROW_PARALLEL = ("self_attention.linear_proj.weight", "mlp.linear_fc2.weight")
_REPLICATED = ("layernorm", "layer_norm", "final_layernorm")


def _cfg(config, name, default=None):
    if isinstance(config, dict):
        return config.get(name, default)
    return getattr(config, name, default)


def _dims(config) -> Dict[str, int]:
    hidden = int(_cfg(config, "hidden_size"))
    heads = int(_cfg(config, "num_attention_heads"))
    kv = int(_cfg(config, "num_key_value_heads") or heads)
    head_dim = int(_cfg(config, "head_dim") or hidden // heads)
    return dict(hidden=hidden, heads=heads, kv=kv, head_dim=head_dim,
                inter=int(_cfg(config, "intermediate_size")), layers=int(_cfg(config, "num_hidden_layers")),
                vocab=int(_cfg(config, "vocab_size")))


def hf_shapes(config) -> Dict[str, Tuple[int, ...]]:
    """Full HF shapes per layer-relative name (``self_attn.q_proj.weight`` ...) for a dense Qwen2/Llama."""
    d = _dims(config)
    q, kv, h, i = d["heads"] * d["head_dim"], d["kv"] * d["head_dim"], d["hidden"], d["inter"]
    return {
        "self_attn.q_proj.weight": (q, h), "self_attn.k_proj.weight": (kv, h), "self_attn.v_proj.weight": (kv, h),
        "self_attn.q_proj.bias": (q,), "self_attn.k_proj.bias": (kv,), "self_attn.v_proj.bias": (kv,),
        "self_attn.o_proj.weight": (h, q), "mlp.gate_proj.weight": (i, h), "mlp.up_proj.weight": (i, h),
        "mlp.down_proj.weight": (h, i), "input_layernorm.weight": (h,), "post_attention_layernorm.weight": (h,),
        "self_attn.q_norm.weight": (d["head_dim"],), "self_attn.k_norm.weight": (d["head_dim"],),
    }


def pp_layer_offset(pp_rank: int, pp_size: int, num_layers: int,
                    first_stage_layers: Optional[int] = None, last_stage_layers: Optional[int] = None) -> int:
    """Global index of the first decoder layer of PP stage ``pp_rank`` (Megatron's even split, or
    ``num_layers_in_first/last_pipeline_stage``), as ``get_transformer_layer_offset`` computes it."""
    if pp_size <= 1 or pp_rank == 0:
        return 0
    if first_stage_layers is None and last_stage_layers is None:
        if num_layers % pp_size:
            raise ValueError(f"{num_layers} layers do not split evenly over {pp_size} PP stages")
        return pp_rank * (num_layers // pp_size)
    first = first_stage_layers or 0
    last = last_stage_layers or 0
    middle = pp_size - (first_stage_layers is not None) - (last_stage_layers is not None)
    rest = num_layers - first - last
    per = rest // middle if middle else 0
    offset = first if first_stage_layers is not None else per
    return offset + (pp_rank - 1) * per


def _split_qkv(fused: torch.Tensor, d: Dict[str, int]) -> List[torch.Tensor]:
    """Megatron's fused QKV (rows: per KV group [q_per_kv heads of q, 1 head k, 1 head v]) -> q, k, v.
    Works on a TP-merged tensor (groups of all ranks in rank order) and on a single TP shard."""
    hd, q_per_kv = d["head_dim"], d["heads"] // d["kv"]
    group = (q_per_kv + 2) * hd
    if fused.shape[0] % group:
        raise WeightStreamError(f"linear_qkv rows {fused.shape[0]} not a multiple of the KV-group size {group}")
    g = fused.reshape(fused.shape[0] // group, group, *fused.shape[1:])
    q, k, v = g.split([q_per_kv * hd, hd, hd], dim=1)
    return [t.reshape(-1, *fused.shape[1:]) for t in (q, k, v)]


def _merge_tp(rel: str, shards: Sequence[torch.Tensor], d: Dict[str, int]) -> List[torch.Tensor]:
    """TP shards (rank order) of a Megatron tensor -> the HF tensors it holds, unsharded."""
    if rel.startswith("self_attention.linear_qkv.") and "layer_norm" not in rel:
        parts = [_split_qkv(s, d) for s in shards]       # each shard holds whole KV groups
        return [torch.cat([p[j] for p in parts], dim=0) for j in range(3)]
    if rel == "mlp.linear_fc1.weight":
        halves = [s.chunk(2, dim=0) for s in shards]      # each shard is [gate_r; up_r]
        return [torch.cat([h[j] for h in halves], dim=0) for j in range(2)]
    if any(r in rel for r in _REPLICATED):
        return [shards[0]]
    dim = 1 if rel in _ROW_PARALLEL else 0
    return [torch.cat(list(shards), dim=dim)]


_verl_converter_cache: Dict[str, Any] = {}


def _verl_convert(name: str, params: List[torch.Tensor]):
    """verl's own ``McoreToHFWeightConverterDense.convert_param`` when importable (None otherwise)."""
    conv = _verl_converter_cache.get("dense", False)
    if conv is False:
        try:
            from verl.models.mcore.weight_converter import McoreToHFWeightConverterDense

            conv = McoreToHFWeightConverterDense(None, None)  # convert_param uses neither config
        except Exception as exc:  # noqa: BLE001
            logger.debug("verl weight converter not importable (%s); using the built-in table", exc)
            conv = None
        _verl_converter_cache["dense"] = conv
    if conv is None:
        return None
    try:
        names, tensors = conv.convert_param(name, params)
    except (NotImplementedError, AssertionError):
        return None
    return list(names), list(tensors)


def _convert_megatron(name: str, value, d: Dict[str, int], layer_offset: int,
                      use_verl: bool) -> List[Tuple[str, torch.Tensor]]:
    shards = list(value) if isinstance(value, (list, tuple)) else [value]
    if name in _MCORE_TO_HF:
        # embedding / output_layer are vocab-parallel (dim 0); the final norm is replicated
        t = shards[0] if len(shards) == 1 or "layernorm" in name else torch.cat(shards, dim=0)
        return [(_MCORE_TO_HF[name], t)]
    m = _LAYER.match(name)
    if m is None or not name.startswith("decoder."):
        raise WeightStreamError(f"{name}: not a Megatron GPT (dense) parameter name this adapter knows")
    layer, rel = int(m.group(1)) + layer_offset, m.group(2)
    if rel not in _MCORE_LAYER_TO_HF:
        raise WeightStreamError(f"{name}: unsupported Megatron parameter (known: {sorted(_MCORE_LAYER_TO_HF)})")
    tensors = _merge_tp(rel, shards, d)
    global_name = f"decoder.layers.{layer}.{rel}"
    if use_verl:
        got = _verl_convert(global_name, tensors)
        if got is not None:
            return list(zip(*got))
    hf = _MCORE_LAYER_TO_HF[rel]
    hf = hf if isinstance(hf, tuple) else (hf,)
    return [(f"model.layers.{layer}.{h}", t) for h, t in zip(hf, tensors)]


def _is_megatron_name(name: str) -> bool:
    return (name.startswith("decoder.") or name in _MCORE_TO_HF) and "_extra_state" not in name


def _validate_hf(name: str, tensor: torch.Tensor, d: Dict[str, int], shapes: Dict[str, Tuple[int, ...]]) -> None:
    if not isinstance(tensor, torch.Tensor):
        raise WeightStreamError(f"{name}: expected a tensor, got {type(tensor).__name__}")
    m = re.match(r"^model\.layers\.(\d+)\.(.+)$", name)
    if m:
        layer, rel = int(m.group(1)), m.group(2)
        if layer >= d["layers"]:
            raise WeightStreamError(f"{name}: layer {layer} >= num_hidden_layers {d['layers']} "
                                    "(PP layer offset applied twice?)")
        want = shapes.get(rel)
        if want is not None and tuple(tensor.shape) != want:
            hint = " (a TP shard? the rollout needs full tensors)" if tensor.numel() < torch.Size(want).numel() else ""
            raise WeightStreamError(f"{name}: expected full shape {want}, got {tuple(tensor.shape)}{hint}")
    elif name in ("model.embed_tokens.weight", "lm_head.weight"):
        if tensor.dim() != 2 or tensor.shape[1] != d["hidden"] or tensor.shape[0] < d["vocab"]:
            raise WeightStreamError(f"{name}: expected ({d['vocab']}, {d['hidden']}), got {tuple(tensor.shape)}")
    elif name == "model.norm.weight" and tuple(tensor.shape) != (d["hidden"],):
        raise WeightStreamError(f"{name}: expected ({d['hidden']},), got {tuple(tensor.shape)}")


def megatron_to_hf_stream(named_tensors: Iterable[Tuple[str, Union[torch.Tensor, Sequence[torch.Tensor]]]],
                          config, layer_offset: int = 0, use_verl: bool = True,
                          validate: bool = True) -> Iterator[Tuple[str, torch.Tensor]]:
    """Turn what a Megatron trainer sends into HF-named, full tensors for the INT8 reload (lazily).

    ``named_tensors`` items are ``(name, tensor)`` or ``(name, [tp_rank0, tp_rank1, ...])``:

    * HF names (what verl 51d2104's ``per_tensor_generator`` and mbridge yield): validated against
      ``config`` (the HF config: full shapes, layer index) and passed through unchanged;
    * Megatron names (``decoder.layers.{i}.self_attention.linear_qkv.weight`` ...; a ``module.`` prefix is
      stripped; ``_extra_state`` skipped): fused QKV (+bias) split per KV group into q/k/v, ``linear_fc1``
      into gate/up, TP shards merged (column-parallel on dim 0, row-parallel on dim 1, norms replicated),
      layer numbers shifted by ``layer_offset`` (this PP stage's first global layer, see
      :func:`pp_layer_offset`), renamed with verl's ``McoreToHFWeightConverterDense`` when importable.

    Tensors keep their dtype. Raises :class:`WeightStreamError` naming the tensor on anything else.
    """
    d = _dims(config)
    shapes = hf_shapes(config)
    for name, value in named_tensors:
        while name.startswith("module."):
            name = name[len("module."):]
        if "_extra_state" in name:
            continue
        if _is_megatron_name(name):
            out = _convert_megatron(name, value, d, layer_offset, use_verl)
        else:
            if isinstance(value, (list, tuple)):
                raise WeightStreamError(f"{name}: HF-named tensors must arrive unsharded, got {len(value)} shards")
            out = [(name, value)]
        for hf_name, t in out:
            if validate:
                _validate_hf(hf_name, t, d, shapes)
            yield hf_name, t


def _wrap_per_tensor_generator(original):
    def per_tensor_generator(actor_module, model_config, *args, **kwargs):
        return megatron_to_hf_stream(original(actor_module, model_config, *args, **kwargs), model_config)

    per_tensor_generator.__wrapped__ = original
    setattr(per_tensor_generator, _WRAPPED, True)
    return per_tensor_generator


@register(PATCH_STREAM, f"{WORKER_MODULE}:per_tensor_generator", f"verl {VERL_PIN[:7]} / 0.6.1",
          doc="verl's Megatron->rollout weight stream passes megatron_to_hf_stream (validation; converts "
              "Megatron-named/sharded tensors if any)")
def _apply_stream() -> None:
    def patch(module):
        gen = getattr(module, "per_tensor_generator", None)
        if gen is None:
            logger.warning("npu_flashrl: %s has no per_tensor_generator; weight stream unchecked", WORKER_MODULE)
            return
        if not getattr(gen, _WRAPPED, False):
            module.per_tensor_generator = _wrap_per_tensor_generator(gen)

    when_imported(WORKER_MODULE, patch)


# =========================================================================== 3. FP32 output layer

def _fp32_forward(self, input_, weight=None, *args, **kwargs):
    w = self.weight if weight is None else weight
    fusion = getattr(self, "gradient_accumulation_fusion", False)
    if fusion:
        self.gradient_accumulation_fusion = False
    try:
        return type(self).forward(self, input_.float(), w.float(), *args, **kwargs)
    finally:
        if fusion:
            self.gradient_accumulation_fusion = True


def _output_layer(model):
    return getattr(model, "output_layer", None)


def is_fp32_output_layer(model) -> bool:
    head = _output_layer(model)
    return bool(head is not None and getattr(head, MARK, False))


def enable_fp32_output_layer(model) -> bool:
    """Make a Megatron GPT model's ``output_layer`` compute logits in fp32 (idempotent).

    Returns False (logged) when there is nothing to do: no output layer on this PP stage, a value head
    that is not a ``ColumnParallelLinear``, a bias that is added inside the layer, or deferred embedding
    wgrad compute (it stores the input for a later bf16 GEMM)."""
    head = _output_layer(model)
    if head is None:
        logger.debug("FP32 output_layer: %s has none (not the last PP stage)", type(model).__name__)
        return False
    if getattr(head, MARK, False):
        return True
    try:
        from megatron.core.tensor_parallel import ColumnParallelLinear
    except Exception as exc:  # noqa: BLE001
        logger.warning("FP32 output_layer: megatron.core not importable (%s); unchanged", exc)
        return False
    if not isinstance(head, ColumnParallelLinear):
        logger.warning("FP32 output_layer: %s.output_layer is %s, not ColumnParallelLinear; unchanged",
                       type(model).__name__, type(head).__name__)
        return False
    if getattr(head, "bias", None) is not None and not getattr(head, "skip_bias_add", False):
        logger.warning("FP32 output_layer: output_layer has a bias added inside the layer; unchanged")
        return False
    if getattr(getattr(head, "config", None), "defer_embedding_wgrad_compute", False):
        logger.warning("FP32 output_layer: defer_embedding_wgrad_compute is on; unchanged")
        return False
    head.forward = types.MethodType(_fp32_forward, head)
    setattr(head, MARK, True)
    dtype = head.weight.dtype if getattr(head, "weight", None) is not None else "shared"
    logger.debug("FP32 output_layer enabled on %s (param dtype %s kept)", type(model).__name__, dtype)
    return True


def disable_fp32_output_layer(model) -> bool:
    head = _output_layer(model)
    if head is None or not getattr(head, MARK, False):
        return False
    head.__dict__.pop("forward", None)
    delattr(head, MARK)
    return True


def _make_init(original):
    def __init__(self, *args, **kwargs):
        original(self, *args, **kwargs)
        try:
            enable_fp32_output_layer(self)
        except Exception as exc:  # noqa: BLE001 - never break model construction
            logger.warning("FP32 output_layer not enabled on %s: %s", type(self).__name__, exc)

    __init__.__wrapped__ = original
    return __init__


@register(PATCH_LMHEAD, "megatron.core.models.gpt.gpt_model:GPTModel.__init__", "megatron-core 0.12.x",
          doc="FLASHRL_LMHEAD_FP32 trainer side (Megatron): every GPTModel built afterwards computes logits in fp32")
def _apply_lmhead() -> None:
    # Only once Megatron's GPT model module is imported (by verl's Megatron workers): activation
    # must not import Megatron into FSDP jobs, nor before MindSpeed.
    when_imported("megatron.core.models.gpt.gpt_model",
                  lambda _mod: patches.replace("megatron.core.models.gpt.gpt_model:GPTModel.__init__",
                                               _make_init))
