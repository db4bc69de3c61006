"""Tiny Qwen3-MoE checkpoints for vllm-ascend's W4A8_DYNAMIC fused-MoE layers, and the float
experts a W4A8 load of them stands for.

The A8W4 grouped matmul those layers run takes K in multiples of quantGroupSize 256 only
(aclnnGroupedMatmulV4, `kernels/op_rules_int4.check_grouped_matmul_a8w4`), so the experts' K axes
(hidden for gate/up, moe_intermediate for down) are 256 here and the group size is 256; the
attention projections are W4A8_DYNAMIC linear layers of the same group size (ModelSlim
quantizes every projection but the router).
"""
from __future__ import annotations

import json
import os
from typing import List, Optional, Tuple

import torch

from modelslim_writer import write_modelslim_w4a8

GROUP = 256
HIDDEN = MOE_I = 256
EXPERTS, LAYERS = 8, 2
OVERRIDES = dict(hidden_size=HIDDEN, moe_intermediate_size=MOE_I, head_dim=64, num_attention_heads=4,
                 num_key_value_heads=2, num_experts=EXPERTS, num_hidden_layers=LAYERS)


def require_w4a8_moe_reload() -> None:
    """Prepares the CPU vLLM process; skips the test on a line whose vllm-ascend has no
    W4A8_DYNAMIC fused-MoE method, or one npu_flashrl does not reload (`w4a8_moe_cast` None)."""
    import pytest

    from npu_flashrl import lines
    from npu_flashrl.sim.cpu_vllm import prepare_process

    prepare_process()
    ln = lines.current()
    if ln.method_class("W4A8_DYNAMIC", "moe") is None or ln.w4a8_moe_cast is None:
        pytest.skip(f"vllm-ascend {ln.vllm_ascend}: no W4A8_DYNAMIC fused-MoE reload on this line")


def build_pair(root: str, seed: int, group_size: int = GROUP,
               experts_only: Optional[bool] = None, mixed: bool = False) -> Tuple[str, str]:
    """(bf16 dir, ModelSlim W4A8_DYNAMIC dir) of one random tiny Qwen3-MoE. `group_size` 0: the
    per-channel form of ModelSlim's per-channel W4A8 MoE recipes, experts only (vllm-ascend's
    W4A8 linear method has no per-channel mode: the other projections stay FLOAT).
    `experts_only`: only the experts W4A8 (default: for group size 0 only). `mixed`: ModelSlim's
    W4A8 MoE recipes' layout, the experts W4A8_DYNAMIC and the other projections W8A8_DYNAMIC."""
    from npu_flashrl.sim.tiny_models import build_tiny_qwen3_moe

    if experts_only is None:
        experts_only = group_size == 0 or mixed
    kind = "_mixed" if mixed else "_experts" if experts_only else ""
    tag = ("" if group_size == GROUP else f"_g{group_size}") + kind
    bf16, ms = os.path.join(root, f"bf16_{seed}"), os.path.join(root, f"w4a8{tag}_{seed}")
    if not os.path.isdir(bf16):
        build_tiny_qwen3_moe(bf16, seed=seed, config_overrides=OVERRIDES)
    only = (lambda name: ".mlp.experts." in name) if experts_only else None
    desc = write_modelslim_w4a8(bf16, ms, group_size=group_size, quantize=only,
                                w8a8_dynamic=(lambda name: True) if mixed else None)
    # the fused-MoE layer's own key, which v0.10.1rc1's AscendQuantConfig looks up for it (the
    # later lines map it to its experts' names and ignore this one)
    for i in range(LAYERS):
        desc[f"model.layers.{i}.mlp.experts.weight"] = "W4A8_DYNAMIC"
    # vLLM 0.10.1's Qwen3-MoE builds its lm_head with the empty prefix, which v0.10.1rc1's
    # AscendQuantConfig looks up as ".weight"
    desc[".weight"] = "FLOAT"
    with open(os.path.join(ms, "quant_model_description.json"), "w") as f:
        json.dump(desc, f, indent=1)
    return bf16, ms


def expert_weights(hf, layer: int) -> List[Tuple[torch.Tensor, torch.Tensor, torch.Tensor]]:
    """[(gate [I, H], up [I, H], down [H, I])] per expert of the transformers model's layer, as the
    trainer sends them."""
    from npu_flashrl.sim.tiny_models import trainer_weights

    w = dict(trainer_weights(hf))
    p = f"model.layers.{layer}.mlp.experts"
    return [tuple(w[f"{p}.{e}.{n}.weight"] for n in ("gate_proj", "up_proj", "down_proj"))
            for e in range(EXPERTS)]


def dequantized_experts(hf, layer: int) -> Tuple[torch.Tensor, torch.Tensor]:
    """(gate_up [E, 2I, H], down [E, H, I]) fp32: what the W4A8 checkpoint's experts stand for
    (`kernels.int4`'s staged quantization, dequantized)."""
    from npu_flashrl.kernels.int4 import quantize_weight_w4a8

    gate_up, down = [], []
    for g, u, d in expert_weights(hf, layer):
        gate_up.append(torch.cat([quantize_weight_w4a8(g, GROUP).dequantize(),
                                  quantize_weight_w4a8(u, GROUP).dequantize()]))
        down.append(quantize_weight_w4a8(d, GROUP).dequantize())
    return torch.stack(gate_up), torch.stack(down)


def moe_block_reference(x: torch.Tensor, router: torch.Tensor, gate_up: torch.Tensor,
                        down: torch.Tensor, top_k: int) -> torch.Tensor:
    """Qwen3-MoE's block in float64 (softmax routing, top-k renormalised, SiLU-gated experts)."""
    probs = torch.softmax(x.double() @ router.double().t(), dim=-1)
    w, idx = probs.topk(top_k, dim=-1)
    w = w / w.sum(dim=-1, keepdim=True)
    out = torch.zeros(x.shape, dtype=torch.float64)
    for t in range(x.shape[0]):
        for j in range(top_k):
            e = int(idx[t, j])
            h = gate_up[e].double() @ x[t].double()
            a, b = h.chunk(2)
            out[t] += w[t, j] * (down[e].double() @ (torch.nn.functional.silu(a) * b))
    return out
