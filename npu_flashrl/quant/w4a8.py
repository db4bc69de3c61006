"""Profile-free W4A8_DYNAMIC: fresh scales of both levels at every sync, in `kernels.int4`'s
staged ModelSlim format (per-channel int8, then int4 per group of input channels).

The entry's quantizer carries what the rollout's W4A8 layers need of it (the compute dtype, the
entry's `group_size`); the int4 quantization itself belongs to their scheme
(`adapters/vllm_ascend/schemes/w4a8_dynamic.py`), which quantizes each projection for the group
size its layer was built with. It serves vllm-ascend's W4A8_DYNAMIC layers (`serves`) and, in a
ModelSlim mixed checkpoint (ModelSlim's W4A8 MoE recipes: attention and dense projections
W8A8_DYNAMIC, routed experts W4A8_DYNAMIC), the W8A8_DYNAMIC layers its description types so
(`also_serves`), each by its own scheme: those quantized by the profile-free INT8 rule
(`kernels.quantize_weight_per_channel`, what `int8_profile_free` writes). The loader refuses a
model with other quantized layers (static W8A8, ...) when the engine builds, and the W8A8
quantizers do not serve W4A8 layers. A bare bf16 checkpoint's in-memory description types every
projection W4A8_DYNAMIC (no mixed layout without a ModelSlim description).

`group_size` (the config entry's key): the number of consecutive input channels that share a
second-level scale; 0 is per-channel (one scale per output channel, no second level), which
vllm-ascend runs for fused-MoE experts only: a ModelSlim checkpoint of W4A8 experts and FLOAT
other projections, description `group_size: 0` (a bare bf16 checkpoint is refused, its in-memory
description types every projection W4A8_DYNAMIC). None keeps the checkpoint's (a ModelSlim W4A8 description's `group_size`,
vllm-ascend's default 256 when it has none); a bare bf16 checkpoint's in-memory description gets
it (`description_keys`), so its layers are built with it.
"""
from __future__ import annotations

from typing import Dict, List, Mapping, Optional, Sequence

from npu_flashrl import kernels
from npu_flashrl.kernels.int4 import DEFAULT_GROUP_SIZE
from npu_flashrl.quant import projections
from npu_flashrl.quant.base import OnlineQuantizer, WeightSyncError
from npu_flashrl.quant.registry import register_quantizer

W4A8_DYNAMIC = "W4A8_DYNAMIC"
# what a ModelSlim W4A8 MoE checkpoint types its attention / dense projections (and, in some
# recipes, a layer's experts): the W4A8 fn serves them with INT8 (`W4A8Quantizer.also_serves`)
W8A8_DYNAMIC = "W8A8_DYNAMIC"
PER_CHANNEL = 0  # `group_size: 0`: per-channel int4, vllm-ascend's W4A8 fused-MoE method's mode
# why group_size 0 (per-channel) serves fused-MoE experts only: the linear method sizes its
# second-level scales by it on every line that has the method
PER_CHANNEL_REFUSED = ("vllm-ascend's W4A8_DYNAMIC linear method (AscendW4A8DynamicLinearMethod) "
                       "creates weight_scale_second as [out, in // group_size], so group_size 0 "
                       "(per-channel) divides by zero there; only its fused-MoE method has a "
                       "per-channel mode")


def group_size_problem(value, where: str = "group_size") -> Optional[str]:
    """Why `value` cannot be a W4A8 group size (None: it can; 0 is per-channel, for a checkpoint
    whose W4A8_DYNAMIC layers are all fused-MoE experts)."""
    if isinstance(value, bool) or not isinstance(value, int):
        return f"{where}: expected a positive integer (input channels per scale group) or 0 " \
               f"(per-channel, W4A8 fused-MoE experts only); got {value!r}"
    if value < 0:
        return f"{where} = {value}: expected a positive integer (input channels per scale group) " \
               "or 0 (per-channel, W4A8 fused-MoE experts only)"
    return None


def bf16_per_channel_problem(where: str = "group_size") -> str:
    """Why a bare bf16 checkpoint cannot be loaded per-channel."""
    return (f"{where} = 0 (per-channel) needs a ModelSlim W4A8 checkpoint whose W4A8_DYNAMIC "
            "layers are all fused-MoE experts (its description's group_size 0, its other "
            "projections FLOAT): a bare bf16 checkpoint's in-memory description types every "
            f"projection W4A8_DYNAMIC, and {PER_CHANNEL_REFUSED}; use a positive group size "
            f"(default {DEFAULT_GROUP_SIZE}) for a bf16 checkpoint")


def in_dim_problems(shapes: Mapping[str, Sequence[int]], group_size: int,
                    where: str = "") -> List[str]:
    """One line per projection of `shapes` (HF name -> [out, in]) whose input dim `group_size`
    does not divide (vllm-ascend's weight_scale_second has in // group_size columns: a remainder
    would leave input channels without a scale)."""
    out = []
    if group_size == PER_CHANNEL:
        return out  # per-channel: no groups to fit
    prefix = f"{where}: " if where else ""
    for name, shape in sorted(shapes.items()):
        if not projections.is_projection(name) or len(shape) != 2:
            continue
        if shape[1] % group_size:
            out.append(f"{prefix}{name[: -len('.weight')]}: input dim {shape[1]} is not a multiple of "
                       f"group_size {group_size} (W4A8 groups input channels; pick a group size "
                       f"that divides every projection's input dim)")
    return out


@register_quantizer("w4a8_profile_free")
class W4A8Quantizer(OnlineQuantizer):
    """Profile-free W4A8_DYNAMIC (int4 weights in groups, two scale levels)."""

    serves = (W4A8_DYNAMIC,)
    # served beside its own type only where a ModelSlim description types layers so (mixed
    # W4A8 MoE checkpoints); `quantize` is their per-channel INT8
    also_serves = (W8A8_DYNAMIC,)
    description_type = W4A8_DYNAMIC
    default_group_size = DEFAULT_GROUP_SIZE

    def __init__(self, compute_dtype=None, group_size: Optional[int] = None):
        import torch

        super().__init__(compute_dtype if compute_dtype is not None else torch.bfloat16)
        if group_size is not None:
            problem = group_size_problem(group_size, f"fn {self.name}: group_size")
            if problem:
                raise ValueError(problem)
        # None: the layers' own (the checkpoint's description); else every W4A8 layer must have it
        self.group_size = group_size

    @classmethod
    def description_keys(cls, group_size: Optional[int] = None) -> Dict[str, int]:
        if group_size == PER_CHANNEL:
            raise WeightSyncError(bf16_per_channel_problem(f"fn {cls.name}: group_size"))
        return {"group_size": DEFAULT_GROUP_SIZE if group_size is None else group_size}

    def check_model(self, shapes, source: str) -> None:
        if self.group_size is None:
            return  # the layers' own group size, checked per layer by their scheme
        problems = in_dim_problems(shapes, self.group_size, source)
        if problems:
            more = f" (+{len(problems) - 1} more)" if len(problems) > 1 else ""
            raise WeightSyncError(problems[0] + more)

    def quantize(self, name, weight, transposed=False, finite=None):
        """A W8A8_DYNAMIC layer's projection in a mixed checkpoint (`also_serves`): symmetric
        per-channel INT8 with fresh scales, as `int8_profile_free` quantizes it. The W4A8 layers
        never call this (their scheme quantizes for its own group size)."""
        return kernels.quantize_weight_per_channel(weight, self.compute_dtype, transposed=transposed,
                                                   finite=finite)
