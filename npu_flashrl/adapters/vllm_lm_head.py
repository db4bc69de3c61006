"""Rollout side of FLASHRL_LMHEAD_FP32: the vLLM / vllm-ascend lm_head held and computed in fp32.

FlashRL 1.0.3 does this by creating *every* ``VocabParallelEmbedding`` (embeddings included) with fp32
params and wrapping ``UnquantizedEmbeddingMethod.apply`` to run in fp32 and cast the logits back to
the input dtype. npu_flashrl differs on purpose:

* only the lm head is fp32 (``ParallelLMHead`` and vllm-ascend's ``AscendParallelLMHead``); input
  embeddings stay in the model dtype unless they ARE the lm head weight (tied embeddings), and then
  the embedding output is cast back to the model dtype so the rest of the model is unchanged;
* the logits stay fp32 (vLLM V1's Sampler converts logits to fp32 first thing anyway, so casting them
  back to bf16 would only add a rounding step to the log-probs we want to match the trainer's).

Pieces:

* patch ``vllm_lmhead_fp32_compute`` wraps ``UnquantizedEmbeddingMethod.apply``: that method is only
  ever used to turn hidden states into logits (embedding lookups use ``.embedding``), by vLLM's
  ``LogitsProcessor`` and by vllm-ascend's ``AscendLogitsProcessor`` (normal and lm-head-TP paths, on
  every supported line). For an fp32 lm head (marked by the init patch or
  :func:`upcast_lm_head`) it computes ``F.linear(h.float(), W.float(), b.float())``; any other lm
  head keeps vLLM's own. Quantized lm heads (another quant method) are untouched.
* patch ``vllm_lmhead_fp32_init`` wraps ``ParallelLMHead.__init__`` and, when vllm-ascend is
  importable, ``AscendParallelLMHead.__init__`` (vllm-ascend registers it as the out-of-tree op that
  ``ParallelLMHead(...)`` instantiates, and its ``__init__`` does not call ``ParallelLMHead.__init__``),
  so the weight is *created* in fp32 inside vLLM's model construction (i.e. inside the "weights" memory
  pool of sleep mode) before anything is loaded. Only the policy rollout's model (its engine config
  carries npu_flashrl's `EngineChoice`, any entry): a reward or teacher model built in the same
  process keeps vLLM's lm head.
* patch ``vllm_lmhead_fp32_tied`` wraps vLLM's ``BaseModelLoader.load_model``: a model with tied
  embeddings gets its head from the input embedding *after* the init patch ran (vLLM's Qwen2 uses
  ``embed_tokens`` itself as ``lm_head``; Llama, Qwen3 and most others call
  ``ParallelLMHead.tie_weights``, which puts the bf16 embedding weight into the fp32 head). Once the
  policy rollout's model is loaded (still inside the worker's load_model, so inside the "weights"
  pool of sleep mode), the shared weight is held in fp32 for both of its uses
  (:func:`upcast_lm_head`): the logits are computed from fp32 values, and the embedding's output is
  cast back to the model dtype, which is exactly the bf16 lookup of a bf16-representable weight
  (what FSDP's bf16 mixed precision sends). Memory: the shared weight grows from 2 to 4 bytes per
  element, ``2 * vocab * hidden / tp`` bytes more per rank (:func:`tied_head_extra_bytes`): the same
  as the fp32 head of an untied model of that size. Every weight sync writes the one fp32 storage
  (``copy_`` casts), so there is no second copy to keep in step.
* :func:`upcast_lm_head(model)` does the same on an already built/loaded model (and handles tied
  embeddings). Call it right after the model is loaded, before ACL graph capture and before the first
  ``sleep()``: it re-allocates the lm head storage (outside the sleep-mode pool when called later).

Weight reload keeps working: the Parameter object and its attributes (``weight_loader``,
``output_dim``) are kept, only ``param.data`` changes dtype; vLLM's ``VocabParallelEmbedding.weight_loader``
writes with ``param.data.copy_(loaded)``, which casts bf16 or fp32 sources into the fp32 storage.
"""
from __future__ import annotations

import os
from typing import Optional

import torch
import torch.nn.functional as F
from torch import nn

from npu_flashrl.config import lmhead_fp32_requested  # noqa: F401  (re-exported)
from npu_flashrl import lines, patches
from npu_flashrl._logging import get_logger
from npu_flashrl.marks import marked
from npu_flashrl.patches import PatchNotApplicable, register

logger = get_logger(__name__)

_VPE = "vllm.model_executor.layers.vocab_parallel_embedding"
_ASCEND_VPE = "vllm_ascend.ops.vocab_parallel_embedding"
PATCH_COMPUTE = "vllm_lmhead_fp32_compute"
PATCH_INIT = "vllm_lmhead_fp32_init"
PATCH_TIED = "vllm_lmhead_fp32_tied"
MARK = "_npu_flashrl_fp32_lm_head"
EMBED_MARK = "_npu_flashrl_embed_out_dtype"

__all__ = ["upcast_lm_head", "enable_lm_head_fp32", "lmhead_fp32_requested", "find_lm_head",
           "tied_head_extra_bytes", "PATCH_COMPUTE", "PATCH_INIT", "PATCH_TIED", "PATCHES"]
PATCHES = (PATCH_COMPUTE, PATCH_INIT, PATCH_TIED)


# ------------------------------------------------------------------------------------ helpers

def _upcast_param(module: nn.Module, name: str) -> bool:
    """``param.data`` -> fp32 in place of the same Parameter object (attributes kept). True if changed."""
    p = getattr(module, name, None)
    if not isinstance(p, torch.Tensor) or not p.is_floating_point() or p.dtype == torch.float32:
        return False
    p.data = p.data.to(torch.float32)
    return True


def _is_unquantized(layer: nn.Module) -> bool:
    from vllm.model_executor.layers.vocab_parallel_embedding import UnquantizedEmbeddingMethod

    return isinstance(getattr(layer, "quant_method", None), UnquantizedEmbeddingMethod)


def find_lm_head(model: nn.Module) -> Optional[nn.Module]:
    """The module whose weight produces the logits: ``model.lm_head``, else a ``*lm_head`` submodule."""
    head = getattr(model, "lm_head", None)
    if isinstance(head, nn.Module):
        return head
    for name, mod in model.named_modules():
        if name.split(".")[-1] == "lm_head":
            return mod
    return None


def _cast_output_hook(module: nn.Module, args, output):
    dtype = getattr(module, EMBED_MARK, None)
    if dtype is not None and isinstance(output, torch.Tensor) and output.dtype != dtype:
        return output.to(dtype)
    return output


# ------------------------------------------------------------------------------ public function

def upcast_lm_head(model: nn.Module, include_tied: bool = True) -> bool:
    """Hold ``model``'s lm head weight (and bias) in fp32; idempotent. Returns True when it is fp32.

    * Untied: only the lm head parameters are upcast; embeddings are untouched.
    * Tied (lm_head IS ``embed_tokens`` as in vLLM's Qwen2, or shares its weight): the shared weight is
      upcast when ``include_tied`` (else nothing changes and False is returned) and every embedding
      module using it gets a forward hook casting its output back to the model dtype.
    * A quantized lm head (quant method other than ``UnquantizedEmbeddingMethod``) is left alone
      (WARNING, returns False).

    Logits are then computed in fp32 by the ``vllm_lmhead_fp32_compute`` patch (applied here too).
    """
    from vllm.model_executor.layers.vocab_parallel_embedding import (ParallelLMHead,
                                                                     VocabParallelEmbedding)

    head = find_lm_head(model)
    if head is None:
        logger.warning("FP32 lm_head: no lm_head found in %s; unchanged", type(model).__name__)
        return False
    if not _is_unquantized(head):
        logger.warning("FP32 lm_head: lm_head of %s uses %s (quantized); unchanged", type(model).__name__,
                       type(getattr(head, "quant_method", None)).__name__)
        return False
    weight = head.weight
    tied_embeddings = [m for m in model.modules()
                       if isinstance(m, VocabParallelEmbedding) and not isinstance(m, ParallelLMHead)
                       and getattr(m, "weight", None) is weight]
    if tied_embeddings and not include_tied:
        logger.info("FP32 lm_head: %s has tied embeddings and include_tied=False; unchanged",
                    type(model).__name__)
        return False
    for emb in tied_embeddings:
        if getattr(emb, EMBED_MARK, None) is None:
            setattr(emb, EMBED_MARK, weight.dtype if weight.dtype != torch.float32
                    else getattr(emb, "params_dtype", None) or torch.get_default_dtype())
            emb.register_forward_hook(_cast_output_hook)
    changed = _upcast_param(head, "weight")
    changed |= _upcast_param(head, "bias")
    setattr(head, MARK, True)
    if changed:
        logger.info("FP32 lm_head: %s lm_head weight held in fp32%s", type(model).__name__,
                    " (tied with the input embedding; its output is cast back)" if tied_embeddings else "")
    apply_patch_ok = patches.apply_patch(PATCH_COMPUTE)
    return bool(apply_patch_ok)


def enable_lm_head_fp32() -> dict:
    """Apply the vLLM-side patches (compute, creation in fp32, tied heads after load). Idempotent."""
    return patches.apply_patches(list(PATCHES))


def tied_head_extra_bytes(hf_config, tp_size: int = 1) -> int:
    """Bytes per rank FLASHRL_LMHEAD_FP32 adds to a model's 16-bit weights: the lm head (the shared
    embedding weight when tied) grows from 2 to 4 bytes per element; vLLM shards it over the vocab
    by tensor parallelism (the vocab padded to a multiple of 64 rows). `hf_config`: the model's config (a mapping
    or an object; a VL model's `text_config` is read when present)."""
    get = hf_config.get if isinstance(hf_config, dict) else (lambda k, d=None: getattr(hf_config, k, d))
    text = get("text_config")
    if text:
        return tied_head_extra_bytes(text, tp_size)
    vocab, hidden = int(get("vocab_size")), int(get("hidden_size"))
    padded = -(-vocab // 64) * 64  # vLLM's DEFAULT_VOCAB_PADDING_SIZE, then split over tp
    rows = -(-padded // tp_size)
    return 2 * rows * hidden


# ---------------------------------------------------------------------------------- patches

def _fp32_logits(layer: nn.Module, x: torch.Tensor, bias: Optional[torch.Tensor]) -> torch.Tensor:
    w = layer.weight
    return F.linear(x.to(torch.float32), w if w.dtype == torch.float32 else w.to(torch.float32),
                    None if bias is None else bias.to(torch.float32))


def _make_apply(original):
    def apply(self, layer, x, bias=None):
        if not marked(layer, MARK):
            return original(self, layer, x, bias)  # not an fp32 lm head: vLLM's own
        return _fp32_logits(layer, x, bias)

    apply.__wrapped__ = original
    apply.__doc__ = "npu_flashrl: lm head logits in fp32 (FLASHRL_LMHEAD_FP32). " + (original.__doc__ or "")
    return apply


@register(PATCH_COMPUTE, f"{_VPE}:UnquantizedEmbeddingMethod.apply", lines.versions("vllm"),
          doc="lm head logits computed in fp32 (vLLM LogitsProcessor and vllm-ascend AscendLogitsProcessor)")
def _apply_compute() -> None:
    patches.replace(f"{_VPE}:UnquantizedEmbeddingMethod.apply", _make_apply)


def _policy_model_in_build() -> bool:
    """The model vLLM is building belongs to the policy rollout (its config, current while the
    model is built, carries npu_flashrl's engine choice). No current config (a head built
    outside vLLM's model construction): not the policy's."""
    from npu_flashrl.adapters.engine_choice import engine_choice

    config = lines.current().vllm_config_in_build()
    return config is not None and engine_choice(config) is not None


def _make_init(original):
    def __init__(self, *args, **kwargs):
        original(self, *args, **kwargs)
        if _is_unquantized(self) and _policy_model_in_build():
            _upcast_param(self, "weight")
            _upcast_param(self, "bias")
            setattr(self, MARK, True)

    __init__.__wrapped__ = original
    return __init__


def _make_load_model(original):
    def load_model(self, vllm_config, model_config, *args, **kwargs):
        model = original(self, vllm_config, model_config, *args, **kwargs)
        from npu_flashrl.adapters.engine_choice import engine_choice

        if engine_choice(vllm_config) is None:
            return model  # another engine (reward, teacher): vLLM's lm head
        head = find_lm_head(model)
        weight = getattr(head, "weight", None)
        if isinstance(weight, torch.Tensor) and weight.dtype != torch.float32 and _is_unquantized(head):
            # tied: the head is (or took the weight of) the 16-bit input embedding
            if not upcast_lm_head(model) or head.weight.dtype != torch.float32:
                raise RuntimeError(f"FLASHRL_LMHEAD_FP32: the lm head of {type(model).__name__} "
                                   f"stayed {head.weight.dtype}; refusing a rollout whose logits "
                                   "the trainer computes in fp32. Set FLASHRL_LMHEAD_FP32=0")
            logger.info("FLASHRL_LMHEAD_FP32: %s ties its lm head to the input embedding; the shared "
                        "weight is held in fp32 (+%.1f MiB on this rank)", type(model).__name__,
                        2 * head.weight.numel() / 2 ** 20)
        return model

    load_model.__wrapped__ = original
    return load_model


_LOADER = "vllm.model_executor.model_loader.base_loader:BaseModelLoader.load_model"


@register(PATCH_TIED, _LOADER, lines.versions("vllm"),
          doc="tied embeddings: the shared embedding / lm head weight held in fp32 once the policy model is loaded")
def _apply_tied() -> None:
    patches.replace(_LOADER, _make_load_model)


@register(PATCH_INIT, f"{_VPE}:ParallelLMHead.__init__", lines.versions("vllm", "vllm-ascend"),
          doc="lm head weight created in fp32 (ParallelLMHead and vllm-ascend AscendParallelLMHead)")
def _apply_init() -> None:
    patches.replace(f"{_VPE}:ParallelLMHead.__init__", _make_init)
    # vllm-ascend's head where this process imports it (never imported here: the patch may be
    # applied from the import hook of vLLM's module, which imports nothing)
    patches.when_imported(_ASCEND_VPE, _patch_ascend_head)


def _patch_ascend_head(module) -> None:
    if not hasattr(getattr(module, "AscendParallelLMHead", None), "__init__"):
        logger.warning("npu_flashrl: %s has no AscendParallelLMHead: its lm head stays 16-bit",
                       _ASCEND_VPE)
        return
    patches.replace(f"{_ASCEND_VPE}:AscendParallelLMHead.__init__", _make_init)
