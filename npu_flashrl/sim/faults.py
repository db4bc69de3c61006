"""TEST SEAM: faults injected into the rehearsal's rollout path, to prove each check can fail
(part of the simulation: nothing at run time imports it).

Used only by tests (tests/rehearsal/test_rehearsal_checks.py): `NPU_FLASHRL_REHEARSAL_FAULT=<name>` in the
environment of `npu-flashrl rehearse`. Nothing in npu_flashrl or upstream is edited: after the cold
load, the INT8 rollout model's quantizer is wrapped through the adapter's public `attach` (which
swaps the loader's quantizer), or the model is tampered with after `end_weight_sync`. A run with a
fault says so on stdout and in report.json (`fault_injected`), so it cannot pass for a clean run.

Faults (profile-free mode; the quantizer faults need the quantizer to return scales):

=================  ==================================================================  ==========
name               what goes wrong                                                     first sync
=================  ==================================================================  ==========
scale_x0.5         every weight_scale written at half its value                          1
scale_x1.1         every weight_scale written 10% too large                              1
int8_transposed    one square layer's int8 values transposed (first o_proj)              1
stale_shard        one shard (layer 0's k_proj) keeps the tensor of the first sync       2
round_trunc        off-by-one rounding: truncation toward zero instead of rounding       1
moved_weight       one layer's weight re-allocated after the sync (not in place)         1
stale_fp32_scale   one layer's weight_scale_fp32 left at its cold-load value             1
expert_scale_x0.5  MoE: one expert's down_proj scales at half (layer 0, expert 3)         1
stale_expert       MoE: one expert (layer 0, expert 5) keeps the tensors of the first sync 2
w4a8_packed_flip   W4A8: one packed int32 word of the first layer bit-flipped              1
w4a8_scale_x2      W4A8: the first o_proj's antiquant weight_scale_second doubled          1
w4a8_moved_weight  W4A8: the first layer's packed weight re-allocated (not in place)       1
w4a8_expert_flip   W4A8 MoE: one packed int32 word of layer 0's expert 3 w2 bit-flipped    1
w4a8_expert_scale_x2  W4A8 MoE: layer 0's expert 3 fused w2 scale doubled (fp32 exponent+1)  1
=================  ==================================================================  ==========

The MoE faults need a MoE `--model` (refused on a dense model); the global quantizer faults
(scale_x0.5, scale_x1.1, round_trunc) hit the experts too. The W4A8 faults (`rehearse --w4a8`)
hit the W4A8 variant only and the others its INT8 variants only (`install`: by the quant types
of the loader's layers).
"""
from __future__ import annotations

import os
from typing import Optional

import torch

from npu_flashrl.errors import NpuFlashrlError

FAULT_ENV = "NPU_FLASHRL_REHEARSAL_FAULT"
EXPERT_FAULTS = ("expert_scale_x0.5", "stale_expert")
QUANTIZER_FAULTS = ("scale_x0.5", "scale_x1.1", "int8_transposed", "stale_shard", "round_trunc") + EXPERT_FAULTS
AFTER_SYNC_FAULTS = ("moved_weight", "stale_fp32_scale")
W4A8_EXPERT_FAULTS = ("w4a8_expert_flip", "w4a8_expert_scale_x2")
W4A8_FAULTS = ("w4a8_packed_flip", "w4a8_scale_x2", "w4a8_moved_weight") + W4A8_EXPERT_FAULTS
W4A8_EXPERT = 3  # the expert the W4A8 MoE faults hit (layer 0)
FAULTS = QUANTIZER_FAULTS + AFTER_SYNC_FAULTS + W4A8_FAULTS
SCALED_EXPERT = "layers.0.mlp.experts.3.down_proj.weight"
STALE_EXPERT = "layers.0.mlp.experts.5."


class FaultError(NpuFlashrlError, ValueError):
    """An unknown fault name, or a fault this model cannot take (the rehearsal reports it as its error)."""


def active() -> Optional[str]:
    """The fault named in the environment, or None; an unknown name is refused."""
    name = os.environ.get(FAULT_ENV) or None
    if name is not None and name not in FAULTS:
        raise FaultError(f"{FAULT_ENV}={name}: unknown fault; known: {', '.join(FAULTS)}")
    return name


class _FaultyQuantizer:
    """Delegates to the real online quantizer; `quantize` goes wrong as the fault says."""

    def __init__(self, inner, fault: str, square_name: Optional[str]):
        self._inner, self._fault, self._square = inner, fault, square_name
        self._first = {}

    def __getattr__(self, item):
        return getattr(self._inner, item)

    def quantize(self, name, weight, transposed=False, **kw):  # kw: the quantizer's own (finite=)
        f = self._fault
        if (f == "stale_shard" and name.endswith("layers.0.self_attn.k_proj.weight")) or (
                f == "stale_expert" and STALE_EXPERT in name):
            weight = self._first.setdefault(name, weight.detach().clone())
        q, scale = self._inner.quantize(name, weight, transposed=transposed, **kw)
        if f == "expert_scale_x0.5" and name.endswith(SCALED_EXPERT):
            scale = scale * 0.5
        elif f == "scale_x0.5" and scale is not None:
            scale = scale * 0.5
        elif f == "scale_x1.1" and scale is not None:
            scale = scale * 1.1
        elif f == "int8_transposed" and name == self._square:
            q = q.t().clone()  # the values transposed (the loader copies values, any memory layout)
        elif f == "round_trunc" and scale is not None:
            w = weight.to(self._inner.compute_dtype).float()
            q = torch.trunc(w / scale[:, None]).to(torch.int8)
            q = q.t().contiguous().t() if transposed else q
        return q, scale


class Fault:
    def __init__(self, name: str, model, loader):
        self.name, self.model = name, model
        self._layer = None
        targets = loader.targets
        if name in EXPERT_FAULTS:
            experts = getattr(loader, "experts", None) or {}
            needle = SCALED_EXPERT if name == "expert_scale_x0.5" else STALE_EXPERT
            if not any(needle in n for n in experts):
                raise FaultError(f"{FAULT_ENV}={name}: needs a MoE --model with fused-MoE experts "
                                 f"(no '{needle}' among the INT8 loader's expert weights)")
        if name in QUANTIZER_FAULTS:
            from npu_flashrl.adapters import vllm_ascend

            square = next((n for n, t in targets.items() if n.endswith("o_proj.weight")
                           and t.layer.weight.shape[0] == t.layer.weight.shape[1]), None)
            vllm_ascend.attach(model, _FaultyQuantizer(loader.quantizer, name, square))
        elif name in W4A8_EXPERT_FAULTS:
            experts = getattr(loader, "experts", None) or {}
            t = next((t for t in experts.values() if ".layers.0." in f".{t.path}."), None)
            if t is None or t.scheme.key[0] != "W4A8_DYNAMIC":
                raise FaultError(f"{FAULT_ENV}={name}: needs a MoE --model whose layer 0 experts are "
                                 "W4A8_DYNAMIC fused-MoE layers (rehearse --w4a8 on a Qwen3-MoE)")
            self._layer, self.layer_path = t.layer, t.path
            self._slot = int(t.layer._map_global_expert_id_to_local_expert_id(W4A8_EXPERT))
        elif name == "w4a8_scale_x2":
            t = next(t for n, t in targets.items() if n.endswith("o_proj.weight"))
            self._layer, self.layer_path = t.layer, t.path
        elif name in W4A8_FAULTS:
            t = next(iter(targets.values()))
            self._layer, self.layer_path = t.layer, t.path
        else:
            t = next(iter(targets.values()))
            self._layer = t.layer
            self._cold_fp32 = t.layer.weight_scale_fp32.detach().clone()
            self.layer_path = t.path

    @torch.no_grad()
    def after_sync(self) -> None:
        if self.name == "moved_weight":
            self._layer.weight.data = self._layer.weight.data.clone()
        elif self.name == "stale_fp32_scale":
            self._layer.weight_scale_fp32.copy_(self._cold_fp32)
        elif self.name == "w4a8_packed_flip":
            self._layer.weight.data.view(-1)[7] ^= 0x00F0  # one int4 value of word 7 changed
        elif self.name == "w4a8_scale_x2":
            self._layer.weight_scale_second.mul_(2)
        elif self.name == "w4a8_moved_weight":
            self._layer.weight.data = self._layer.weight.data.clone()
        elif self.name == "w4a8_expert_flip":
            self._layer.w2_weight.data[self._slot].view(-1)[7] ^= 0x00F0  # one int4 value of word 7
        elif self.name == "w4a8_expert_scale_x2":
            # the int64 holds the fp32 scale's bits in its low word: +1 on the exponent doubles it
            self._layer.w2_weight_scale.data[self._slot] += 0x00800000


def install(model, loader) -> Optional[Fault]:
    """Called by the rollout loop right after a quantized model's cold load (`loader`: the model's
    loader, as `vllm_ascend.attach` returns it); None without a fault, or when the fault is for
    the other scheme (a W4A8 fault on an INT8 model, an INT8 fault on a W4A8 model)."""
    name = active()
    if name is None:
        return None
    w4a8 = any(t.scheme.key[0] == "W4A8_DYNAMIC"
               for t in list(loader.targets.values()) + list((getattr(loader, "experts", None) or {}).values()))
    return Fault(name, model, loader) if (name in W4A8_FAULTS) == w4a8 else None
