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


def _read_bf16(bf16_dir: str, out_dir: str) -> dict:
    """The tensors of the bf16 checkpoint in `bf16_dir`; its config, tokenizer and other non-json
    files copied into `out_dir` (made)."""
    from safetensors.torch import load_file

    os.makedirs(out_dir, exist_ok=True)
    tensors = {}
    for f in sorted(os.listdir(bf16_dir)):
        if f.endswith(".safetensors"):
            tensors.update(load_file(os.path.join(bf16_dir, f)))
        elif not f.endswith(".json") or f == "config.json" or "token" in f:
            if os.path.isfile(os.path.join(bf16_dir, f)):
                shutil.copy(os.path.join(bf16_dir, f), out_dir)
    return tensors


def _save(out: dict, desc: dict, out_dir: str) -> dict:
    """Writes the checkpoint's tensors and its quant_model_description.json; returns `desc`."""
    from safetensors.torch import save_file

    save_file(out, os.path.join(out_dir, "model.safetensors"))
    with open(os.path.join(out_dir, "quant_model_description.json"), "w") as f:
        json.dump(desc, f, indent=1)
    return desc


def write_modelslim_w8a8(bf16_dir: str, out_dir: str, input_scale: float = 0.05) -> dict:
    tensors = _read_bf16(bf16_dir, out_dir)
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
    return _save(out, desc, out_dir)


def write_modelslim_w4a8(bf16_dir: str, out_dir: str, group_size: int = 32, quantize=None,
                        w8a8_dynamic=None) -> dict:
    """A ModelSlim W4A8_DYNAMIC checkpoint ("version 0" layout, the staged quantization of
    `npu_flashrl.kernels.int4`): per projection an int8 `weight` [out, in] holding int4 values,
    float32 `weight_scale` / `weight_offset` [out, 1], float32 `weight_scale_second` and int64
    `weight_offset_second` [out, in // group_size] (the dtypes ModelSlim's own W4A8 test checks,
    test/ST/llm_ptq_w4a8_per_token/run.py); `group_size` in the description. `group_size` 0:
    per-channel (`kernels.int4`'s per-channel rule, no second level), as ModelSlim's per-channel
    W4A8 MoE recipes write experts. `quantize(name) -> bool` picks the projections to quantize
    (default all; the others stay float, typed FLOAT). `w8a8_dynamic(name) -> bool` types those
    others W8A8_DYNAMIC instead (ModelSlim's mixed W4A8 MoE recipes, e.g. msit
    lab_practice/deepseek_v3/deepseek_w4a8_per_channel.yaml: `*self_attn*` and the dense `*mlp*`
    W8A8_DYNAMIC, `*mlp.experts*` W4A8_DYNAMIC): int8 `weight` [out, in], float32 `weight_scale`
    and `weight_offset` [out, 1], the per-channel rule of `kernels.quantize_weight_per_channel`."""
    from npu_flashrl.kernels.int4 import quantize_weight_w4a8

    tensors = _read_bf16(bf16_dir, out_dir)
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
        elif name.endswith(".weight") and module.rsplit(".", 1)[-1] in PROJECTIONS \
                and w8a8_dynamic is not None and w8a8_dynamic(name):
            q, scale = quantize_weight_per_channel(t)
            out[name] = q
            out[module + ".weight_scale"] = scale.float().unsqueeze(1)
            out[module + ".weight_offset"] = torch.zeros(q.shape[0], 1)
            for extra in ("weight", "weight_scale", "weight_offset"):
                desc[f"{module}.{extra}"] = "W8A8_DYNAMIC"
        else:
            out[name] = t
            desc[name] = "FLOAT"
    return _save(out, desc, out_dir)


def require_w4a8_linear() -> None:
    """Prepares the CPU vLLM process; skips the test on a line whose vllm-ascend has no
    W4A8_DYNAMIC linear method."""
    import pytest

    from npu_flashrl import lines
    from npu_flashrl.sim.cpu_vllm import prepare_process

    prepare_process()
    if lines.current().method_class("W4A8_DYNAMIC", "linear") is None:
        pytest.skip(f"vllm-ascend {lines.current().vllm_ascend} has no W4A8_DYNAMIC linear method")


def w4a8_checkpoint(root: str, group_size: int, seed: int = 0):
    """(bf16 dir, ModelSlim W4A8 dir of `group_size`) of the tiny Qwen2 of `seed`, under `root`."""
    from npu_flashrl.sim.checkpoints import tiny_checkpoint_pair

    bf16, _ = tiny_checkpoint_pair(root, seed=seed)
    ms = os.path.join(root, "modelslim_w4a8")
    write_modelslim_w4a8(bf16, ms, group_size=group_size)
    return bf16, ms


def w4a8_checkpoint_pairs(tmp_path_factory, group_size: int, prefix: str) -> dict:
    """{seed: (bf16 dir, ModelSlim W4A8 dir of `group_size`, HF bf16 model)} for seeds 0 and 1
    (two weight sets of one shape), in fresh folders `prefix`_<seed> (`require_w4a8_linear`
    first)."""
    from transformers import AutoModelForCausalLM

    require_w4a8_linear()
    out = {}
    for seed in (0, 1):
        bf16, ms = w4a8_checkpoint(str(tmp_path_factory.mktemp(f"{prefix}_{seed}")), group_size, seed)
        out[seed] = (bf16, ms, AutoModelForCausalLM.from_pretrained(bf16, dtype=torch.bfloat16))
    return out
