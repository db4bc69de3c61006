"""The checkpoint checks of a W4A8 entry (`fn: w4a8_profile_free`), for `setup` and `verify`:
headers only, no tensor data read.

- a ModelSlim W4A8_DYNAMIC checkpoint (its `quant_model_description.json`): every projection the
  description types W4A8_DYNAMIC has the five tensors vllm-ascend's linear method loads, of the
  shapes its `group_size` implies (int8 `weight` [out, in], `weight_scale` / `weight_offset`
  [out, 1], `weight_scale_second` / `weight_offset_second` [out, in / group_size]); the
  description's group size is the entry's when the entry sets one; group size 0 (per-channel,
  vllm-ascend's W4A8 fused-MoE mode) takes W4A8_DYNAMIC experts only (`...mlp.experts.E.*`),
  each with `weight`, `weight_scale` / `weight_offset` [out, 1] and no second level; ModelSlim's newer packed
  layout (`version` "1.0.0") and static W8A8 layers are refused (the W4A8 reload claims neither);
- a ModelSlim mixed W4A8 MoE checkpoint (its W4A8 MoE recipes: attention and dense projections
  W8A8_DYNAMIC, routed experts W4A8_DYNAMIC): each W8A8_DYNAMIC projection has an int8 `weight`
  [out, in] and `weight_scale` / `weight_offset` [out, 1] (the fn serves those layers with INT8,
  `W4A8Quantizer.also_serves`);
- a bare bf16 checkpoint: the entry's group size (default 256) divides every projection's input
  dim (the in-memory description builds the layers with it); group size 0 is refused (the
  in-memory description types every projection W4A8_DYNAMIC, whose linear method has no
  per-channel mode);
- a checkpoint with an HF `quantization_config` (compressed-tensors w8a8) is refused: it builds
  W8A8 layers only, which fn w4a8_profile_free serves only beside W4A8 ones (a mixed checkpoint).
Each problem names the layer (or the file and key) and what was expected.
"""
from __future__ import annotations

import json
import os
import re
from typing import Dict, List, Optional

from npu_flashrl.kernels.int4 import DEFAULT_GROUP_SIZE
from npu_flashrl.quant import projections
from npu_flashrl.quant.w4a8 import (
    PER_CHANNEL, PER_CHANNEL_REFUSED, W4A8_DYNAMIC, W8A8_DYNAMIC, bf16_per_channel_problem,
    group_size_problem, in_dim_problems)

DESCRIPTION_FILE = "quant_model_description.json"  # ModelSlim's (vllm-ascend reads the same name)
NEW_LAYOUT = "1.0.0"  # ModelSlim's packed W4A8 layout (`version`), not reloaded in place
_SECOND = ("weight_scale_second", "weight_offset_second")


def applies(entry) -> bool:
    """The entry's quantizer builds W4A8_DYNAMIC layers."""
    from npu_flashrl.quant.registry import QUANTIZERS

    cls = QUANTIZERS.get(getattr(entry, "fn", None))
    return cls is not None and cls.description_type == W4A8_DYNAMIC


def _read_json(path: str) -> dict:
    try:
        with open(path) as f:
            data = json.load(f)
    except (OSError, ValueError) as exc:
        raise ValueError(f"{path}: unreadable ({exc})") from None
    if not isinstance(data, dict):
        raise ValueError(f"{path}: expected a JSON object (tensor name -> quant type)")
    return data


def read_description(model_dir: str) -> Optional[dict]:
    """The ModelSlim description at `model_dir` (None: it has none); ValueError names an unreadable one."""
    path = os.path.join(model_dir, DESCRIPTION_FILE)
    return _read_json(path) if os.path.exists(path) else None


def w4a8_modules(description: dict) -> List[str]:
    """The projections (module names) a ModelSlim description types W4A8_DYNAMIC."""
    return sorted(k[: -len(".weight")] for k, v in description.items()
                  if isinstance(k, str) and k.endswith(".weight") and projections.is_projection(k)
                  and v == W4A8_DYNAMIC)


def modelslim_problems(model_dir: str, description: dict, group_size: Optional[int]) -> List[str]:
    """Where a ModelSlim checkpoint's tensors or group size do not match its description (or the
    entry's `group_size`), one line per layer."""
    from npu_flashrl.checkpoint import SafetensorsCheckpoint

    where = os.path.join(model_dir, DESCRIPTION_FILE)
    if str(description.get("version", "0")) == NEW_LAYOUT:
        return [f"{where}: version {NEW_LAYOUT!r} is ModelSlim's packed W4A8 layout (int4 pairs in "
                "int8, a precomputed scale_bias); fn w4a8_profile_free reloads the original layout "
                "only (export without the packed layout)"]
    size = description.get("group_size", DEFAULT_GROUP_SIZE)
    problem = group_size_problem(size, f"{where}: group_size")
    if problem:
        return [problem]
    if group_size is not None and group_size != size:
        return [f"{where}: group_size {size}, and the FlashRL config entry says group_size "
                f"{group_size}: the layers are built with the checkpoint's; drop the entry's key or "
                f"set it to {size}"]
    typed = {k[: -len(".weight")]: v for k, v in description.items()
             if isinstance(k, str) and k.endswith(".weight") and projections.is_projection(k)}
    other = sorted(m for m, t in typed.items() if t not in (W4A8_DYNAMIC, W8A8_DYNAMIC, "FLOAT"))
    if other:
        return [f"{where}: {other[0]} is typed {typed[other[0]]} ({len(other)} such projection(s)); "
                f"fn w4a8_profile_free serves {W4A8_DYNAMIC} and {W8A8_DYNAMIC} layers only (use the "
                "fn of that type)"]
    modules = sorted(m for m, t in typed.items() if t == W4A8_DYNAMIC)
    if not modules:
        return [f"{where}: no projection is typed {W4A8_DYNAMIC}: not a W4A8 checkpoint"]
    if size == PER_CHANNEL:
        linear = [m for m in modules if ".experts." not in m]
        if linear:
            return [f"{where}: group_size 0 (per-channel), and {linear[0]} ({len(linear)} such "
                    f"projection(s), not fused-MoE experts) is typed {W4A8_DYNAMIC}: "
                    f"{PER_CHANNEL_REFUSED}; type them FLOAT or use a positive group_size"]
    tensors = ("weight", "weight_scale", "weight_offset") + (() if size == PER_CHANNEL else _SECOND)
    out: List[str] = []
    with SafetensorsCheckpoint(model_dir) as ckpt:
        out += _w8a8_dynamic_problems(ckpt, sorted(m for m, t in typed.items() if t == W8A8_DYNAMIC))
        for m in modules:
            missing = [f"{m}.{s}" for s in tensors if f"{m}.{s}" not in ckpt]
            if missing:
                out.append(f"{m}: typed {W4A8_DYNAMIC} in {DESCRIPTION_FILE}, but the checkpoint has "
                           f"no {missing[0]} ({len(missing)} of its {len(tensors)} tensors missing)")
                continue
            shape = ckpt.shape(f"{m}.weight")
            dtype = ckpt.dtype(f"{m}.weight")
            if len(shape) != 2 or dtype != "I8":
                out.append(f"{m}.weight: {dtype} {list(shape)}; a {W4A8_DYNAMIC} weight is int8 [out, in] "
                           "(one int4 value per element, ModelSlim's original layout)")
                continue
            n, k = shape
            if size and k % size:
                out.append(f"{m}: input dim {k} is not a multiple of the description's group_size {size}")
                continue
            want: Dict[str, tuple] = {"weight_scale": (n, 1), "weight_offset": (n, 1)}
            if size:
                want.update(weight_scale_second=(n, k // size), weight_offset_second=(n, k // size))
            for suffix, expected in want.items():
                got = ckpt.shape(f"{m}.{suffix}")
                if tuple(got) != expected:
                    out.append(f"{m}.{suffix}: shape {list(got)}, expected {list(expected)} for weight "
                               f"{list(shape)} and group_size {size} ({DESCRIPTION_FILE})")
                    break
    return out


def _w8a8_dynamic_problems(ckpt, modules: List[str]) -> List[str]:
    """A mixed checkpoint's W8A8_DYNAMIC projections whose tensors vllm-ascend's W8A8_DYNAMIC
    layers could not load: int8 `weight` [out, in], `weight_scale` / `weight_offset` [out, 1]."""
    out: List[str] = []
    for m in modules:
        missing = [f"{m}.{s}" for s in ("weight", "weight_scale", "weight_offset") if f"{m}.{s}" not in ckpt]
        if missing:
            out.append(f"{m}: typed {W8A8_DYNAMIC} in {DESCRIPTION_FILE}, but the checkpoint has no "
                       f"{missing[0]} ({len(missing)} of its 3 tensors missing)")
            continue
        shape, dtype = ckpt.shape(f"{m}.weight"), ckpt.dtype(f"{m}.weight")
        if len(shape) != 2 or dtype != "I8":
            out.append(f"{m}.weight: {dtype} {list(shape)}; a {W8A8_DYNAMIC} weight is int8 [out, in]")
            continue
        for suffix in ("weight_scale", "weight_offset"):
            got = tuple(ckpt.shape(f"{m}.{suffix}"))
            if got not in ((shape[0], 1), (shape[0],)):
                out.append(f"{m}.{suffix}: shape {list(got)}, expected [{shape[0]}, 1] for weight "
                           f"{list(shape)} ({W8A8_DYNAMIC}, per output channel)")
                break
    return out


def mixed_layout(model_dir: str) -> Optional[str]:
    """What `setup` / `verify` say of a ModelSlim mixed W4A8 checkpoint (W8A8_DYNAMIC and
    W4A8_DYNAMIC projections in one description): which layers each quantizer rewrites at every
    sync; None for any other checkpoint (or an unreadable description: the checks name it)."""
    path = os.path.join(model_dir, DESCRIPTION_FILE)
    if not os.path.exists(path):
        return None
    try:
        description = _read_json(path)
    except ValueError:
        return None
    typed = [t for k, t in description.items()
             if isinstance(k, str) and k.endswith(".weight") and projections.is_projection(k)]
    n8, n4 = typed.count(W8A8_DYNAMIC), typed.count(W4A8_DYNAMIC)
    if not (n8 and n4):
        return None
    size = description.get("group_size", DEFAULT_GROUP_SIZE)
    groups = "per-channel" if size == PER_CHANNEL else f"group_size {size}"
    return (f"ModelSlim mixed W4A8 checkpoint: {n8} {W8A8_DYNAMIC} projection(s) re-quantized INT8 "
            f"(per-channel scales) and {n4} {W4A8_DYNAMIC} projection(s) int4 ({groups}) at every sync")


_EXPERT = re.compile(r"(^|\.)mlp\.experts\.\d+\.")


def line_problems(where: str, description: dict) -> List[str]:
    """What the installed vllm-ascend line does not reload of a W4A8 description: its W4A8_DYNAMIC
    fused-MoE experts on a line whose post-processing npu_flashrl does not follow
    (`StackLine.w4a8_moe_cast` None: the pinned line), refused at engine build otherwise (the scheme's
    `targets`). [] where vllm-ascend is not importable (another row of `verify` says so)."""
    experts = sorted(k for k, v in description.items() if v == W4A8_DYNAMIC and isinstance(k, str)
                     and k.endswith(".weight") and _EXPERT.search(k))
    if not experts:
        return []
    from npu_flashrl.lines.detect import LINES, UnsupportedVersion, current

    try:
        line = current()
    except UnsupportedVersion:
        return []
    if line.w4a8_moe_cast is not None:
        return []
    return [f"{where}: {experts[0][: -len('.weight')]} is a {W4A8_DYNAMIC} fused-MoE expert ({len(experts)} "
            f"expert projection(s)); vllm-ascend {line.vllm_ascend}'s W4A8_DYNAMIC fused-MoE post-processing "
            "keeps another processed layout, which npu_flashrl does not reload (the engine build refuses it): "
            f"use a line that reloads W4A8 MoE (vllm-ascend {', '.join(ln.vllm_ascend for ln in LINES if ln.w4a8_moe_cast)}; "
            "docs/w4a8.md, Fused MoE)"]


def bf16_problems(model_dir: str, group_size: int) -> List[str]:
    """A bare bf16 checkpoint's projections whose input dim `group_size` does not divide."""
    from npu_flashrl.checkpoint import SafetensorsCheckpoint

    with SafetensorsCheckpoint(model_dir) as ckpt:
        shapes = {n: ckpt.shape(n) for n in ckpt.names() if projections.is_projection(n)}
    return in_dim_problems(shapes, group_size)


def w4a8_checkpoint_problems(model_dir: str, group_size: Optional[int] = None) -> List[str]:
    """Why `model_dir` cannot be a W4A8 rollout's checkpoint for an entry whose `group_size` is
    `group_size` (None: not set); [] when it can."""
    description = os.path.join(model_dir, DESCRIPTION_FILE)
    try:
        if os.path.exists(description):
            data = _read_json(description)
            return line_problems(description, data) or modelslim_problems(model_dir, data, group_size)
        config = os.path.join(model_dir, "config.json")
        cfg = _read_json(config) if os.path.exists(config) else {}
    except ValueError as exc:
        return [str(exc)]
    qcfg = cfg.get("quantization_config") or cfg.get("compression_config")
    if qcfg:
        return [f"{config}: quantization_config (quant_method {qcfg.get('quant_method')!r}): a quantized "
                "HF checkpoint builds W8A8 layers, which fn w4a8_profile_free does not serve; use the "
                "bf16 checkpoint or a ModelSlim W4A8_DYNAMIC one"]
    if group_size == PER_CHANNEL:
        return [f"{model_dir}: " + bf16_per_channel_problem()]
    return bf16_problems(model_dir, DEFAULT_GROUP_SIZE if group_size is None else group_size)
