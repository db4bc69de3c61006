"""A ModelSlim-style static W8A8 checkpoint writer for tests (quant_model_description.json).

Static W8A8 (AscendW8A8LinearMethod): per-channel int8 weights, one per-tensor activation scale
and offset per layer, `deq_scale = input_scale * weight_scale` and an int32 `quant_bias`. The
float bias is stored as `bias` and NOT folded into `quant_bias` (quant_bias = 0), which is the
case where vllm-ascend would silently drop Qwen2's q/k/v bias.
"""
from __future__ import annotations

import json
import os
import shutil

import torch

from npu_flashrl.kernels import quantize_weight_per_channel

PROJECTIONS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


def write_modelslim_w8a8(bf16_dir: str, out_dir: str, input_scale: float = 0.05) -> dict:
    from safetensors.torch import load_file, save_file

    os.makedirs(out_dir, exist_ok=True)
    tensors = {}
    for f in sorted(os.listdir(bf16_dir)):
        if f.endswith(".safetensors"):
            tensors.update(load_file(os.path.join(bf16_dir, f)))
        elif not f.endswith(".json") or f == "config.json" or "token" in f:
            if os.path.isfile(os.path.join(bf16_dir, f)):
                shutil.copy(os.path.join(bf16_dir, f), out_dir)
    out, desc = {}, {}
    for name, t in tensors.items():
        module = name.rsplit(".", 1)[0]
        if name.endswith(".weight") and module.rsplit(".", 1)[-1] in PROJECTIONS:
            q, scale = quantize_weight_per_channel(t)
            dtype = t.dtype
            out[name] = q
            out[module + ".weight_scale"] = scale.to(dtype).unsqueeze(1)
            out[module + ".weight_offset"] = torch.zeros(q.shape[0], 1, dtype=dtype)
            out[module + ".input_scale"] = torch.tensor([input_scale], dtype=dtype)
            out[module + ".input_offset"] = torch.tensor([0], dtype=torch.int8)
            out[module + ".deq_scale"] = (scale.to(dtype).float() * torch.tensor(input_scale, dtype=dtype).float())
            out[module + ".quant_bias"] = torch.zeros(q.shape[0], dtype=torch.int32)
            desc[name] = "W8A8"
            for extra in ("weight_scale", "weight_offset", "input_scale", "input_offset", "deq_scale",
                          "quant_bias"):
                desc[f"{module}.{extra}"] = "W8A8"
        else:
            out[name] = t
            desc[name] = "FLOAT"
    save_file(out, os.path.join(out_dir, "model.safetensors"))
    with open(os.path.join(out_dir, "quant_model_description.json"), "w") as f:
        json.dump(desc, f, indent=1)
    return desc


def write_modelslim_w4a8(bf16_dir: str, out_dir: str, group_size: int = 32, quantize=None) -> dict:
    """A ModelSlim W4A8_DYNAMIC checkpoint ("version 0" layout, the staged quantization of
    `npu_flashrl.kernels.int4`): per projection an int8 `weight` [out, in] holding int4 values,
    float32 `weight_scale` / `weight_offset` [out, 1], float32 `weight_scale_second` and int64
    `weight_offset_second` [out, in // group_size] (the dtypes ModelSlim's own W4A8 test checks,
    test/ST/llm_ptq_w4a8_per_token/run.py); `group_size` in the description. `group_size` 0:
    per-channel (`kernels.int4`'s per-channel rule, no second level), as ModelSlim's per-channel
    W4A8 MoE recipes write experts. `quantize(name) -> bool` picks the projections to quantize
    (default all; the others stay float, typed FLOAT)."""
    from safetensors.torch import load_file, save_file

    from npu_flashrl.kernels.int4 import quantize_weight_w4a8

    os.makedirs(out_dir, exist_ok=True)
    tensors = {}
    for f in sorted(os.listdir(bf16_dir)):
        if f.endswith(".safetensors"):
            tensors.update(load_file(os.path.join(bf16_dir, f)))
        elif not f.endswith(".json") or f == "config.json" or "token" in f:
            if os.path.isfile(os.path.join(bf16_dir, f)):
                shutil.copy(os.path.join(bf16_dir, f), out_dir)
    out, desc = {}, {"model_quant_type": "W4A8_DYNAMIC", "group_size": group_size}
    for name, t in tensors.items():
        module = name.rsplit(".", 1)[0]
        if name.endswith(".weight") and module.rsplit(".", 1)[-1] in PROJECTIONS \
                and (quantize is None or quantize(name)):
            w = quantize_weight_w4a8(t, group_size)
            out[name] = w.q
            out[module + ".weight_scale"] = w.scale.unsqueeze(1)
            out[module + ".weight_offset"] = torch.zeros(w.q.shape[0], 1)
            extras = ("weight", "weight_scale", "weight_offset")
            if w.scale_second is not None:
                out[module + ".weight_scale_second"] = w.scale_second
                out[module + ".weight_offset_second"] = torch.zeros(w.scale_second.shape, dtype=torch.int64)
                extras += ("weight_scale_second", "weight_offset_second")
            for extra in extras:
                desc[f"{module}.{extra}"] = "W4A8_DYNAMIC"
        else:
            out[name] = t
            desc[name] = "FLOAT"
    save_file(out, os.path.join(out_dir, "model.safetensors"))
    with open(os.path.join(out_dir, "quant_model_description.json"), "w") as f:
        json.dump(desc, f, indent=1)
    return desc
