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

import dataclasses
from typing import Callable, Iterable, Iterator, Optional, Tuple

import torch

from npu_flashrl import kernels
from npu_flashrl.quant import projections

WIRE_INT8 = "int8"
WIRE_FLOAT = "float"
WIRES = (WIRE_FLOAT, WIRE_INT8)


@dataclasses.dataclass(frozen=True)
class WireFormat:
    """How a quantized projection travels and sits in a checkpoint: `<p>.weight` (int8 [out, in]
    here) with `<p>.<scale_suffix>` [out, 1] (one scale per output row); a `<p>.<offset_suffix>`
    is accepted when zero (symmetric). A scheme names its format (`Scheme.wire`); the sender, the
    receiver and the cold load read the tensor names from it."""
    name: str
    scale_suffix: str = "weight_scale"
    offset_suffix: str = "weight_offset"

    @staticmethod
    def _prefix(weight_name: str) -> str:
        return weight_name[: -len("weight")]

    def scale_name(self, weight_name: str) -> str:
        return self._prefix(weight_name) + self.scale_suffix

    def offset_name(self, weight_name: str) -> str:
        return self._prefix(weight_name) + self.offset_suffix

    def weight_of(self, name: str) -> Optional[str]:
        """The projection weight `name` is the scale or offset of (None: neither)."""
        for suffix in (self.scale_suffix, self.offset_suffix):
            if name.endswith("." + suffix):
                return name[: -len(suffix)] + "weight"
        return None

    def is_offset(self, name: str) -> bool:
        return name.endswith("." + self.offset_suffix)

    def header_problem(self, weight_name: str, header: Callable[[str], Optional[Tuple[str, tuple]]]
                       ) -> Optional[str]:
        """Why one projection's checkpoint tensors do not fit this format (None: they do), read from
        the safetensors headers only: `header(name)` gives (safetensors dtype string, shape), None
        for a tensor the checkpoint lacks. The weight is int8 (I8) [out, in]; its scale (and an
        offset, when present) one value per output row: [out] or [out, 1]."""
        got = header(weight_name)
        if got is None:
            return f"{weight_name} is not in the checkpoint"
        dtype, shape = got
        if dtype != "I8":
            return f"{weight_name} is {dtype}, expected int8 (I8)"
        if len(shape) != 2:
            return f"{weight_name} has shape {list(shape)}, expected 2-D [out, in]"
        rows = (shape[0],), (shape[0], 1)
        for name in (self.scale_name(weight_name), self.offset_name(weight_name)):
            part = header(name)
            if part is None:
                if name == self.scale_name(weight_name):
                    return f"{name} is missing (int8 {weight_name} without its scale)"
                continue
            if tuple(part[1]) not in rows:
                return (f"{name} has shape {list(part[1])}, expected [{shape[0]}] or [{shape[0]}, 1] "
                        f"(one value per output row of {weight_name} {list(shape)})")
        return None


# vllm-ascend's W8A8 checkpoint tensors: int8 weight, one fp32 scale per output channel
PER_CHANNEL_INT8 = WireFormat("per-channel int8")
SCALE_SUFFIX = PER_CHANNEL_INT8.scale_suffix
OFFSET_SUFFIX = PER_CHANNEL_INT8.offset_suffix

# HF names of the projections the INT8 rollout quantizes: the one rule (`quant.projections`)
is_projection = projections.is_projection


def scale_name(weight_name: str) -> str:
    return PER_CHANNEL_INT8.scale_name(weight_name)


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
