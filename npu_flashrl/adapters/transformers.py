"""Trainer side of FLASHRL_LMHEAD_FP32: HF transformers models (as used by verl's FSDP workers).

``enable_fp32_lm_head(model)`` makes the output embedding (``model.get_output_embeddings()``, the
``lm_head`` Linear) compute its logits in fp32: ``F.linear(h.float(), W.float(), b.float())`` under
disabled autocast. What it does NOT do, on purpose:

* It never changes the parameter's dtype or identity. FSDP owns the parameter (sharded flat params /
  DTensors, optimizer state keyed by them, mixed-precision casts); replacing or re-typing it behind
  FSDP's back breaks sharding, checkpoints and the optimizer. The fp32 weight is a transient
  ``weight.float()`` made inside forward; autograd casts the gradient back to the parameter's dtype.
* Under FSDP mixed precision (verl default: param_dtype bf16) the unsharded weight seen in forward is
  already bf16-rounded, so the fp32 compute uses the bf16 *values* upcast exactly (the fp32 master
  stays sharded in the optimizer). The gain is the fp32 matmul accumulation and fp32 logits (no bf16
  rounding of the logits themselves). With param_dtype fp32 the full fp32 weight is used.
* It is an instance-level ``forward`` override on the lm_head module, so it survives
  ``from_pretrained`` weight loading, ``load_state_dict`` and FSDP1/FSDP2 wrapping (FSDP2 swaps the
  module's class, not its instance ``forward``; FSDP1 keeps the module). Apply it before or after
  wrapping; it is idempotent and :func:`disable_fp32_lm_head` undoes it.
* Tied embeddings: only the logits computation changes; the input embedding is untouched.
* verl's ``use_fused_kernels=True`` replaces the model forward with a fused linear+log-prob kernel that
  never calls ``lm_head``; this switch then has no effect (a WARNING is logged when that forward is
  detected). Memory: the logits tensor is fp32 (2x a bf16 one); verl upcasts logits for log-probs
  anyway.

The registered patch ``transformers_lmhead_fp32`` (wrapping ``PreTrainedModel.post_init``) applies this
to every model built afterwards, e.g. inside verl's FSDP workers when ``FLASHRL_LMHEAD_FP32=1``.
"""
from __future__ import annotations

import os
import types
from typing import Optional

import torch
import torch.nn.functional as F
from torch import nn

from npu_flashrl.config import lmhead_fp32_requested  # noqa: F401  (re-exported)
from npu_flashrl import patches
from npu_flashrl._logging import get_logger
from npu_flashrl.marks import marked
from npu_flashrl.patches import register

logger = get_logger(__name__)

MARK = "_npu_flashrl_fp32_lm_head"
PATCH_NAME = "transformers_lmhead_fp32"

__all__ = ["enable_fp32_lm_head", "disable_fp32_lm_head", "is_fp32_lm_head", "lmhead_fp32_requested",
           "PATCH_NAME"]


def _fp32_linear_forward(self: nn.Linear, input: torch.Tensor) -> torch.Tensor:
    weight = self.weight
    bias = getattr(self, "bias", None)
    device_type = input.device.type if input.device.type in ("cpu", "cuda", "npu", "xpu") else "cpu"
    try:
        autocast_off = torch.autocast(device_type=device_type, enabled=False)
    except RuntimeError:  # a device type without autocast support
        autocast_off = None
    if autocast_off is None:
        return F.linear(input.float(), weight.float(), None if bias is None else bias.float())
    with autocast_off:
        return F.linear(input.float(), weight.float(), None if bias is None else bias.float())


def _output_embeddings(model: nn.Module) -> Optional[nn.Module]:
    get = getattr(model, "get_output_embeddings", None)
    head = get() if callable(get) else None
    if head is None:
        head = getattr(model, "lm_head", None)
    return head


def is_fp32_lm_head(model: nn.Module) -> bool:
    head = _output_embeddings(model)
    return bool(head is not None and marked(head, MARK))


def enable_fp32_lm_head(model: nn.Module) -> bool:
    """Make ``model``'s lm_head compute logits in fp32 (idempotent). Returns True when it is enabled.

    Returns False (with a WARNING) when the model has no ``nn.Linear``-like output embedding.
    """
    head = _output_embeddings(model)
    if head is None or not isinstance(getattr(head, "weight", None), torch.Tensor):
        logger.warning("FP32 lm_head: %s has no output embedding with a weight; unchanged", type(model).__name__)
        return False
    if marked(head, MARK):
        return True
    if not isinstance(head, nn.Linear):
        logger.warning("FP32 lm_head: output embedding of %s is %s, not nn.Linear; unchanged",
                       type(model).__name__, type(head).__name__)
        return False
    fwd = getattr(type(model), "forward", None)
    if fwd is not None and "verl" in (getattr(fwd, "__module__", "") or ""):
        logger.warning("FP32 lm_head: %s.forward is verl's (%s); with use_fused_kernels the lm_head module "
                       "is bypassed and this switch has no effect", type(model).__name__, fwd.__module__)
    head.forward = types.MethodType(_fp32_linear_forward, head)
    setattr(head, MARK, True)
    logger.debug("FP32 lm_head enabled on %s (param dtype %s kept)", type(model).__name__, head.weight.dtype)
    return True


def disable_fp32_lm_head(model: nn.Module) -> bool:
    """Undo :func:`enable_fp32_lm_head`. Returns True when something was undone."""
    head = _output_embeddings(model)
    if head is None or not marked(head, MARK):
        return False
    head.__dict__.pop("forward", None)
    delattr(head, MARK)
    return True


def _make_post_init(original):
    def post_init(self, *args, **kwargs):
        out = original(self, *args, **kwargs)
        try:
            if _output_embeddings(self) is not None:
                enable_fp32_lm_head(self)
        except Exception as exc:  # noqa: BLE001 - never break model construction
            logger.warning("FP32 lm_head not enabled on %s: %s", type(self).__name__, exc)
        return out

    post_init.__wrapped__ = original
    return post_init


@register(PATCH_NAME, "transformers.modeling_utils:PreTrainedModel.post_init", "transformers >= 4.40",
          doc="FLASHRL_LMHEAD_FP32 trainer side: every HF model built afterwards computes logits in fp32")
def _apply() -> None:
    patches.replace("transformers.modeling_utils:PreTrainedModel.post_init", _make_post_init)
