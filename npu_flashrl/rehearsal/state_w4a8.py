"""The W4A8 state of the rollout model after every weight sync: each vllm-ascend W4A8_DYNAMIC
linear layer against a fresh W4A8 load of the weights that were pushed, and its output error.

The fresh load is computed here, independently of the scheme's staging: `kernels.int4`'s staged
quantizer applied on the CPU to each pushed bf16 shard with the layer's group size (its quant
description's), the shards concatenated in fused order, the scales rounded to the model dtype the
layer's parameters load into (as a fresh load of a ModelSlim checkpoint rounds them), then what
vllm-ascend's `process_weights_after_loading` makes of that checkpoint: the weight transposed to
[in, out] and packed to int32 [in, out / 8] (`kernels.int4.pack_int4`, the emulation's nibble
order), the fp32 `weight_scale`, and the antiquant `weight_scale_second` [in / group, out] and
`weight_scale_bias` from the method class's own `process_scale_second` (upstream's derivation,
called on the reference values). After each sync, per layer (the categories of `state.py`):

* **int4 values** (category "int8": the quantized values): the live packed weight equal to the
  reference packing, word for word; the count reported is of int4 values (unpacked) that differ;
* **scales**: `weight_scale` and `weight_scale_second` equal to the reference, bit for bit;
* **derived**: `weight_scale_bias` equal to the reference; `weight_offset` and
  `weight_offset_second` zero (symmetric);
* **in place**: the data pointer of every one of these tensors and the weight's storage format
  unchanged since the cold load;
* **output error**: the layer's own forward (`npu_weight_quant_batchmatmul`, emulated on the CPU)
  on fixed random activations against x @ W^T + b in fp32 from the pushed bf16 weights;
* **forward** (W4A8 only): the same forward against the W4A8 forward of the reference weights,
  x @ dequantized(W)^T + b in fp32, within `FORWARD_TOL`. It catches what the output error's
  looser bound lets through. vllm-ascend's `AscendW4A8DynamicLinearMethod.apply` does not pass
  the layer's bias to `npu_weight_quant_batchmatmul` (on every line npu_flashrl supports; the fix
  is vllm-ascend PR #11371, open); npu_flashrl's patch `ascend_w4a8_dynamic_linear_bias` adds it
  on the policy rollout, and a layer whose bias is still missing (the patch not applied) fails
  here, by name.

On the CPU the sync runs the same math, so everything is equal. With --device npu (NOT VERIFIED ON
HARDWARE): the live weight is packed by the device's `npu_convert_weight_to_int4pack`, whose
nibble order the documentation does not state (docs/w4a8.md), and the quantization runs in the
device's fp32; a difference there fails the check and names the layer (the command that settles
it: `npu-flashrl verify --kernels`, rows npu_convert_weight_to_int4pack).
"""
from __future__ import annotations

from typing import Any, Dict, List, Optional

import torch

from npu_flashrl.rehearsal.common import LAYER_ERROR_TOKENS
from npu_flashrl.rehearsal.state_w4a8_moe import FORWARD_TOL_MOE
from npu_flashrl.rehearsal.state import (
    CATEGORIES, _host, _Layer, layer_output, linear_layers, note_in_place, pushed_bias)

# every tensor the processed W4A8 layer holds (weight_scale_bias: registered by its post-processing)
# The forward check's bound: the emulated op accumulates in fp32 and rounds once to bf16 (about
# 2**-9 relative per element); a dropped bias or a wrong group scale is far above it. On an NPU
# the op's accumulation precision is not documented (docs/w4a8.md): not verified on hardware.
FORWARD_TOL = 0.01
CATEGORIES_W4A8 = CATEGORIES + ("forward",)
_TENSORS = ("weight", "weight_scale", "weight_offset", "weight_scale_second", "weight_offset_second",
            "weight_scale_bias")


def _tensors(layer) -> Dict[str, torch.Tensor]:
    return {n: t for n in _TENSORS if isinstance(t := getattr(layer, n, None), torch.Tensor)}


def _rel(live: torch.Tensor, ref: torch.Tensor) -> float:
    return float(((live.float() - ref.float()).abs() / ref.float().abs().clamp_min(1e-30)).max())


class W4A8StateCheck:
    """Made right after the cold load (records pointers and formats); `check(weights, step)` after
    each sync. `model_dtype`: the dtype the layer's checkpoint scales load into."""

    values = "int4"  # what the "int8" category's counts are of (checks.py names them)

    def __init__(self, model, targets: Dict[str, Any], device: str, seed: int = 0,
                 model_dtype: torch.dtype = torch.bfloat16, experts: Optional[Dict[str, Any]] = None,
                 moe_config: Optional[Dict[str, Any]] = None, forward_context=None, **_unused):
        """`experts`, `moe_config`, `forward_context`: as `state.Int8StateCheck`'s (the W4A8_DYNAMIC
        fused-MoE layers, checked by `state_w4a8_moe.py`)."""
        from npu_flashrl import kernels
        from npu_flashrl.rehearsal.state_w4a8_moe import w4a8_expert_checks

        self.device = device
        self.model_dtype = model_dtype
        self.layers: List[_Layer] = linear_layers(model, targets)
        self.cold_ptr = {l.path: {n: t.data_ptr() for n, t in _tensors(l.layer).items()} for l in self.layers}
        # kept alive: a re-allocating loader cannot land its new tensor on a freed cold address
        self._cold_refs = {l.path: {n: t.data for n, t in _tensors(l.layer).items()} for l in self.layers}
        self.cold_format = {l.path: {"weight": kernels.storage_format(l.layer.weight)} for l in self.layers}
        gen = torch.Generator().manual_seed(seed + 4242)
        self.acts = {l.path: torch.randn(LAYER_ERROR_TOKENS, l.layer.weight.shape[0], generator=gen
                                         ).to(model_dtype) for l in self.layers}
        self.experts = w4a8_expert_checks(model, experts or {}, moe_config or {}, forward_context, seed)

    @torch.no_grad()
    def check(self, weights: Dict[str, torch.Tensor], step: int) -> List[Dict[str, Any]]:
        out = []
        for l in self.layers:
            problems: Dict[str, Optional[str]] = {c: None for c in CATEGORIES_W4A8}
            res = self._check_layer(l, weights, step, problems)
            res["problems"] = problems
            out.append(res)
        for e in self.experts:
            problems = {c: None for c in CATEGORIES_W4A8}
            res = e.check(weights, step, problems)
            res["problems"] = problems
            out.append(res)
        return out

    def _reference(self, l: _Layer, pushed: List[torch.Tensor]):
        """(int4 values [in, out], packed [in, out / 8], weight_scale [out], antiquant scale
        [in / group, out], scale bias [out] or None, dequantized weight [out, in] fp32)."""
        from npu_flashrl.kernels import int4

        inner = l.layer.quant_method.quant_method
        ws = [int4.quantize_weight_w4a8(w.cpu().to(self.model_dtype), int(inner.group_size)) for w in pushed]
        q = torch.cat([w.q for w in ws]).t().contiguous()  # the processed [in, out]
        scale = torch.cat([w.scale for w in ws]).to(self.model_dtype).to(torch.float32)
        second = torch.cat([w.scale_second for w in ws]).to(self.model_dtype)  # [out, groups]
        antiquant, bias = type(inner).process_scale_second(q, scale, second.transpose(0, 1).contiguous())
        deq = (q.float().reshape(second.shape[1], -1, q.shape[1]) * antiquant.float().cpu()[:, None, :]
               ).reshape(q.shape).t()
        return q, int4.pack_int4(q), scale, antiquant.cpu(), None if bias is None else bias.cpu(), deq

    def _check_layer(self, l: _Layer, weights, step: int, problems) -> Dict[str, Any]:
        from npu_flashrl import kernels
        from npu_flashrl.kernels import int4

        layer = l.layer
        res: Dict[str, Any] = {"step": step, "layer": l.path, "type": l.kind}
        pushed = [weights[n] for n in l.shards]
        q, packed, scale, antiquant, bias, deq = self._reference(l, pushed)
        live = _host(layer.weight)
        shape_ok = live.dtype == torch.int32 and tuple(live.shape) == tuple(packed.shape)
        mism = 0
        if shape_ok:
            words = int((live != packed).sum())
            if words:
                mism = int((int4.unpack_int4(live) != q).sum())
                problems["int8"] = (f"{mism}/{q.numel()} int4 values ({words}/{packed.numel()} packed int32 "
                                    "words) differ from a fresh W4A8 load of the pushed weights")
        else:
            problems["int8"] = (f"weight {tuple(live.shape)} {live.dtype}; expected the packed int32 "
                                f"[in, out / 8] = {tuple(packed.shape)}")
        res.update(int8_elements=q.numel(), int8_mismatches=mism if shape_ok else q.numel())
        scale_rel, bad = 0.0, []
        for name, ref in (("weight_scale", scale), ("weight_scale_second", antiquant)):
            t = _host(getattr(layer, name)).reshape(ref.shape) if getattr(layer, name).numel() == ref.numel() \
                else None
            if t is None or t.dtype != ref.dtype:
                bad.append(f"{name} {tuple(getattr(layer, name).shape)} {getattr(layer, name).dtype}, expected "
                           f"{tuple(ref.shape)} {ref.dtype}")
            elif not torch.equal(t, ref):
                rel = _rel(t, ref)
                scale_rel = max(scale_rel, rel)
                bad.append(f"{name} differs in {int((t != ref).sum())}/{ref.numel()} values (up to {rel:.3g} "
                           "relative)")
        res["scale_max_rel_diff"] = scale_rel
        problems["scale"] = "; ".join(bad) or None
        problems["derived"] = self._derived(layer, bias)
        note_in_place(problems, res, layer, _tensors(layer), self.cold_ptr[l.path], self.cold_format[l.path])
        x = self.acts[l.path]
        y = layer_output(layer, x)
        w = torch.cat([p.to(self.model_dtype).float().cpu() for p in pushed])
        b = pushed_bias(l, weights, w.shape[0])
        y_ref = x.float() @ w.t() + (0 if b is None else b)
        res["output_rel_error"] = float((y - y_ref).norm() / y_ref.norm().clamp_min(1e-30))
        # the W4A8 forward of the reference weights: what is left once the int4 rounding is accounted for
        y_w4a8 = x.float() @ deq.t() + (0 if b is None else b)
        fwd = float((y - y_w4a8).norm() / y_w4a8.norm().clamp_min(1e-30))
        res["forward_rel_error"] = fwd
        res["bias"] = b is not None
        if not fwd <= FORWARD_TOL:
            why = ""
            if b is not None:
                y_nob = x.float() @ deq.t()
                if float((y - y_nob).norm() / y_nob.norm().clamp_min(1e-30)) <= FORWARD_TOL:
                    why = (" (it is the forward WITHOUT the layer's bias: vllm-ascend's W4A8 linear apply "
                           "drops it, vllm-ascend PR #11371; is the patch "
                           "ascend_w4a8_dynamic_linear_bias applied? npu-flashrl verify)")
            problems["forward"] = (f"the layer's output differs from x @ dequantized(W)^T + b by {fwd:.4f} "
                                   f"(limit {FORWARD_TOL}){why}")
        return res

    @staticmethod
    def _derived(layer, bias: Optional[torch.Tensor]) -> Optional[str]:
        bad = []
        live_bias = getattr(layer, "weight_scale_bias", None)
        if bias is not None:
            if not isinstance(live_bias, torch.Tensor):
                bad.append("weight_scale_bias missing (vllm-ascend's post-processing registers it)")
            elif not torch.equal(_host(live_bias).reshape(bias.shape), bias):
                bad.append(f"weight_scale_bias differs from the fresh load's in "
                           f"{int((_host(live_bias).reshape(bias.shape) != bias).sum())}/{bias.numel()} values")
        for name in ("weight_offset", "weight_offset_second"):
            t = getattr(layer, name, None)
            if isinstance(t, torch.Tensor) and bool((_host(t) != 0).any()):
                bad.append(f"{name} non-zero in {int((_host(t) != 0).sum())} values (symmetric W4A8)")
        return "; ".join(bad) or None


def state_rules(max_layer_error: float) -> Dict[str, str]:
    """The W4A8 tolerances applied, for report.json."""
    return {"int8": "int4 values: the packed int32 weight equal, word for word, to a fresh W4A8 load of the pushed "
                    "weights (kernels.int4 staged quantizer with the layer's group size, then vllm-ascend's "
                    "post-processing)",
            "scale": "weight_scale (fp32) and the antiquant weight_scale_second equal to the fresh load's, bit for bit",
            "derived": "weight_scale_bias equal to the fresh load's; weight_offset and weight_offset_second zero",
            "in_place": "data_ptr of weight, weight_scale, weight_offset, weight_scale_second, "
                        "weight_offset_second, weight_scale_bias and the weight's storage format unchanged since "
                        "the cold load",
            "output": f"relative Frobenius error of the layer's forward on {LAYER_ERROR_TOKENS} random tokens vs "
                      f"x @ W^T + b in fp32 from the pushed bf16 weights <= {max_layer_error}",
            "forward": f"the same forward vs x @ dequantized(W)^T + b in fp32 (the W4A8 forward of the fresh "
                       f"load, bias included) <= {FORWARD_TOL}",
            "experts": "W4A8_DYNAMIC fused-MoE layers (state_w4a8_moe.py): w13/w2 packed int32 weights, the fused "
                       "int64 weight_scale and the scale_bias equal to a fresh W4A8 load of the pushed experts bit "
                       "for bit, offsets 0, data_ptr and w13/w2 storage format unchanged; output: the sparse MoE "
                       f"block vs an fp32 MoE from the pushed weights <= {max_layer_error}; forward: vs the fp32 MoE "
                       "of the dequantized fresh load with int8 per-token activations <= "
                       f"{FORWARD_TOL_MOE}"}
