"""The HF names of the projections the INT8 rollout quantizes: one home for the name rule the
in-memory quant description (`adapters/vllm_ascend/description.py`), MLA's layers
(`adapters/vllm_ascend/mla.py`), the INT8 wire's sender (`quant/wire.py`) and the FlashRL profile
(`profile.py`) share. Pure data; imports nothing of the package."""
from __future__ import annotations

import re

# the seven decoder projections (dense Llama / Qwen2-style names); MoE experts
# (`mlp.experts.E.gate_proj`) and shared experts end in the same names
DENSE = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
# DeepSeek-V2/V3 MLA's quantized projections beside o_proj (`kv_b_proj` stays 16-bit:
# adapters/vllm_ascend/mla.py)
MLA = ("q_a_proj", "kv_a_proj_with_mqa", "q_b_proj")
QUANTIZED = DENSE + MLA

# A projection weight inside a decoder layer: attention, MLP, every routed expert, a shared
# expert (Qwen2-MoE `shared_expert`, DeepSeek `shared_experts`).
_RULE = re.compile(
    r"(^|\.)layers\.\d+\.(self_attn|mlp|mlp\.experts\.\d+|mlp\.shared_experts?)\."
    r"(" + "|".join(QUANTIZED) + r")\.weight$")
# a dense projection weight anywhere (the FlashRL profile's names)
_DENSE_WEIGHT = re.compile(r"\.(" + "|".join(DENSE) + r")\.weight$")


def is_projection(name: str) -> bool:
    """`name` is the weight of a projection the INT8 rollout quantizes."""
    return bool(_RULE.search(name))


def is_dense_projection(name: str) -> bool:
    return bool(_DENSE_WEIGHT.search(name))
