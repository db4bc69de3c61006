"""vllm-ascend's W4A8_DYNAMIC fused-MoE scheme (`AscendW4A8DynamicFusedMoEMethod`, ModelSlim's
original per-group layout: `group_size` > 0, no `version` "1.0.0" in the description).

One layer's experts after vllm-ascend's post-processing (what a sync writes, in place):
`w13_weight` int32 [E, H, 2I / 8] and `w2_weight` int32 [E, I, H / 8] (the int4 values of the
transposed experts packed by `torch_npu.npu_quantize(dtype=quint4x2)`), `w13_weight_scale` int64
[E, H / group, 2I] and `w2_weight_scale` int64 [E, I / group, H] (both scale levels fused and
rounded through fp16, as fp32 bit patterns), `w13_scale_bias` fp32 [E, 2I] and `w2_scale_bias`
fp32 [E, H] (the A8W4 grouped matmul's auxiliary 8 * sum_k(w * scale)); the zero offsets stay.

A sync quantizes each expert projection on its full row with `kernels.int4`'s staged quantizer and
the layer's own group size (`W4A8Payload` of the linear scheme), stages the int4 values (int8),
`weight_scale` [out, 1] and `weight_scale_second` [out, in / group] (fp32, as the layer loads
them) through the FusedMoE layer's own `weight_loader` (expert map, TP narrowing, w1/w3 offsets
are upstream's), and once every local expert of the layer arrived, derives the processed tensors
with the layer's own scheme object (`process_scale`, `pack_to_int32`: the device's packing op
on an NPU, its emulation elsewhere; the NZ cast between them is the line's,
`StackLine.w4a8_moe_weight_cast`) and copies them into the tensors the layer
already holds. A refused or incomplete sync leaves the layer untouched (everything waits in the
staging). Not sent over the INT8 wire (`wire` None).

Per-channel (the description's `group_size` 0, ModelSlim's per-channel W4A8 MoE recipes): one
fp32 scale per output channel and no second level (`kernels.int4`'s per-channel rule); the
layer's processed `w13_weight_scale` / `w2_weight_scale` are the fp32 bit patterns in int64
([E, 2I] or [E, 1, 2I] as the line's post-processing leaves w13's; [E, 1, H]), NOT rounded through fp16,
and its scale_bias stays empty (vllm-ascend registers none); the staging skips the second level
and the commit copies what `process_scale` derives into the tensors the layer holds. The
entry's `group_size`, when set, must be the layer's (`check_target`).

Not claimed (refused by their shape at the first sync, as before this scheme): ModelSlim's
"1.0.0" packed layout and the compressed-tensors W4A8 MoE layout (each processes into other
tensors); dynamic EPLB and redundant experts are refused at
engine build as for W8A8 (`experts.refuse_unsupported`). Lines: those whose `w4a8_moe_cast` is set
(`npu_flashrl/lines/`); refused at engine build on the others, whose post-processing keeps another
processed layout.
"""
from __future__ import annotations

from typing import Dict, Sequence, Tuple

import torch

from npu_flashrl import lines
from npu_flashrl.adapters.vllm_ascend import experts as _experts
from npu_flashrl.adapters.vllm_ascend.schemes.base import MOE, UnsupportedScheme, inner_method, stage_param
from npu_flashrl.adapters.vllm_ascend.schemes.registry import register_scheme
from npu_flashrl.adapters.vllm_ascend.schemes.w4a8_dynamic import (
    CHECKPOINT, W4A8_DYNAMIC, checked_payload, description_group_size, w4a8_payload)
from npu_flashrl.adapters.vllm_ascend.schemes.w8a8_dynamic_moe import (
    ExpertTarget, FusedExpertStaging, W8A8DynamicMoE)
from npu_flashrl.quant import WeightSyncError

GATE_UP, DOWN = _experts.GATE_UP, _experts.DOWN
_GROUP = "group"  # vLLM's FusedMoeWeightScaleSupported.GROUP: how the loader shards weight_scale_second


class W4A8ExpertStaging(FusedExpertStaging):
    """One W4A8 fused-MoE layer's local experts of one sync, in the checkpoint layout the layer's
    `weight_loader` fills: int4 values int8 (views [E, 2I, H] / [E, H, I] of [E, H, 2I] / [E, I, H]
    memory, the processed order), `weight_scale` fp32 [E, out, 1], `weight_scale_second` fp32
    [E, out, in / group]. `received` holds HF names."""

    def __init__(self, target: ExpertTarget):
        super().__init__(target)
        layer = target.layer
        inner = inner_method(layer)
        self.group_size = int(inner.group_size)
        e = layer.w13_weight.shape[0]
        hidden, inter = int(layer.hidden_size), int(layer.intermediate_size_per_partition)
        dev = layer.w13_weight.device
        # processed (transposed) shapes: [E, K, N] with K the input of each projection
        kn = {GATE_UP: (hidden, 2 * inter), DOWN: (inter, hidden)}
        self._w, self._wp, self._s, self._s2 = {}, {}, {}, {}
        for which, (k, n) in kn.items():
            w = torch.empty((e, k, n), dtype=torch.int8, device=dev)
            self._w[which] = w
            self._wp[which] = stage_param(w.transpose(1, 2), getattr(layer, f"{which}_weight"))
            template = getattr(layer, f"{which}_weight_scale")
            self._s[which] = stage_param(torch.empty((e, n, 1), dtype=torch.float32, device=dev), template)
            if not self.group_size:  # per-channel: no second level (vllm-ascend creates none)
                continue
            s2 = stage_param(torch.empty((e, n, k // self.group_size), dtype=torch.float32, device=dev),
                             template)
            s2.quant_method = _GROUP  # as vllm-ascend's MoE adapter marks weight_scale_second
            self._s2[which] = s2

    def stage(self, name, payload) -> None:
        w = checked_payload(name, self.target.path, payload, "W4A8_DYNAMIC fused-MoE layer",
                            "float experts").quantized(self.group_size)
        which = self.target.names[name][2]
        loads = [(self._wp[which], w.q, ""), (self._s[which], w.scale.unsqueeze(1), "_scale")]
        if self.group_size:  # per-channel (0) has no second level
            loads.append((self._s2[which], w.scale_second, "_scale_second"))
        self.load_expert(name, which, tuple(loads))

    def buffers(self):
        return (tuple(self._w.values()) + tuple(p.data for p in self._s.values())
                + tuple(p.data for p in self._s2.values()))

    @torch.no_grad()
    def commit(self) -> None:
        layer = self.target.layer
        inner = inner_method(layer)
        line = lines.current()
        derived = {}
        for which in (GATE_UP, DOWN):  # everything first: a failure leaves the layer as it was
            w = self._w[which]
            second = self._s2[which].data if self.group_size else None  # None: per-channel
            scale, bias = inner.process_scale(w, self._s[which].data, second)
            derived[which] = (inner.pack_to_int32(line.w4a8_moe_weight_cast(w)), scale, bias)
        for which, (packed, scale, bias) in derived.items():
            getattr(layer, f"{which}_weight").data.copy_(packed)
            live = getattr(layer, f"{which}_weight_scale").data
            # per-channel, some lines squeeze w13's [E, 1, 2I] to [E, 2I]: the same values, the live shape
            live.copy_(scale.reshape(live.shape))
            if bias is not None:  # per-channel: no scale_bias (the layer's stays empty)
                getattr(layer, f"{which}_scale_bias").data.copy_(bias)


@register_scheme(W4A8_DYNAMIC, MOE)
class W4A8DynamicMoE(W8A8DynamicMoE):
    wire = None  # no pre-quantized form the trainer sends (an INT4 wire: docs/w4a8.md)
    checkpoint = CHECKPOINT
    needs_scales = True
    patch_name = "ascend_w4a8_dynamic_moe_process_once"
    process_once_why = ("W4A8_DYNAMIC fused-MoE post-processing (transpose, int4 pack, scale folding, "
                        "scale_bias) runs once per layer")

    def claims(self, inner, line) -> bool:
        # ModelSlim's original layout (per-group or per-channel) only: the "1.0.0" packed layout
        # and compressed-tensors' process into other tensors (module docstring)
        return (super().claims(inner, line) and not getattr(inner, "new_quant_version", False)
                and not getattr(inner, "quant_method", ""))

    def targets(self, model: torch.nn.Module, layers: Sequence[Tuple[str, torch.nn.Module]]):
        line = lines.current()
        if line.w4a8_moe_cast is None:
            raise UnsupportedScheme(
                f"{layers[0][0]}: vllm-ascend {line.vllm_ascend}'s W4A8_DYNAMIC fused-MoE "
                "post-processing keeps another processed layout (its fused scales in "
                "weight_scale_second), which npu_flashrl does not reload; use a line whose "
                "vllm-ascend it reloads for W4A8 MoE rollouts (docs/w4a8.md, Fused MoE)")
        return super().targets(model, layers)

    def check_target(self, target, quantizer) -> None:
        """The layer's group size (its description's `group_size`; 0: per-channel) must be the
        entry's when the entry sets one: a sync cannot change how the experts are grouped."""
        size = int(inner_method(target.layer).group_size)
        wanted = getattr(quantizer, "group_size", None)
        if wanted is not None and wanted != size:
            def form(g):
                return "0 (per-channel)" if g == 0 else str(g)
            raise WeightSyncError(
                f"{target.path}: a vllm-ascend W4A8_DYNAMIC fused-MoE layer built with group_size "
                f"{form(size)} (the checkpoint's quant description), and the FlashRL config entry "
                f"says group_size {form(wanted)}; a sync cannot change a layer's groups: drop the "
                f"key, or set it to {size}")

    def quantize(self, quantizer, name: str, tensor: torch.Tensor, transposed: bool = True):
        return w4a8_payload(quantizer, name, tensor, "W4A8_DYNAMIC fused-MoE expert")

    def checkpoint_items(self, name: str, payload):
        """A bf16 checkpoint's expert projection as ModelSlim's W4A8 checkpoint carries it."""
        w = payload.quantized(description_group_size())
        base = name[: -len("weight")]
        yield name, w.q
        yield base + "weight_scale", w.scale.unsqueeze(1)
        yield base + "weight_offset", torch.zeros_like(w.scale).unsqueeze(1)
        if w.scale_second is not None:  # None: per-channel (group_size 0)
            yield base + "weight_scale_second", w.scale_second
            yield base + "weight_offset_second", torch.zeros_like(w.scale_second)

    def checkpoint_defaults(self, name: str, tensor: torch.Tensor) -> Dict[str, torch.Tensor]:
        return {}  # a ModelSlim W4A8 checkpoint carries every tensor its layer loads

    def new_staging(self, target, with_scale: bool, in_place: bool = False) -> W4A8ExpertStaging:
        return W4A8ExpertStaging(target)  # always buffered: the commit derives from all local experts

    def commit_derived(self, layer) -> None:
        """Nothing beyond the commit: it derives every processed tensor itself."""
