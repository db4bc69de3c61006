"""vllm-ascend's W4A8_DYNAMIC linear scheme (`AscendW4A8DynamicLinearMethod`, ModelSlim's
original layout): int4 weights in groups of `group_size` input channels with two scale levels,
activations left in the model dtype on the linear path (its `apply` is
`npu_weight_quant_batchmatmul` with `antiquant_group_size`).

What a sync writes, in place, is exactly what the layer holds after vllm-ascend's
`process_weights_after_loading` of a fresh load of the same weights:

- every incoming float projection is quantized on its FULL row by `kernels.int4` (the staged
  ModelSlim format: per-channel int8 then per-group int4), in its layer's staging with the
  layer's own group size (its quant description's), so a row-parallel shard gets the row's
  first-level scale as a checkpoint would carry it;
- the int4 values, `weight_scale` [out, 1] and `weight_scale_second` [out, in / group] are staged
  through the layer's own `weight_loader` (TP narrowing, fused q/k/v and gate/up offsets are
  upstream's) into buffers of the checkpoint dtypes the layer loads into (the scales in the model
  dtype, as a fresh load rounds them);
- the commit packs the int4 values of the processed [in, out] layout into the live int32 weight
  [in, out / 8] (`npu_convert_weight_to_int4pack`: the device op on an NPU, its emulation
  elsewhere), and derives the fp32 `weight_scale`, the antiquant `weight_scale_second`
  [in / group, out] and `weight_scale_bias` with vllm-ascend's own `process_scale_second`, each
  copied into the tensor the layer already holds (addresses unchanged). The zero offsets stay.

A refused sync leaves the layer untouched (everything waits in the staging until the layer is
complete). Not sent over the INT8 wire (`wire` None): an int8 [out, in] pair is not this format.
"""
from __future__ import annotations

import dataclasses
from typing import Optional

import torch

from npu_flashrl.adapters.vllm_ascend.schemes.base import LINEAR, WireFormat, stage_param
from npu_flashrl.adapters.vllm_ascend.schemes.linear import LinearScheme, LinearShardStaging, LinearTarget
from npu_flashrl.adapters.vllm_ascend.schemes.registry import register_scheme
from npu_flashrl.kernels import int4
from npu_flashrl.lines.base import POLICY_ATTR
from npu_flashrl.marks import marked
from npu_flashrl.quant import WeightSyncError

W4A8_DYNAMIC = "W4A8_DYNAMIC"  # vllm-ascend's quant type: its description's value for these layers
# what its (ModelSlim) checkpoint carries beside each weight: the first-level scale and offset;
# `weight_scale_second` / `weight_offset_second` follow (`W4A8DynamicLinear.checkpoint_items`)
CHECKPOINT = WireFormat("ModelSlim W4A8_DYNAMIC")


@dataclasses.dataclass
class W4A8Payload:
    """What one float projection becomes: its W4A8 quantization for the group size of the layer
    it goes to. A sync's staging (which knows the layer) quantizes it there and then, so the
    float tensor is held for that one call only; the cold load quantizes with the model's
    description's group size (`W4A8DynamicLinear.checkpoint_items`)."""
    name: str
    weight: torch.Tensor  # the float projection [out, in] as the trainer sent it
    compute_dtype: Optional[torch.dtype]
    with_scale = True  # both scale levels are fresh

    def quantized(self, group_size: int) -> int4.W4A8Weight:
        try:
            return int4.quantize_weight_w4a8(self.weight, group_size, self.compute_dtype)
        except ValueError as exc:
            raise WeightSyncError(f"{self.name}: {exc}; refusing the sync") from None


def w4a8_payload(quantizer, name: str, tensor: torch.Tensor, what: str) -> W4A8Payload:
    """A W4A8 scheme's `quantize`: `tensor` waits as a W4A8Payload (quantized per layer at
    staging); a quantizer that does not serve W4A8_DYNAMIC is refused, naming `what` it is."""
    if W4A8_DYNAMIC not in (getattr(quantizer, "serves", None) or ()):
        raise WeightSyncError(f"{name}: a vllm-ascend {what}; fn {quantizer.name!r} "
                              "does not quantize for it (use fn 'w4a8_profile_free')")
    return W4A8Payload(name, tensor, quantizer.compute_dtype)


def checked_payload(name: str, path: str, payload, what: str, takes: str) -> W4A8Payload:
    """`payload` if a W4A8 staging can take it (a W4A8Payload); refused otherwise, naming the
    layer at `path`, `what` it is and what it `takes`."""
    if not isinstance(payload, W4A8Payload):
        raise WeightSyncError(f"{name}: {path} is a vllm-ascend {what}; it takes {takes} quantized "
                              "by its scheme (the INT8 wire's per-channel int8 is not its format)")
    return payload


def group_size_of(layer) -> int:
    """The group size the layer was built with (its scheme object's, from the description)."""
    inner = getattr(getattr(layer, "quant_method", None), "quant_method", None)
    return int(getattr(inner, "group_size", int4.DEFAULT_GROUP_SIZE))


def description_group_size() -> int:
    """The group size of the model being built (vllm-ascend's W4A8 method reads the same key of
    the current config's quant description)."""
    from vllm.config import get_current_vllm_config

    desc = getattr(get_current_vllm_config().quant_config, "quant_description", None) or {}
    return int(desc.get("group_size", int4.DEFAULT_GROUP_SIZE))


def _params_dtype(layer) -> torch.dtype:
    # weight_offset keeps the dtype the layer created its per-group tensors with (post-processing
    # only flattens it); weight_scale itself is fp32 once processed
    return layer.weight_offset.dtype


class W4A8Staging(LinearShardStaging):
    """A (fused) W4A8 linear layer's shards of one sync, in the checkpoint layout the layer's
    `weight_loader` fills: int4 values int8 [out, in_part], `weight_scale` [out, 1] and
    `weight_scale_second` [out, in_part / group] in the model dtype."""

    def __init__(self, target: LinearTarget):
        super().__init__(target)
        layer = target.layer
        dev = layer.weight.device
        k = layer.weight.shape[0]  # processed: int32 [in_part, out_part / 8]
        n = layer.weight_scale.shape[0]  # processed: fp32 [out_part]
        groups = layer.weight_scale_second.shape[0]  # processed: [in_part / group, out_part]
        dt = _params_dtype(layer)
        # [out, in] views of [in, out] memory: the commit packs the processed layout directly
        self.q = stage_param(torch.empty((k, n), dtype=torch.int8, device=dev).t(), layer.weight)
        self.scale = stage_param(torch.empty((n, 1), dtype=dt, device=dev), layer.weight_scale)
        self.scale_second = stage_param(torch.empty((n, groups), dtype=dt, device=dev),
                                        layer.weight_scale_second)

    def stage(self, name, payload) -> None:
        """`payload`: the W4A8Payload of one projection, quantized here for this layer."""
        t = self.target
        w = checked_payload(name, t.path, payload, "W4A8_DYNAMIC layer", "float weights"
                            ).quantized(group_size_of(t.layer))
        self.load_shard(name, (self.q, w.q), (self.scale, w.scale.unsqueeze(1)),
                        (self.scale_second, w.scale_second))

    def buffers(self):
        return self.q.data, self.scale.data, self.scale_second.data

    @torch.no_grad()
    def commit(self) -> None:
        layer = self.target.layer
        q_in_out = self.q.data.t()  # contiguous [in, out]: the processed layout
        packed = int4.convert_weight_to_int4pack(q_in_out.to(torch.int32))
        scale = self.scale.data.flatten().to(torch.float32)
        method = type(layer.quant_method.quant_method)  # vllm-ascend's own scale folding
        antiquant, bias = method.process_scale_second(  # (its default: the original layout)
            q_in_out, scale, self.scale_second.data.transpose(0, 1).contiguous())
        layer.weight.data.copy_(packed)
        layer.weight_scale.data.copy_(scale)
        layer.weight_scale_second.data.copy_(antiquant)
        derived_bias = getattr(layer, "weight_scale_bias", None)
        if derived_bias is not None and bias is not None:
            derived_bias.data.copy_(bias)


@register_scheme(W4A8_DYNAMIC, LINEAR)
class W4A8DynamicLinear(LinearScheme):
    wire = None  # no pre-quantized form the trainer sends (an INT4 wire: docs/w4a8.md)
    checkpoint = CHECKPOINT
    needs_scales = True
    patch_name = "ascend_w4a8_dynamic_linear_process_once"
    process_once_why = "W4A8_DYNAMIC post-processing (transpose, int4 pack, scale folding) runs once per layer"

    def method_patches(self, line) -> list:
        if not line.W4A8_LINEAR_DROPS_BIAS:
            return []
        return [line.scheme_method_patch(
            "ascend_w4a8_dynamic_linear_bias", W4A8_DYNAMIC, LINEAR, "apply", _with_bias,
            "vllm-ascend's W4A8_DYNAMIC linear apply drops the bias vLLM hands it (vllm-ascend PR "
            "#11371, open): a policy rollout's layer adds it (Qwen2 / Qwen2.5's q/k/v)")]

    def claims(self, inner, line) -> bool:
        # ModelSlim's newer layout (`new_quant_version`: int4 pairs packed in its int8, a
        # precomputed scale_bias) runs the same class with another processed layout: not this
        # scheme's (refused at engine build as a scheme npu_flashrl cannot reload)
        return super().claims(inner, line) and not getattr(inner, "new_quant_version", False)

    def check_target(self, target, quantizer) -> None:
        """The layer's group size (its description's) must be the entry's `group_size` when the
        entry sets one, and must divide the layer's input dim on this rank (vllm-ascend built
        `weight_scale_second` with in // group_size columns: a remainder has no scale)."""
        layer, size = target.layer, group_size_of(target.layer)
        wanted = getattr(quantizer, "group_size", None)
        if wanted is not None and wanted != size:
            raise WeightSyncError(
                f"{target.path}: a vllm-ascend W4A8_DYNAMIC layer built with group_size {size} (the "
                f"checkpoint's quant description), and the FlashRL config entry says group_size "
                f"{wanted}; a sync cannot change a layer's groups: drop the key, or set it to {size}")
        in_full = int(layer.input_size)
        in_part = int(getattr(layer, "input_size_per_partition", in_full))
        if in_part % size or in_full % size:
            part = f" ({in_part} on this tensor-parallel rank)" if in_part != in_full else ""
            raise WeightSyncError(
                f"{target.path}: input dim {in_full}{part} is not a multiple of group_size {size}: "
                "vllm-ascend's W4A8_DYNAMIC layer has in // group_size scale groups, so its last "
                "input channels would have no scale; pick a group_size that divides it")

    def quantize(self, quantizer, name: str, tensor: torch.Tensor, transposed: bool = True):
        return w4a8_payload(quantizer, name, tensor, "W4A8_DYNAMIC layer")

    def checkpoint_items(self, name: str, payload):
        """A bf16 checkpoint's projection as ModelSlim's W4A8 checkpoint carries it, for the
        model's description's group size."""
        w = payload.quantized(description_group_size())
        yield name, w.q
        yield self.checkpoint.scale_name(name), w.scale.unsqueeze(1)
        yield self.checkpoint.offset_name(name), torch.zeros_like(w.scale).unsqueeze(1)
        base = name[: -len("weight")]
        yield base + "weight_scale_second", w.scale_second
        yield base + "weight_offset_second", torch.zeros_like(w.scale_second)

    def checkpoint_defaults(self, name: str, tensor: torch.Tensor):
        return {}  # a ModelSlim W4A8 checkpoint carries every tensor its layer loads

    def new_staging(self, target, with_scale: bool, in_place: bool = False) -> W4A8Staging:
        return W4A8Staging(target)

    def commit_derived(self, layer) -> None:
        """Nothing beyond the commit: it derives every processed tensor itself."""


def _with_bias(original):
    """`original` (AscendW4A8DynamicLinearMethod.apply, which calls npu_weight_quant_batchmatmul
    without the bias) followed by the bias vLLM's layer handed it, on the policy rollout's layers
    only (other models keep upstream's behaviour). vLLM passes the bias on the rank that owns it
    (a row-parallel layer: rank 0), so adding it where given is the layer's own contract."""
    def apply(scheme, layer, x, bias=None, tp_rank=None):
        out = original(scheme, layer, x, bias, tp_rank)
        if bias is None or not marked(layer, POLICY_ATTR):
            return out
        return out + bias.to(out.dtype)
    return apply

