"""The INT8 wire, trainer side: quantize projection weights before they are sent.

With `wire: int8` in the FlashRL config entry, the trainer sends each projection weight of the
decoder layers (attention q/k/v/o, MLP gate/up/down, and every MoE expert's gate/up/down) as
vllm-ascend's W8A8_DYNAMIC checkpoint tensors instead of the trainer's bf16/fp32:

    <prefix>.weight_scale  fp32 [out, 1]   (sent first; the receiver takes either order)
    <prefix>.weight        int8 [out, in]

computed by the same kernel, with the same compute dtype (the rollout model's), as the rollout's
own online quantizer (`int8_profile_free`: `kernels.quantize_weight_per_channel`, torch_npu's on an
NPU trainer), so the receiver commits them as they are and the INT8 state equals what rollout-side
quantization of the same weights gives, bit for bit. Everything else (norms, embeddings, lm_head,
the MoE router, biases) travels unchanged. No `weight_offset` is sent: it is zero for symmetric
INT8 and the receiver zeroes it.

A weight that is not finite is sent unquantized: the receiver then refuses it by name, exactly as
for the float wire, and the trainer never stops in the middle of a broadcast the rollout side is
waiting on.
"""
from __future__ import annotations

import re
from typing import Callable, Iterable, Iterator, Optional, Tuple

import torch

from npu_flashrl import kernels

WIRE_INT8 = "int8"
WIRE_FLOAT = "float"
WIRES = (WIRE_FLOAT, WIRE_INT8)
SCALE_SUFFIX = "weight_scale"
OFFSET_SUFFIX = "weight_offset"

# HF names of the linear layers the INT8 rollout quantizes (vllm-ascend W8A8 linear and fused-MoE
# methods): inside a decoder layer, attention and MLP projections, per-expert projections.
_PROJECTION = re.compile(
    r"(^|\.)layers\.\d+\.(self_attn|mlp|mlp\.experts\.\d+|mlp\.shared_expert)\."
    r"(q_proj|k_proj|v_proj|o_proj|gate_proj|up_proj|down_proj)\.weight$")


def is_projection(name: str) -> bool:
    return bool(_PROJECTION.search(name))


def scale_name(weight_name: str) -> str:
    return weight_name[: -len("weight")] + SCALE_SUFFIX


def quantize_for_wire(weight: torch.Tensor, compute_dtype: torch.dtype
                      ) -> Optional[Tuple[torch.Tensor, torch.Tensor]]:
    """(int8 [out, in], fp32 scale [out, 1]) or None for a weight that is not finite."""
    try:
        q, scale = kernels.quantize_weight_per_channel(weight, compute_dtype)
    except ValueError:
        if weight.dim() == 2 and not kernels.all_finite(weight):
            return None
        raise
    return q, scale.unsqueeze(1)


def int8_wire(weights: Iterable[Tuple[str, torch.Tensor]], compute_dtype: torch.dtype,
              projection: Callable[[str], bool] = is_projection,
              stats: Optional[dict] = None) -> Iterator[Tuple[str, torch.Tensor]]:
    """The trainer's (name, tensor) stream with every projection weight as int8 + scale.
    Lazy: one projection is quantized at a time, as the stream is consumed. `stats` (optional)
    gets the bytes in and out and the seconds spent quantizing."""
    import time

    for name, tensor in weights:
        if stats is not None:
            stats["bytes_in"] = stats.get("bytes_in", 0) + tensor.numel() * tensor.element_size()
        if projection(name) and tensor.dim() == 2 and tensor.is_floating_point():
            t0 = time.perf_counter()
            out = quantize_for_wire(tensor, compute_dtype)
            if stats is not None:
                stats["quantize_s"] = stats.get("quantize_s", 0.0) + time.perf_counter() - t0
            if out is not None:
                q, scale = out
                del tensor
                if stats is not None:
                    stats["bytes_out"] = stats.get("bytes_out", 0) + q.numel() + scale.numel() * 4
                # the scale first (the receiver pairs them in either order; a weight whose scale
                # never comes is named at the end of the sync)
                yield scale_name(name), scale
                yield name, q
                continue
        if stats is not None:
            stats["bytes_out"] = stats.get("bytes_out", 0) + tensor.numel() * tensor.element_size()
        yield name, tensor
