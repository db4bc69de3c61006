"""The INT8 state of vllm-ascend's W8A8_DYNAMIC fused-MoE layers after every sync (see `state.py`
for the linear layers and the rules; this module applies the same five categories per expert).

One fused-MoE layer holds every expert of a decoder layer: `w13_weight` [E, H, 2I] and
`w2_weight` [E, I, H] int8 in the processed layout ([in, out] per expert; NZ on the NPU), the
per-channel scales `w13_weight_scale` [E, 2I] / `w2_weight_scale` [E, H] in the model dtype, the
fp32 copy `w13_weight_scale_fp32`, zero offsets, and with the newest vllm-ascend line's `enable_fused_mc2` the
int64 bit patterns `fused_w1_scale` / `fused_w2_scale`. Checked against the pushed bf16 experts
(`mlp.experts.E.{gate,up,down}_proj.weight`, the names verl's trainer sends):

* **int8 / scale**: each expert's gate | up rows and down rows against
  `kernels.reference.quantize_weight_per_channel` of the pushed tensors (EQUAL on the CPU; the
  NPU's tie rule of `state.py`), its scales within one ulp of the model dtype; failures name the
  expert ids.
* **derived**: `w13_weight_scale_fp32` == `w13_weight_scale` in fp32, offsets zero, fused_mc2
  scales decode to the scales.
* **in place**: the data pointer of every one of these tensors and the storage format of
  w13/w2 unchanged since the cold load.
* **output error**: the whole sparse MoE block (vLLM's router `mlp.gate` in bf16, then
  vllm-ascend's fused-MoE apply: routing, grouped INT8 matmuls with per-token activations,
  swiglu; emulated on the CPU) inside vllm-ascend's forward context, on fixed random tokens,
  against an fp32 MoE computed here from the pushed bf16 weights (softmax router, top-k,
  renormalised when the checkpoint's `norm_topk_prob` says so, SiLU-gated experts). Tokens are
  chosen per sync, from a fixed pool, so that their top-k experts are clear in the pushed router
  (a near-tie could route differently in bf16 and fp32, which is not an INT8 error) and so that
  every expert gets tokens (an expert no token reaches would hide its errors).
"""
from __future__ import annotations

from typing import Any, Callable, Dict, List, Optional, Tuple

import torch

from npu_flashrl.kernels.conformance import INT8_ABS_TOL
from npu_flashrl.rehearsal.common import LAYER_ERROR_TOKENS
from npu_flashrl.rehearsal.common import note_in_place

MOE_TENSORS = ("w13_weight", "w2_weight", "w13_weight_scale", "w2_weight_scale", "w13_weight_offset",
               "w2_weight_offset", "w13_weight_scale_fp32", "fused_w1_scale", "fused_w2_scale")
# a token is used only when its k-th and (k+1)-th router logits (fp32) are this far apart,
# relative to its largest |logit|: 8x a bf16 rounding (2^-8), so bf16 and fp32 route alike
ROUTER_MARGIN = 2.0 ** -5
TOKEN_POOL = 512


def _host(t: torch.Tensor) -> torch.Tensor:
    from npu_flashrl import kernels

    return kernels.to_host_nd(t)


def _tensors(layer) -> Dict[str, torch.Tensor]:
    return {n: t for n in MOE_TENSORS if isinstance(t := getattr(layer, n, None), torch.Tensor)}


class ExpertLayerCheck:
    """One fused-MoE layer (an `adapters.vllm_ascend.schemes.w8a8_dynamic_moe.ExpertTarget`); made right after the
    cold load, `check(weights, step, problems)` after every sync."""

    kind = "experts"
    activations: Optional[Callable] = None  # a quantized forward's activations (W4A8: int8 per token)

    def __init__(self, target, block: torch.nn.Module, top_k: int, renormalize: bool,
                 forward_context: Optional[Callable[[int], Any]], gen: torch.Generator):
        from npu_flashrl import kernels

        self.target, self.layer, self.block = target, target.layer, block
        self.path = target.path
        self.top_k, self.renormalize = int(top_k), bool(renormalize)
        self.forward_context = forward_context
        parent = self.path.rpartition(".")[0]  # model.layers.N.mlp
        self.gate_name = f"{parent}.gate.weight"
        # (local expert slot, HF names of gate / up / down) of every expert this rank holds
        by_expert: Dict[int, Dict[str, str]] = {}
        for name, (expert, shard, _) in target.names.items():
            if name in target.local:
                by_expert.setdefault(int(expert), {})[shard] = name
        self.experts: List[Tuple[int, int, Tuple[str, str, str]]] = []
        for e, shards in sorted(by_expert.items()):
            slot = int(self.layer._map_global_expert_id_to_local_expert_id(e))
            self.experts.append((e, slot, (shards["w1"], shards["w3"], shards["w2"])))
        self.all_local = len(self.experts) == int(getattr(self.layer, "global_num_experts", len(self.experts)))
        live = _tensors(self.layer)
        self.cold_ptr = {n: t.data_ptr() for n, t in live.items()}
        self._cold_refs = {n: t.data for n, t in live.items()}  # see state.Int8StateCheck
        self.cold_format = {n: kernels.storage_format(getattr(self.layer, n)) for n in ("w13_weight", "w2_weight")}
        hidden = int(self.layer.w13_weight.shape[1])
        self.pool = torch.randn(TOKEN_POOL, hidden, generator=gen).to(torch.bfloat16)

    # ------------------------------------------------------------------ expected values
    @staticmethod
    def _quant(w: torch.Tensor):
        from npu_flashrl.kernels import reference

        q, s = reference.quantize_weight_per_channel(w.cpu(), torch.bfloat16)
        return q, s, w.cpu().to(torch.bfloat16).float() / s[:, None]

    def check(self, weights: Dict[str, torch.Tensor], step: int, problems: Dict[str, Optional[str]],
              tie_tolerant: bool, tie_band: float, max_tie_fraction: float) -> Dict[str, Any]:
        layer = self.layer
        res: Dict[str, Any] = {"step": step, "layer": self.path, "type": self.kind, "experts": len(self.experts)}
        w13, w2 = _host(layer.w13_weight), _host(layer.w2_weight)
        s13 = _host(layer.w13_weight_scale).reshape(w13.shape[0], -1).float()
        s2 = _host(layer.w2_weight_scale).reshape(w2.shape[0], -1).float()
        sdt = layer.w13_weight_scale.dtype
        n_el = mism = off_tie = far = worst = 0
        scale_rel = 0.0
        bad_int8: List[str] = []
        bad_scale: List[str] = []
        shape_problem = None
        if w13.dtype != torch.int8 or w2.dtype != torch.int8:
            shape_problem = f"w13_weight {w13.dtype} / w2_weight {w2.dtype}; expected int8"
        for e, slot, (g_name, u_name, d_name) in self.experts if shape_problem is None else ():
            g, u, d = weights[g_name], weights[u_name], weights[d_name]
            inter = g.shape[0]
            live = {"gate_proj": (w13[slot].t()[:inter], s13[slot][:inter]),
                    "up_proj": (w13[slot].t()[inter:], s13[slot][inter:]),
                    "down_proj": (w2[slot].t(), s2[slot])}
            for shard, w in (("gate_proj", g), ("up_proj", u), ("down_proj", d)):
                q_live, s_live = live[shard]
                if tuple(q_live.shape) != tuple(w.shape) or s_live.numel() != w.shape[0]:
                    shape_problem = (f"expert {e} {shard}: int8 {tuple(q_live.shape)}, {s_live.numel()} scales; "
                                     f"expected {tuple(w.shape)} ([E, H, 2I] / [E, I, H] processed)")
                    break
                q_ref, s_ref, quot = self._quant(w)
                diff = q_live.to(torch.int16) - q_ref.to(torch.int16)
                n_bad = int((diff != 0).sum())
                n_el += diff.numel()
                if n_bad:
                    tie = (quot - quot.floor() - 0.5).abs() <= tie_band
                    mism += n_bad
                    off_tie += int(((diff != 0) & ~tie).sum())
                    far += int((diff.abs() > INT8_ABS_TOL).sum())
                    worst = max(worst, int(diff.abs().max()))
                    bad_int8.append(f"{e}.{shard}")
                s_exp = s_ref.to(sdt).float()
                rel = float(((s_live - s_exp).abs() / s_exp.abs().clamp_min(1e-30)).max())
                if not rel <= torch.finfo(sdt).eps:
                    bad_scale.append(f"{e}.{shard}")
                scale_rel = max(scale_rel, rel)
            if shape_problem:
                break
        res.update(int8_elements=n_el, int8_mismatches=mism, int8_mismatches_off_tie=off_tie,
                   int8_max_step_diff=worst, scale_max_rel_diff=scale_rel,
                   experts_failing=sorted({int(b.split(".")[0]) for b in bad_int8 + bad_scale}))
        if shape_problem:
            problems["int8"] = shape_problem
        elif mism and not (tie_tolerant and far == 0 and mism <= max_tie_fraction * n_el):
            problems["int8"] = (f"{mism}/{n_el} expert int8 values differ from the reference quantization "
                                f"(max {worst} steps, {off_tie} not at a .5 tie; in expert {_names(bad_int8)})")
        if bad_scale:
            problems["scale"] = (f"expert scales off by up to {scale_rel:.3g} relative (limit "
                                 f"{torch.finfo(sdt).eps:.3g}, one {str(sdt).replace('torch.', '')} ulp; "
                                 f"in expert {_names(bad_scale)})")
        problems["derived"] = self._derived(s13, s2)
        note_in_place(problems, res, layer, _tensors(layer), self.cold_ptr, self.cold_format)
        res.update(self._output(weights))
        return res

    def _derived(self, s13: torch.Tensor, s2: torch.Tensor) -> Optional[str]:
        from npu_flashrl.kernels import reference

        layer, bad = self.layer, []
        fp32 = getattr(layer, "w13_weight_scale_fp32", None)
        if isinstance(fp32, torch.Tensor):
            f = _host(fp32).reshape(s13.shape[0], -1) if _host(fp32).numel() == s13.numel() else _host(fp32)
            if f.dtype != torch.float32 or f.shape != s13.shape or not torch.equal(f, s13):
                n = int((f.float() != s13).sum()) if f.shape == s13.shape else f.numel()
                bad.append(f"w13_weight_scale_fp32 differs from w13_weight_scale in {n}/{s13.numel()} values")
        for which in ("w13", "w2"):
            off = getattr(layer, f"{which}_weight_offset", None)
            if isinstance(off, torch.Tensor) and bool((_host(off) != 0).any()):
                bad.append(f"{which}_weight_offset non-zero in {int((_host(off) != 0).sum())} values (symmetric int8)")
        for name, s in (("fused_w1_scale", s13), ("fused_w2_scale", s2)):
            fused = getattr(layer, name, None)
            if isinstance(fused, torch.Tensor):
                dec = reference.decode_deq_scale(_host(fused)).flatten()
                if dec.numel() != s.numel() or not torch.equal(dec, s.flatten()):
                    bad.append(f"{name} does not decode to the live scales")
        return "; ".join(bad) or None

    # ------------------------------------------------------------------ output error
    def _tokens(self, gate_w: torch.Tensor) -> Optional[torch.Tensor]:
        """Indices into the pool: tokens with a clear top-k in the pushed router, every expert
        reached (up to LAYER_ERROR_TOKENS * top_k / E tokens each)."""
        logits = self.pool.float() @ gate_w.float().t()
        top = logits.topk(self.top_k + 1, dim=-1)
        margin = top.values[:, self.top_k - 1] - top.values[:, self.top_k]
        clear = margin > ROUTER_MARGIN * logits.abs().amax(dim=-1)
        n_exp = logits.shape[1]
        per_expert = max(1, LAYER_ERROR_TOKENS * self.top_k // n_exp)
        chosen: List[int] = []
        for e in range(n_exp):
            hits = (clear & (top.indices[:, :self.top_k] == e).any(-1)).nonzero().flatten().tolist()
            chosen += [i for i in hits if i not in chosen][:per_expert]
        return torch.tensor(sorted(chosen)) if chosen else None

    def _reference(self, x: torch.Tensor, weights: Dict[str, torch.Tensor], gate_w: torch.Tensor,
                   dtype: torch.dtype = torch.bfloat16, act: Optional[Callable] = None) -> torch.Tensor:
        """The fp32 MoE of `weights`' experts, each first rounded to `dtype` (the model's);
        `act`, when given, applied to each expert matmul's input (a quantized one's activations)."""
        act = act or (lambda t: t)
        xf = x.float()
        probs = torch.softmax(xf @ gate_w.float().t(), dim=-1)
        topv, topi = probs.topk(self.top_k, dim=-1)
        if self.renormalize:
            topv = topv / topv.sum(-1, keepdim=True)
        out = torch.zeros_like(xf)
        for e, _, (g_name, u_name, d_name) in self.experts:
            w = (topv * (topi == e)).sum(-1)  # [T]: this expert's routing weight (0 if not picked)
            rows = w.nonzero().flatten()
            if rows.numel() == 0:
                continue
            g, u, d = (weights[n].cpu().to(dtype).float() for n in (g_name, u_name, d_name))
            xe = xf[rows]
            h = torch.nn.functional.silu(act(xe) @ g.t()) * (act(xe) @ u.t())
            out[rows] += w[rows, None] * (act(h) @ d.t())
        return out

    def _output(self, weights: Dict[str, torch.Tensor],
                dequantized: Optional[Dict[str, torch.Tensor]] = None) -> Dict[str, Any]:
        """`dequantized` (a W4A8 check's): the fp32 experts the quantized layer stands for; the
        block's output against their fp32 MoE is reported as `forward_rel_error`."""
        gate_w = weights.get(self.gate_name)
        if gate_w is None:
            gate = getattr(self.block, "gate", None)
            gate_w = _host(gate.weight) if gate is not None else None
        if gate_w is None or not self.all_local:
            return {"output_rel_error": float("nan"), "output_tokens": 0,
                    "output_note": "router weight not pushed" if gate_w is None else "experts not all local"}
        idx = self._tokens(gate_w)
        if idx is None:
            return {"output_rel_error": float("nan"), "output_tokens": 0,
                    "output_note": "no token with a clear top-k routing"}
        x = self.pool[idx]
        dev = self.layer.w13_weight.device
        ctx = self.forward_context(x.shape[0]) if self.forward_context is not None else _null()
        with ctx:
            y = self.block(x.to(dev).clone())
        y = (y[0] if isinstance(y, tuple) else y).float().cpu()
        y_ref = self._reference(x, weights, gate_w)
        err = float((y - y_ref).norm() / y_ref.norm().clamp_min(1e-30))
        out = {"output_rel_error": err, "output_tokens": int(idx.numel())}
        if dequantized is not None:
            y_q = self._reference(x, dequantized, gate_w, torch.float32, self.activations)
            out["forward_rel_error"] = float((y - y_q).norm() / y_q.norm().clamp_min(1e-30))
        return out


def grouped_sigmoid_route(x: torch.Tensor, gate_w: torch.Tensor, bias: Optional[torch.Tensor], n_group: int,
                          topk_group: int, top_k: int, renormalize: bool, scaling: float):
    """DeepSeek-V3's routing in fp32: (weights [T, k], experts [T, k], clear [T] bool). Scores
    sigmoid(x W^T); the choice adds the correction bias; groups are ranked by the sum of their two
    best choice scores and all but the best `topk_group` masked; the top-k experts' unbiased
    scores, renormalised, times `scaling`. `clear`: both the group and the expert choice have a
    margin of ROUTER_MARGIN (relative) to the next candidate."""
    scores = torch.sigmoid(x.float() @ gate_w.float().t())
    choice = scores + (bias.float() if bias is not None else 0.0)
    t, e = choice.shape
    groups = choice.view(t, n_group, e // n_group).topk(2, dim=-1).values.sum(-1)
    gtop = groups.topk(min(topk_group + 1, n_group), dim=-1)
    keep = torch.zeros_like(groups, dtype=torch.bool).scatter_(1, gtop.indices[:, :topk_group], True)
    masked = choice.masked_fill(~keep.repeat_interleave(e // n_group, dim=1), float("-inf"))
    top = masked.topk(top_k + 1, dim=-1)
    scale = choice.abs().amax(dim=-1)
    clear = (top.values[:, top_k - 1] - top.values[:, top_k]) > ROUTER_MARGIN * scale
    if topk_group < n_group:
        clear &= (gtop.values[:, topk_group - 1] - gtop.values[:, topk_group]) > ROUTER_MARGIN * scale
    idx = top.indices[:, :top_k]
    w = scores.gather(1, idx)
    if renormalize:
        w = w / (w.sum(-1, keepdim=True) + 1e-20)
    return w * scaling, idx, clear


class GroupedSigmoidExpertLayerCheck(ExpertLayerCheck):
    """A DeepSeek-V3 MoE layer (vLLM's DeepseekV2MoE): the output reference routes as the
    checkpoint's config says (sigmoid scores, `e_score_correction_bias` added for the choice only,
    experts in `n_group` groups of which the `topk_group` best by the sum of their top two are
    kept, top-k, renormalised, times `routed_scaling_factor`) and adds the shared experts
    (`mlp.shared_experts.{gate,up,down}_proj`, a SiLU-gated MLP), all in fp32 from the pushed
    weights. Tokens are kept only where both choices (groups, then experts) are clear."""

    def __init__(self, target, block, top_k, renormalize, forward_context, gen, moe_config):
        super().__init__(target, block, top_k, renormalize, forward_context, gen)
        parent = self.path.rpartition(".")[0]
        self.bias_name = f"{parent}.gate.e_score_correction_bias"
        self.shared_names = tuple(f"{parent}.shared_experts.{n}.weight" for n in ("gate_proj", "up_proj", "down_proj"))
        self.n_group = int(moe_config.get("n_group") or 1)
        self.topk_group = int(moe_config.get("topk_group") or 1)
        self.scaling = float(moe_config.get("routed_scaling_factor") or 1.0)
        self._bias: Optional[torch.Tensor] = None

    def _route(self, x: torch.Tensor, gate_w: torch.Tensor):
        return grouped_sigmoid_route(x, gate_w, self._bias, self.n_group, self.topk_group, self.top_k,
                                     self.renormalize, self.scaling)

    def _tokens(self, gate_w: torch.Tensor) -> Optional[torch.Tensor]:
        _, idx, clear = self._route(self.pool, gate_w)
        per_expert = max(1, LAYER_ERROR_TOKENS * self.top_k // len(self.experts))
        chosen: List[int] = []
        for e, _, _ in self.experts:
            hits = (clear & (idx == e).any(-1)).nonzero().flatten().tolist()
            chosen += [i for i in hits if i not in chosen][:per_expert]
        return torch.tensor(sorted(chosen)) if chosen else None

    def _reference(self, x: torch.Tensor, weights: Dict[str, torch.Tensor], gate_w: torch.Tensor) -> torch.Tensor:
        xf = x.float()
        topv, topi, _ = self._route(x, gate_w)
        out = torch.zeros_like(xf)
        for e, _, (g_name, u_name, d_name) in self.experts:
            w = (topv * (topi == e)).sum(-1)
            rows = w.nonzero().flatten()
            if rows.numel() == 0:
                continue
            g, u, d = (weights[n].cpu().to(dtype).float() for n in (g_name, u_name, d_name))
            xe = xf[rows]
            out[rows] += w[rows, None] * ((torch.nn.functional.silu(xe @ g.t()) * (xe @ u.t())) @ d.t())
        if all(n in weights for n in self.shared_names):
            g, u, d = (weights[n].cpu().to(torch.bfloat16).float() for n in self.shared_names)
            out += (torch.nn.functional.silu(xf @ g.t()) * (xf @ u.t())) @ d.t()
        return out

    def _output(self, weights: Dict[str, torch.Tensor]) -> Dict[str, Any]:
        bias = weights.get(self.bias_name)
        if bias is None:
            live = getattr(getattr(self.block, "gate", None), "e_score_correction_bias", None)
            bias = _host(live) if isinstance(live, torch.Tensor) else None
        self._bias = bias.cpu() if bias is not None else None
        if not all(n in weights for n in self.shared_names) and getattr(self.block, "shared_experts", None) is not None:
            return {"output_rel_error": float("nan"), "output_tokens": 0,
                    "output_note": "shared experts not pushed"}
        return super()._output(weights)


def _names(items: List[str], limit: int = 6) -> str:
    more = f" (+{len(items) - limit} more)" if len(items) > limit else ""
    return ", ".join(items[:limit]) + more


class _null:
    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False


def expert_checks(model, experts: Dict[str, Any], moe_config: Dict[str, Any],
                  forward_context: Optional[Callable[[int], Any]], seed: int) -> List[ExpertLayerCheck]:
    """One check per fused-MoE layer of the loader's expert targets (`loader.experts`)."""
    if not experts:
        return []
    top_k = moe_config.get("num_experts_per_tok")
    if top_k is None:
        raise ValueError("MoE state check: the checkpoint config has no num_experts_per_tok")
    renorm = bool(moe_config.get("norm_topk_prob", False))
    gen = torch.Generator().manual_seed(seed + 4343)
    out, seen = [], set()
    for t in experts.values():
        if t.path in seen:
            continue
        seen.add(t.path)
        block = model.get_submodule(t.path.rpartition(".")[0])  # the sparse MoE block (router + experts)
        if moe_config.get("scoring_func") == "sigmoid":  # DeepSeek-V3: grouped sigmoid routing, shared experts
            out.append(GroupedSigmoidExpertLayerCheck(t, block, top_k, renorm, forward_context, gen, moe_config))
        else:
            out.append(ExpertLayerCheck(t, block, top_k, renorm, forward_context, gen))
    return out
