"""FlashRL's `int8`: fixed scales from a profile (`npu-flashrl profile`)."""
from __future__ import annotations

from typing import Callable, Dict, Iterable, List, Mapping, Optional, Sequence, Tuple

import torch

from npu_flashrl import kernels
from npu_flashrl.quant.base import OnlineQuantizer, WeightSyncError
from npu_flashrl.quant.registry import register_quantizer


# Which tensors FlashRL's profiler makes entries for (flash_rl 1.0.3 `profiling_int8`): every
# layernorm, and the seven dense projections.
LAYERNORM_KEY = "layernorm"
INPUT_LINEAR_MAP = {  # linear weight -> layernorm feeding it (None: o_proj, no smoothing)
    "self_attn.q_proj.weight": "input_layernorm.weight",
    "self_attn.k_proj.weight": "input_layernorm.weight",
    "self_attn.v_proj.weight": "input_layernorm.weight",
    "self_attn.o_proj.weight": None,
    "mlp.gate_proj.weight": "post_attention_layernorm.weight",
    "mlp.up_proj.weight": "post_attention_layernorm.weight",
}
OUTPUT_LINEAR_MAP = {"mlp.down_proj.weight": "mlp.up_proj.weight"}


def profile_entry_names(names: Iterable[str]) -> List[str]:
    """Of a model's tensor names, those a complete FlashRL int8 profile has an entry for."""
    return [n for n in names if not n.endswith("_scale")
            and (LAYERNORM_KEY in n or any(b in n for b in (*INPUT_LINEAR_MAP, *OUTPUT_LINEAR_MAP)))]


def entry_shape_problem(name: str, entry: Mapping, shape: Sequence[int]) -> Optional[str]:
    """Why a profile entry does not fit the model tensor of `shape` (None: it does)."""
    ins, outs = entry.get("input_scale"), entry.get("output_scale")
    if entry.get("type") == torch.int8:
        if len(shape) != 2:
            return f"{name}: model tensor has shape {list(shape)}, expected a 2-D weight"
        if isinstance(ins, torch.Tensor) and ins.shape[-1] != shape[1]:
            return (f"{name}: profile input_scale {list(ins.shape)} vs model weight "
                    f"{list(shape)} (in_features {shape[1]})")
        if isinstance(outs, torch.Tensor) and outs.shape[0] != shape[0]:
            return (f"{name}: profile output_scale {list(outs.shape)} vs model weight "
                    f"{list(shape)} (out_features {shape[0]})")
    elif isinstance(ins, torch.Tensor) and tuple(ins.shape) != tuple(shape):
        return f"{name}: profile input_scale {list(ins.shape)} vs model {list(shape)}"
    return None


def profile_problems(profile: Mapping[str, Mapping], shapes: Mapping[str, Sequence[int]],
                     source: str, limit: int = 5, unknown: bool = True,
                     entry_check: Optional[Callable[[str, Mapping], Optional[str]]] = None) -> List[str]:
    """The first `limit` reasons a profile does not serve the model whose tensors have `shapes`
    (name -> shape, in the model's order; `source` names the model): entries of the wrong shape
    (`entry_check`: more per-entry rules), with `unknown` entries the model lacks, and every
    tensor a complete profile covers that it has no entry for (a missing layernorm entry leaves
    that norm unsmoothed: the projections it feeds are off by their smoothing factor). The one
    completeness check of `npu-flashrl setup` / `verify` and of the engine build."""
    problems: List[str] = []
    for name, entry in profile.items():
        if len(problems) >= limit:
            break
        if name not in shapes:
            if unknown:
                problems.append(f"{name}: in the profile but not in {source}")
            continue
        problem = entry_shape_problem(name, entry, shapes[name])
        if problem is None and entry_check is not None:
            problem = entry_check(name, entry)
        if problem is not None:
            problems.append(problem)
    for name in profile_entry_names(shapes):
        if len(problems) >= limit:
            break
        if name not in profile:
            problems.append(f"{name}: in {source} but not in the profile")
    return problems


# Why FlashRL's profile cannot serve a MoE model, and the fix: the one spelling (the engine build,
# `npu-flashrl profile`, `verify` and `setup` all say it).
MOE_REASON = ("FlashRL's int8 profile knows the dense projections only (no expert has an entry, "
              "and it keeps the checkpoint's scales, which experts do not have online)")
MOE_FIX = "use --fn int8_profile_free (fresh per-channel scales for every expert at every sync)"


@register_quantizer("int8")
class ProfileQuantizer(OnlineQuantizer):
    """FlashRL's `int8` profile: fixed scales (the checkpoint's weight_scale stays), layernorm
    smoothing, the up/down beta; same math as flash_rl 1.0.3 `linear_quantize`."""

    writes_scales = False
    dense_only = True  # FlashRL's profile has entries for the seven dense projections only

    def __init__(self, profile: Dict[str, dict], compute_dtype: torch.dtype = torch.bfloat16):
        super().__init__(compute_dtype)
        self.profile = profile
        # Profiles load to the CPU; weights arrive on the device. Each entry's tensors are moved
        # to the device of the first weight that needs them and kept there (per device).
        self._on_device: Dict[Tuple[str, torch.device], dict] = {}

    @classmethod
    def from_entry(cls, compute_dtype, profile: Optional[dict] = None):
        if profile is None:
            raise ValueError("fn 'int8' needs a FlashRL int8 profile (setup -p PROFILE); "
                             "use fn 'int8_profile_free' to quantize without one")
        return cls(profile, compute_dtype)

    def has_entry(self, name: str) -> bool:
        return name in self.profile

    def check(self, name: str, weight: torch.Tensor) -> None:
        """Refuse `name` before anything is written when the profile has no entry for it."""
        self._entry(name, None)

    def check_model(self, shapes, source: str) -> None:
        """Refuse, at engine build, a profile that does not cover the model (`profile_problems`,
        the check `npu-flashrl verify` runs on the checkpoint)."""
        problems = profile_problems(self.profile, shapes, source, limit=5, unknown=False)
        if problems:
            also = f" (also: {'; '.join(problems[1:])})" if len(problems) > 1 else ""
            raise WeightSyncError(
                f"{problems[0]}; the int8 profile does not fit this model{also}: make the profile "
                "for this model (`npu-flashrl profile -m BF16 -q W8A8 -o PROFILE`) and check it "
                "with `npu-flashrl verify`")

    def _entry(self, name, device: Optional[torch.device]):
        try:
            e = self.profile[name]
        except KeyError:
            raise WeightSyncError(f"{name}: not in the int8 profile; the profile was made for "
                                  "another model (re-run `npu-flashrl profile`)") from None
        if device is None:
            return e
        key = (name, device)
        moved = self._on_device.get(key)
        if moved is None:
            moved = {k: (v.to(device) if isinstance(v, torch.Tensor) and v.device != device else v)
                     for k, v in e.items()}
            self._on_device[key] = moved
        return moved

    def quantize(self, name, weight, transposed=False):
        e = self._entry(name, weight.device)
        w = weight.to(self.compute_dtype)
        return kernels.quantize_weight_with_scales(w, e["output_scale"], e["input_scale"],
                                                   transposed=transposed), None

    def transform(self, name, tensor):
        if name not in self.profile:
            return tensor
        e = self._entry(name, tensor.device)
        # Layernorm smoothing: FlashRL computes `w * output_scale * input_scale` then casts.
        out = tensor.to(self.compute_dtype) * e["output_scale"] * e["input_scale"]
        return out.to(e.get("type", self.compute_dtype))
