"""The W4A8 state of vllm-ascend's W4A8_DYNAMIC fused-MoE layers (per-group, ModelSlim's original
layout: `adapters.vllm_ascend.schemes.w4a8_dynamic_moe`) after every sync, in the categories of
`state_w4a8.py` (the linear layers) applied per expert.

The fresh load is computed here, independently of the scheme's staging: `kernels.int4`'s staged
quantizer on the CPU applied to each pushed bf16 expert projection with the layer's group size
(gate | up rows for w13, down for w2), the int4 values transposed to the processed [E, K, N] and
packed to int32 [E, K, N / 8] (`kernels.int4.pack_int4`, the emulation's nibble order); the fused
int64 scale [E, K / group, N] and the fp32 `scale_bias` [E, N] from the layer's own method
object's `process_scale` (upstream's derivation, called on the reference values). After each sync:

* **int4 values**: `w13_weight` / `w2_weight` equal to the reference packing, word for word
  (the count: int4 values that differ); failures name the expert ids;
* **scales**: `w13_weight_scale` / `w2_weight_scale` (int64, both scale levels fused) equal to
  the reference, bit for bit;
* **derived**: `w13_scale_bias` / `w2_scale_bias` equal to the reference; offsets zero;
* **in place**: the data pointer of every one of these tensors and the w13/w2 storage format
  unchanged since the cold load;
* **output error**: the whole sparse MoE block (bf16 router, vllm-ascend's W4A8 fused-MoE apply:
  the A8W4 grouped matmul, emulated by `kernels.int4_moe`) on clearly-routed tokens against the
  fp32 MoE of the pushed bf16 weights (`state_moe.ExpertLayerCheck`'s tokens and reference);
* **forward**: the same block output against the fp32 MoE of the reference's dequantized experts
  (q * fp16(weight_scale * weight_scale_second), the A8W4 matmul's effective weight) with each
  matmul's input quantized per token to int8 (the A8), within `FORWARD_TOL_MOE`.

On the CPU the sync runs the same math, so everything is equal. With --device npu (NOT VERIFIED
ON HARDWARE): the live experts are packed by `npu_quantize(dtype=quint4x2)` after an NZ cast,
whose nibble order the documentation does not state (docs/w4a8.md); the command that settles it:
`npu-flashrl verify --kernels`.
"""
from __future__ import annotations

from typing import Any, Dict, List, Optional

import torch

from npu_flashrl.rehearsal.common import note_in_place
from npu_flashrl.rehearsal.state_moe import ExpertLayerCheck, _host

W4A8_MOE_TENSORS = ("w13_weight", "w2_weight", "w13_weight_scale", "w2_weight_scale", "w13_scale_bias",
                    "w2_scale_bias", "w13_weight_offset", "w2_weight_offset")
# The forward check's bound for the MoE block (its reference quantizes the activations per token to
# int8 as the A8W4 grouped matmul does): what is left is the op's bf16 outputs between the matmuls
# and a per-token int8 value that rounds the other way after them; a doubled expert scale is far
# above it. On an NPU the op's accumulation is not documented: not verified on hardware.
FORWARD_TOL_MOE = 0.02


def _tensors(layer) -> Dict[str, torch.Tensor]:
    return {n: t for n in W4A8_MOE_TENSORS if isinstance(t := getattr(layer, n, None), torch.Tensor)}


def _int8_per_token(x: torch.Tensor) -> torch.Tensor:
    """x through symmetric dynamic int8 quantization per token (absmax / 127, round half to even),
    as fp32: the A8 of the A8W4 grouped matmul (npu_dynamic_quant before each matmul)."""
    scale = x.abs().amax(dim=-1, keepdim=True).clamp_min(1e-30) / 127
    return torch.round(x / scale).clamp(-127, 127) * scale


class W4A8ExpertLayerCheck(ExpertLayerCheck):
    """One W4A8_DYNAMIC fused-MoE layer; made right after the cold load, `check(weights, step,
    problems)` after every sync."""

    activations = staticmethod(_int8_per_token)

    def __init__(self, target, block, top_k, renormalize, forward_context, gen):
        from npu_flashrl import kernels
        from npu_flashrl.adapters.vllm_ascend.schemes.base import inner_method

        super().__init__(target, block, top_k, renormalize, forward_context, gen)
        self.inner = inner_method(self.layer)
        self.group_size = int(self.inner.group_size)
        live = _tensors(self.layer)  # the W4A8 set (the INT8 parent recorded its own)
        self.cold_ptr = {n: t.data_ptr() for n, t in live.items()}
        self._cold_refs = {n: t.data for n, t in live.items()}
        self.cold_format = {n: kernels.storage_format(getattr(self.layer, n)) for n in ("w13_weight", "w2_weight")}

    def _fresh_load(self, weights: Dict[str, torch.Tensor]):
        """{"w13"/"w2": (int4 [E, K, N], packed [E, K, N / 8], fused int64 scale, scale_bias)},
        and the dequantized experts {HF name: fp32 [out, in]}."""
        from npu_flashrl.kernels import int4

        g = self.group_size
        per = {"w13": ([], [], []), "w2": ([], [], [])}
        deq: Dict[str, torch.Tensor] = {}
        for _, _, names in sorted(self.experts, key=lambda x: x[1]):  # by local slot
            ws = {}
            for n in names:
                ws[n] = int4.quantize_weight_w4a8(weights[n].cpu().to(torch.bfloat16), g)
                w = ws[n]
                eff = (w.scale[:, None] * w.scale_second).to(torch.float16).float()  # the fused scale
                deq[n] = w.q.float() * eff.repeat_interleave(g, dim=1)
            for which, shards in (("w13", names[:2]), ("w2", names[2:])):
                q = torch.cat([ws[n].q for n in shards]).t()  # [K, N]
                per[which][0].append(q)
                per[which][1].append(torch.cat([ws[n].scale for n in shards])[:, None])  # [N, 1]
                per[which][2].append(torch.cat([ws[n].scale_second for n in shards]))  # [N, K / g]
        out = {}
        for which, (qs, scales, seconds) in per.items():
            q = torch.stack(qs).contiguous()
            fused, bias = self.inner.process_scale(q, torch.stack(scales), torch.stack(seconds))
            out[which] = (q, int4.pack_int4(q), _host(fused), None if bias is None else _host(bias))
        return out, deq

    def check(self, weights: Dict[str, torch.Tensor], step: int, problems: Dict[str, Optional[str]],
              *_unused) -> Dict[str, Any]:
        from npu_flashrl.kernels import int4, reference

        layer = self.layer
        res: Dict[str, Any] = {"step": step, "layer": self.path, "type": self.kind, "experts": len(self.experts)}
        ref, deq = self._fresh_load(weights)
        slots = {slot: e for e, slot, _ in self.experts}
        n_el = mism = 0
        scale_rel = 0.0
        bad_q: set = set()
        bad_s: set = set()
        bad_d: List[str] = []
        shape_bad = []
        for which, (q, packed, fused, bias) in ref.items():
            live = _host(getattr(layer, f"{which}_weight"))
            n_el += q.numel()
            if live.dtype != torch.int32 or tuple(live.shape) != tuple(packed.shape):
                shape_bad.append(f"{which}_weight {tuple(live.shape)} {live.dtype}; expected the packed int32 "
                                 f"[E, K, N / 8] = {tuple(packed.shape)}")
                mism += q.numel()
            else:
                words = (live != packed).flatten(1).any(1)
                if bool(words.any()):
                    mism += int((int4.unpack_int4(live) != q).sum())
                    bad_q |= {slots[i] for i in words.nonzero().flatten().tolist()}
            s = _host(getattr(layer, f"{which}_weight_scale"))
            if s.dtype != fused.dtype or s.numel() != fused.numel():
                shape_bad.append(f"{which}_weight_scale {tuple(s.shape)} {s.dtype}; expected int64 "
                                 f"{tuple(fused.shape)}")
            else:
                diff = (s.reshape(fused.shape) != fused).flatten(1).any(1)
                if bool(diff.any()):
                    bad_s |= {slots[i] for i in diff.nonzero().flatten().tolist()}
                    live_f, ref_f = (reference.decode_deq_scale(t) for t in (s.reshape(fused.shape), fused))
                    scale_rel = max(scale_rel, float(((live_f - ref_f).abs() / ref_f.abs().clamp_min(1e-30)).max()))
            if bias is not None:
                b = getattr(layer, f"{which}_scale_bias", None)
                if not isinstance(b, torch.Tensor):
                    bad_d.append(f"{which}_scale_bias missing (vllm-ascend's post-processing registers it)")
                elif _host(b).numel() != bias.numel() or not torch.equal(_host(b).reshape(bias.shape), bias):
                    bad_d.append(f"{which}_scale_bias differs from the fresh load's")
            off = getattr(layer, f"{which}_weight_offset", None)
            if isinstance(off, torch.Tensor) and bool((_host(off) != 0).any()):
                bad_d.append(f"{which}_weight_offset non-zero in {int((_host(off) != 0).sum())} values (symmetric)")
        res.update(int8_elements=n_el, int8_mismatches=mism, scale_max_rel_diff=scale_rel,
                   experts_failing=sorted(bad_q | bad_s))
        if shape_bad or bad_q:
            problems["int8"] = "; ".join(shape_bad) or (
                f"{mism}/{n_el} int4 values differ from a fresh W4A8 load of the pushed experts "
                f"(packed int32 words; in expert {', '.join(map(str, sorted(bad_q)))})")
        if bad_s:
            problems["scale"] = ("fused int64 weight_scale (weight_scale x weight_scale_second) differs from a "
                                 f"fresh W4A8 load (up to {scale_rel:.3g} relative) in expert "
                                 f"{', '.join(map(str, sorted(bad_s)))}")
        problems["derived"] = "; ".join(bad_d) or None
        note_in_place(problems, res, layer, _tensors(layer), self.cold_ptr, self.cold_format)
        res.update(self._output(weights, deq))
        res.setdefault("forward_rel_error", float("nan"))
        fwd = res.get("forward_rel_error", float("nan"))
        if not fwd <= FORWARD_TOL_MOE:
            problems["forward"] = (f"the MoE block's output differs from the fp32 MoE of the dequantized fresh "
                                   f"load by {fwd:.4f} (limit {FORWARD_TOL_MOE})"
                                   + (f" ({res['output_note']})" if res.get("output_note") else ""))
        return res


def w4a8_expert_checks(model, experts: Dict[str, Any], moe_config: Dict[str, Any], forward_context,
                       seed: int) -> List[W4A8ExpertLayerCheck]:
    """One check per W4A8_DYNAMIC fused-MoE layer of `experts` (the loader's fused-MoE targets)."""
    if not experts:
        return []
    if moe_config.get("scoring_func") == "sigmoid":
        raise ValueError("W4A8 MoE state check: softmax-routed experts (Qwen3-MoE) only; this checkpoint "
                         "routes with grouped sigmoid scores (DeepSeek-V3)")
    top_k = moe_config.get("num_experts_per_tok")
    if top_k is None:
        raise ValueError("W4A8 MoE state check: the checkpoint config has no num_experts_per_tok")
    renorm = bool(moe_config.get("norm_topk_prob", False))
    gen = torch.Generator().manual_seed(seed + 4343)  # the INT8 check's pool: the same tokens
    out, seen = [], set()
    for t in experts.values():
        if t.path not in seen:
            seen.add(t.path)
            block = model.get_submodule(t.path.rpartition(".")[0])  # the sparse MoE block
            out.append(W4A8ExpertLayerCheck(t, block, top_k, renorm, forward_context, gen))
    return out
