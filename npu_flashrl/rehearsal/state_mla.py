"""MLA's absorbed matrices after every sync (DeepSeek-V2/V3; see `state.py` for the quantized layers).

vllm-ascend's MLA (`AscendMLAImpl.process_weights_after_loading`) keeps `kv_b_proj` 16-bit and
derives from it, per head, `W_UK_T` [N, P, L] and `W_UV` [N, L, V] as plain attributes: a sync that
rewrites kv_b_proj in place and leaves them stale decodes with the old attention weights. After
each sync, for every MLA layer: `kv_b_proj.weight` equals the pushed tensor (in its dtype),
`W_UK_T` / `W_UV` equal their derivation from it (kv_b viewed [N, P + V, L]: the first P rows of
each head, transposed for W_UV the last V), and none of the three moved since the cold load (the
same storage: what a forward reads is what was checked).
"""
from __future__ import annotations

from typing import Any, Dict, List

import torch


def _host(t: torch.Tensor) -> torch.Tensor:
    from npu_flashrl import kernels

    return kernels.to_host_nd(t)


class MlaAbsorbedCheck:
    """Made right after the cold load (records pointers); `check(weights, step)` after each sync."""

    def __init__(self, model):
        self.layers: List[Any] = []
        for name, mod in model.named_modules():
            mla = getattr(mod, "mla_attn", None)
            impl = getattr(getattr(mla, "mla_attn", None), "impl", None)
            if getattr(mod, "kv_b_proj", None) is not None and impl is not None and hasattr(impl, "W_UK_T"):
                self.layers.append((name, mod, impl))
        self.cold_ptr = {n: self._ptrs(m, i) for n, m, i in self.layers}
        self._cold_refs = {n: (m.kv_b_proj.weight.data, i.W_UK_T, i.W_UV) for n, m, i in self.layers}

    @staticmethod
    def _ptrs(mod, impl) -> Dict[str, int]:
        return {"kv_b_proj.weight": mod.kv_b_proj.weight.data_ptr(), "W_UK_T": impl.W_UK_T.data_ptr(),
                "W_UV": impl.W_UV.data_ptr()}

    def __bool__(self) -> bool:
        return bool(self.layers)

    @torch.no_grad()
    def check(self, weights: Dict[str, torch.Tensor], step: int) -> Dict[str, Any]:
        problems: List[str] = []
        for name, mod, impl in self.layers:
            pushed = weights.get(f"{name}.kv_b_proj.weight")
            if pushed is None:
                problems.append(f"{name}.kv_b_proj.weight was not pushed")
                continue
            live = _host(mod.kv_b_proj.weight)
            want = pushed.cpu().to(live.dtype)
            if not torch.equal(live, want):
                problems.append(f"{name}.kv_b_proj.weight differs from the pushed tensor")
            n, p, v = impl.num_heads, impl.qk_nope_head_dim, impl.v_head_dim
            per_head = want.view(n, p + v, -1)
            uk_t, uv = per_head[:, :p, :], per_head[:, p:, :].transpose(1, 2)
            for label, t, ref in (("W_UK_T", impl.W_UK_T, uk_t), ("W_UV", impl.W_UV, uv)):
                got = _host(t)
                if tuple(got.shape) != tuple(ref.shape) or not torch.equal(got, ref.to(got.dtype)):
                    problems.append(f"{name} {label} is not derived from the pushed kv_b_proj (stale)")
            moved = [k for k, ptr in self._ptrs(mod, impl).items() if self.cold_ptr[name][k] != ptr]
            if moved:
                problems.append(f"{name} {', '.join(moved)} moved since the cold load")
        return {"step": step, "layers": len(self.layers), "problems": problems}


__all__ = ["MlaAbsorbedCheck"]
