"""Tensors vllm-ascend's W8A8 post-processing derives from the weight scale and bias, the same on
every supported line whose schemes compute them (on 0.23.0 its ModelSlim path): rewritten after an
in-place reload, which never reruns post-processing. `base.StackLine` uses them; a line overrides
what its schemes derive differently."""
from __future__ import annotations

import torch

from npu_flashrl import kernels
from npu_flashrl._logging import get_logger

logger = get_logger("lines.derived")


@torch.no_grad()
def commit_extras(layer) -> None:
    """After a new weight_scale was written: the copies vllm-ascend derives from it."""
    fp32 = getattr(layer, "weight_scale_fp32", None)
    if isinstance(fp32, torch.Tensor):
        # vllm-ascend derives it from the param-dtype scale; keep that relation.
        fp32.copy_(layer.weight_scale.data.to(torch.float32))
    layer.weight_offset.data.zero_()


@torch.no_grad()
def refresh_static(layer) -> None:
    """Static W8A8: deq_scale = input_scale * weight_scale, and the float bias folded into
    quant_bias (vllm-ascend adds quant_bias to the int32 accumulator and ignores `bias`)."""
    deq = (layer.input_scale.data.float() * layer.weight_scale.data.float()).flatten()
    if layer.deq_scale.dtype == torch.int64:
        deq_store = deq.view(torch.int32).to(torch.int64) & 0xFFFFFFFF
    else:
        deq_store = deq.to(layer.deq_scale.dtype)
    layer.deq_scale.data.copy_(deq_store)
    layer.quant_bias.data.copy_(static_quant_bias(layer, deq))


def static_quant_bias(layer, deq: torch.Tensor) -> torch.Tensor:
    """int32 bias for AscendW8A8LinearMethod: out = (x_q @ W_q + quant_bias) * deq_scale with
    x_q = round(x / input_scale + input_offset), so
    quant_bias = round(bias / deq_scale) - input_offset * sum_k W_q[:, k]."""
    w = layer.weight.data  # processed [in, out]
    wsum = w.to(torch.int64).sum(dim=0)
    offset = int(layer.input_offset.data.flatten()[0].item())
    bias = getattr(layer, "bias", None)
    fb = torch.zeros_like(deq) if bias is None else torch.round(bias.data.float() / deq)
    return (fb.to(torch.int64) - offset * wsum).to(torch.int32)


@torch.no_grad()
def fold_checkpoint_bias(layer) -> None:
    bias = getattr(layer, "bias", None)
    if bias is None or not bool(bias.data.abs().sum() > 0):
        return
    if bool(layer.quant_bias.data.abs().sum() > 0):
        return  # the exporter (ModelSlim) already folded the bias into quant_bias
    deq = kernels.reference.decode_deq_scale(layer.deq_scale.data).flatten()
    layer.quant_bias.data.copy_(static_quant_bias(layer, deq))
    logger.debug("npu_flashrl: folded float bias into quant_bias of %s",
                 getattr(layer, "prefix", type(layer).__name__))


@torch.no_grad()
def commit_moe_extras(layer) -> None:
    """After new expert scales were written: the fp32 copy the W8A8_DYNAMIC fused-MoE method
    derives from the param-dtype w13 scale (every line has it)."""
    fp32 = getattr(layer, "w13_weight_scale_fp32", None)
    if isinstance(fp32, torch.Tensor):
        fp32.copy_(layer.w13_weight_scale.data.to(torch.float32))
