"""FP32 lm-head on the Megatron trainer (``FLASHRL_LMHEAD_FP32=1``).

:func:`enable_fp32_output_layer` gives the GPT model's ``output_layer`` (a ``ColumnParallelLinear``) an
instance ``forward`` that calls the class forward with the input and weight upcast to fp32, so TP
communication, sequence parallel and MindSpeed's class-level patches still apply. Parameters keep their
dtype and identity (the distributed optimizer owns them); the gradient flows back through the cast. Per
call it turns off ``gradient_accumulation_fusion`` (that path writes ``weight.main_grad`` of the weight it
is given, which the transient fp32 copy lacks); the gradient then reaches ``param.grad`` and Megatron
DDP's hook adds it to ``main_grad``. Tied embeddings: the shared weight passed by ``GPTModel`` is upcast
the same way. The patch ``megatron_lmhead_fp32`` applies it to every ``GPTModel`` built afterwards.

Bypassed by verl's fused kernels: with ``actor_rollout_ref.model.use_fused_kernels=True``,
``MegatronPPOActor.__init__`` (the pinned sync-mode verl's ``verl/workers/actor/megatron_actor.py``) calls
``patch_fused_forward`` (``verl/models/mcore/model_forward_fused.py``), which replaces
``GPTModel.forward`` by one that feeds ``model.output_layer.weight`` straight into
``linear_cross_entropy``: ``output_layer.forward`` never runs. :func:`check_fused_kernels` refuses that
combination at worker start.
"""
from __future__ import annotations

import types

from npu_flashrl import patches
from npu_flashrl.adapters.megatron._common import PATCH_LMHEAD, logger, when_imported
from npu_flashrl.config import lmhead_fp32_requested
from npu_flashrl.errors import NpuFlashrlError
from npu_flashrl.marks import marked
from npu_flashrl.patches import register

MARK = "_npu_flashrl_fp32_output_layer"


class FusedKernelsConflict(NpuFlashrlError, ValueError):
    """FLASHRL_LMHEAD_FP32=1 together with verl's fused kernels, which bypass the output layer."""


def _get(node, *keys):
    for k in keys:
        if node is None:
            return None
        try:
            node = node.get(k) if hasattr(node, "get") else getattr(node, k, None)
        except Exception:  # noqa: BLE001 - an OmegaConf interpolation that cannot resolve here
            return None
    return node


def fused_kernels_keys(config) -> list:
    """Hydra keys (under ``actor_rollout_ref``) that turn on verl's fused forward: the actor's and the
    ref's ``use_fused_kernels`` (both default to ``model.use_fused_kernels``)."""
    found = []
    for keys in (("model", "use_fused_kernels"), ("actor", "use_fused_kernels"), ("ref", "use_fused_kernels")):
        value = _get(config, *keys)
        if value is True or str(value).lower() == "true":
            found.append("actor_rollout_ref." + ".".join(keys))
    return found


def check_fused_kernels(config, environ=None) -> None:
    """Refuse ``FLASHRL_LMHEAD_FP32=1`` with verl's ``use_fused_kernels=True`` (the FP32 output layer
    would silently not apply: verl's fused forward reads ``output_layer.weight`` directly)."""
    if not lmhead_fp32_requested(environ):
        return
    keys = fused_kernels_keys(config)
    if keys:
        raise FusedKernelsConflict(
            f"FLASHRL_LMHEAD_FP32=1 with {', '.join(k + '=True' for k in keys)}: verl's fused forward "
            "(verl/models/mcore/model_forward_fused.py) computes log-probs from output_layer.weight with "
            "linear_cross_entropy and bypasses npu_flashrl's FP32 output layer. Set "
            "actor_rollout_ref.model.use_fused_kernels=False, or FLASHRL_LMHEAD_FP32=0 to train with the "
            "bf16 lm-head.")


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
    return bool(head is not None and marked(head, MARK))


def enable_fp32_output_layer(model) -> bool:
    """Make a Megatron GPT model's ``output_layer`` compute logits in fp32 (idempotent).

    Returns False (logged) when there is nothing to do: no output layer on this PP stage, a value head
    that is not a ``ColumnParallelLinear``, a bias that is added inside the layer, or deferred embedding
    wgrad compute (it stores the input for a later bf16 GEMM)."""
    head = _output_layer(model)
    if head is None:
        logger.debug("FP32 output_layer: %s has none (not the last PP stage)", type(model).__name__)
        return False
    if marked(head, MARK):
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
    if head is None or not marked(head, MARK):
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
