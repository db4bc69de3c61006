"""Tiny Qwen2 / Qwen3 checkpoints built offline from a config (nothing is downloaded).

The default Qwen2 shape exercises what real Qwen2 models have and what the INT8 path must get
right: q/k/v bias, grouped-query attention (4 heads, 2 KV heads), non-square projections
(intermediate != hidden), several decoder layers, untied lm_head. The Qwen3 one is the dense
Qwen3 layout: no q/k/v bias, per-head q_norm / k_norm, head_dim set apart from hidden / heads.
The Qwen3-MoE one (vLLM's Qwen3MoeForCausalLM) has the dense Qwen3 attention and a sparse MLP in
every layer: a router `mlp.gate` [num_experts, hidden] and per-expert
`mlp.experts.E.{gate,up,down}_proj`, top-2 of 8 with renormalized top-k weights.
The Llama one (Llama 3.x layout): no attention / MLP bias, grouped-query attention, llama3 rope
scaling, tied embeddings (as the 1B / 3B sizes have).
The DeepSeek-V3 one (vLLM's DeepseekV3ForCausalLM): MLA attention (q LoRA rank 64: q_a_proj /
q_a_layernorm / q_b_proj; kv_a_proj_with_mqa / kv_a_layernorm / kv_b_proj; 32 + 16 rope q/k head
dims, v head 32), one first dense layer then MoE layers with 8 routed experts (top-2 in 2 groups,
top-1 group), one shared expert, sigmoid scoring with an `e_score_correction_bias`
(`topk_method: noaux_tc`), routed scaling 2.5.
"""
from __future__ import annotations

import json
import os
from typing import List, Optional, Tuple

import torch

TINY_QWEN2 = dict(
    vocab_size=512,
    hidden_size=128,
    intermediate_size=352,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=512,
    rms_norm_eps=1e-6,
    rope_theta=10000.0,
    tie_word_embeddings=False,
    hidden_act="silu",
)


def tiny_qwen2_config(**overrides):
    return _config("Qwen2Config", TINY_QWEN2, overrides)


TINY_QWEN3 = dict(TINY_QWEN2, head_dim=48)  # q: 4*48 = 192 != hidden 128


def tiny_qwen3_config(**overrides):
    return _config("Qwen3Config", TINY_QWEN3, overrides)


TINY_QWEN3_MOE = dict(
    TINY_QWEN3,
    num_experts=8,
    num_experts_per_tok=2,
    moe_intermediate_size=96,      # != hidden: expert projections are not square
    norm_topk_prob=True,
    decoder_sparse_step=1,         # every layer is sparse ...
    mlp_only_layers=[],            # ... none is kept dense
    output_router_logits=False,
)


def tiny_qwen3_moe_config(**overrides):
    return _config("Qwen3MoeConfig", TINY_QWEN3_MOE, overrides)


TINY_LLAMA = dict(
    TINY_QWEN2,
    attention_bias=False,
    mlp_bias=False,
    tie_word_embeddings=True,
    rope_theta=500000.0,
    rope_scaling={"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                  "high_freq_factor": 4.0, "original_max_position_embeddings": 128},
)


def tiny_llama_config(**overrides):
    return _config("LlamaConfig", TINY_LLAMA, overrides)


TINY_DEEPSEEK_V3 = dict(
    vocab_size=512,
    hidden_size=128,
    intermediate_size=352,         # the first dense layer's MLP
    moe_intermediate_size=96,
    num_hidden_layers=3,
    first_k_dense_replace=1,       # layer 0 dense, layers 1-2 MoE
    n_routed_experts=8,
    n_shared_experts=1,
    num_experts_per_tok=2,
    n_group=2,
    topk_group=1,
    routed_scaling_factor=2.5,
    norm_topk_prob=True,
    topk_method="noaux_tc",        # sigmoid scores + e_score_correction_bias, grouped top-k
    scoring_func="sigmoid",
    q_lora_rank=64,
    kv_lora_rank=32,
    qk_nope_head_dim=32,
    qk_rope_head_dim=16,
    v_head_dim=32,
    num_attention_heads=4,
    num_key_value_heads=4,
    max_position_embeddings=512,
    rms_norm_eps=1e-6,
    rope_theta=10000.0,
    tie_word_embeddings=False,
    hidden_act="silu",
)


def tiny_deepseek_v3_config(**overrides):
    return _config("DeepseekV3Config", TINY_DEEPSEEK_V3, overrides)


def build_tiny_qwen2(out_dir: str, dtype: torch.dtype = torch.bfloat16, seed: int = 0,
                     config_overrides: Optional[dict] = None, tokenizer: bool = True):
    """Create a random tiny Qwen2 causal LM in `out_dir` (safetensors) and return the HF model.

    Weights are random but with a realistic spread (per-row scales differ, as in trained LLMs),
    so per-channel quantization is exercised rather than a uniform tensor.
    """
    return _build(_hf("Qwen2ForCausalLM"), tiny_qwen2_config(**(config_overrides or {})), out_dir,
                  dtype, seed, tokenizer)


def build_tiny_qwen3(out_dir: str, dtype: torch.dtype = torch.bfloat16, seed: int = 0,
                     config_overrides: Optional[dict] = None, tokenizer: bool = True):
    """Create a random tiny dense Qwen3 causal LM in `out_dir` (see build_tiny_qwen2)."""
    return _build(_hf("Qwen3ForCausalLM"), tiny_qwen3_config(**(config_overrides or {})), out_dir,
                  dtype, seed, tokenizer)


def build_tiny_qwen3_moe(out_dir: str, dtype: torch.dtype = torch.bfloat16, seed: int = 0,
                         config_overrides: Optional[dict] = None, tokenizer: bool = True):
    """Create a random tiny Qwen3-MoE causal LM in `out_dir` (see build_tiny_qwen2).

    transformers 4.57 holds one nn.Linear per expert; transformers 5 holds the experts fused
    (`mlp.experts.gate_up_proj` [E, 2I, H], `mlp.experts.down_proj` [E, H, I]) and writes the
    per-expert names on save. Either way every expert output row gets its own spread. The same
    seed gives different numbers on the two lines (the parameters are drawn in a different order
    and shape); tests compare within one line.
    """
    return _build(_hf("Qwen3MoeForCausalLM"), tiny_qwen3_moe_config(**(config_overrides or {})), out_dir,
                  dtype, seed, tokenizer)


def build_tiny_llama(out_dir: str, dtype: torch.dtype = torch.bfloat16, seed: int = 0,
                     config_overrides: Optional[dict] = None, tokenizer: bool = True):
    """Create a random tiny Llama 3.x causal LM in `out_dir` (see build_tiny_qwen2)."""
    return _build(_hf("LlamaForCausalLM"), tiny_llama_config(**(config_overrides or {})), out_dir,
                  dtype, seed, tokenizer)


def build_tiny_deepseek_v3(out_dir: str, dtype: torch.dtype = torch.bfloat16, seed: int = 0,
                           config_overrides: Optional[dict] = None, tokenizer: bool = True):
    """Create a random tiny DeepSeek-V3 causal LM in `out_dir` (see build_tiny_qwen2). The
    router's correction bias (an fp32 buffer in transformers, saved with the model) gets a
    spread too."""
    model = _build(_hf("DeepseekV3ForCausalLM"), tiny_deepseek_v3_config(**(config_overrides or {})),
                   out_dir, dtype, seed, tokenizer=False, save=False)
    with torch.no_grad():
        for name, b in model.named_buffers():
            if name.endswith("e_score_correction_bias"):
                b.copy_(0.1 * torch.randn_like(b))
    return _save(model, out_dir, tokenizer)


def trainer_weights(model) -> List[Tuple[str, torch.Tensor]]:
    """The HF model's weights as the trainer pushes them to the rollout: checkpoint (per-expert)
    names, in state_dict order.

    On transformers 5 the experts are fused 3-D parameters; server-mode verl's FSDP engine sends
    `state_dict()` through `verl.workers.engine.fsdp.utils.unfuse_moe_params` (its
    `get_per_tensor_param`), and so does this (`adapters.verl.moe_names.sync_names`, which the
    rehearsal uses too). On transformers 4.x (the sync-mode verl lines) the
    state dict already has one tensor per expert projection and is sent as it is.
    """
    from npu_flashrl.adapters.verl.moe_names import sync_names

    return sync_names(model.state_dict().items(), getattr(model.config, "model_type", None))


def _spread_(p: torch.Tensor) -> None:
    """Random weights whose output rows have different magnitudes (as in trained LLMs). A 3-D
    tensor is a stack of experts [E, out, in]: each expert's rows get their own scale."""
    row_scale = torch.empty(*p.shape[:-1], 1).log_normal_(0.0, 0.5)
    p.copy_(torch.randn_like(p) * 0.05 * row_scale)


def _hf(name: str):
    """transformers' class `name` (imported when a tiny model is made, not with this module)."""
    import transformers

    return getattr(transformers, name)


def _config(class_name: str, base: dict, overrides: dict):
    """transformers' `class_name` config of the tiny `base`, `overrides` on top."""
    kwargs = dict(base)
    kwargs.update(overrides)
    return _hf(class_name)(**kwargs)


def _build(model_cls, config, out_dir, dtype, seed, tokenizer, save=True):
    torch.manual_seed(seed)
    config.torch_dtype = dtype
    model = model_cls(config)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if p.dim() in (2, 3):
                _spread_(p)
            elif name.endswith("bias"):
                p.copy_(torch.randn_like(p) * 0.1)
            else:  # norms
                p.copy_(1.0 + 0.1 * torch.randn_like(p))
    model = model.to(dtype)
    return _save(model, out_dir, tokenizer) if save else model


def _save(model, out_dir, tokenizer):
    os.makedirs(out_dir, exist_ok=True)
    model.save_pretrained(out_dir, safe_serialization=True)
    if tokenizer:
        save_tiny_tokenizer(out_dir, model.config.vocab_size)
    return model


def save_tiny_tokenizer(out_dir: str, vocab_size: int) -> None:
    """A word-level tokenizer over synthetic tokens, built offline with `tokenizers`."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {"<unk>": 0, "<pad>": 1, "<eos>": 2}
    for i in range(len(vocab), vocab_size):
        vocab[f"t{i}"] = i
    tok = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="<unk>", pad_token="<pad>",
                                   eos_token="<eos>")
    fast.save_pretrained(out_dir)


def read_config(model_dir: str) -> dict:
    with open(os.path.join(model_dir, "config.json")) as f:
        return json.load(f)


# Qwen2.5-VL (the 3B / 7B layout at toy size): a Qwen2 language model (q/k/v bias, GQA) with
# M-RoPE, a vision tower of windowed + full-attention blocks whose MLPs are gate/up/down (the
# projection names of the language model) and a patch merger into the language model's width.
TINY_QWEN2_5_VL = dict(
    text_config=dict(TINY_QWEN2, rope_scaling={"type": "mrope", "mrope_section": [4, 6, 6]}),
    vision_config=dict(depth=2, hidden_size=64, intermediate_size=96, num_heads=2, out_hidden_size=128,
                       patch_size=14, spatial_merge_size=2, temporal_patch_size=2, window_size=56,
                       fullatt_block_indexes=[1], in_channels=3),
    image_token_id=500, video_token_id=501, vision_start_token_id=502, vision_end_token_id=503,
    tie_word_embeddings=False,
)


def tiny_qwen2_5_vl_config(**overrides):
    return _config("Qwen2_5_VLConfig", TINY_QWEN2_5_VL, overrides)


def build_tiny_qwen2_5_vl(out_dir: str, dtype: torch.dtype = torch.bfloat16, seed: int = 0,
                          config_overrides: Optional[dict] = None, tokenizer: bool = True):
    """Create a random tiny Qwen2.5-VL in `out_dir` (see build_tiny_qwen2)."""
    return _build(_hf("Qwen2_5_VLForConditionalGeneration"),
                  tiny_qwen2_5_vl_config(**(config_overrides or {})), out_dir, dtype, seed, tokenizer)


# Qwen3-VL (the dense 2B-32B layout at toy size): a Qwen3 language model (q_norm / k_norm, no
# q/k/v bias) with interleaved M-RoPE, a vision tower with learned position embeddings whose MLPs
# are linear_fc1 / linear_fc2, a merger and deepstack mergers feeding early decoder layers.
TINY_QWEN3_VL = dict(
    text_config=dict(TINY_QWEN3, rope_parameters={"rope_type": "default", "rope_theta": 10000.0,
                                                  "mrope_section": [8, 8, 8], "mrope_interleaved": True}),
    vision_config=dict(depth=2, hidden_size=64, intermediate_size=96, num_heads=2, out_hidden_size=128,
                       patch_size=16, spatial_merge_size=2, temporal_patch_size=2,
                       num_position_embeddings=64, deepstack_visual_indexes=[0], in_channels=3),
    image_token_id=500, video_token_id=501, vision_start_token_id=502, vision_end_token_id=503,
    tie_word_embeddings=False,
)


def tiny_qwen3_vl_config(**overrides):
    return _config("Qwen3VLConfig", TINY_QWEN3_VL, overrides)


def build_tiny_qwen3_vl(out_dir: str, dtype: torch.dtype = torch.bfloat16, seed: int = 0,
                        config_overrides: Optional[dict] = None, tokenizer: bool = True):
    """Create a random tiny Qwen3-VL in `out_dir` (see build_tiny_qwen2)."""
    return _build(_hf("Qwen3VLForConditionalGeneration"),
                  tiny_qwen3_vl_config(**(config_overrides or {})), out_dir, dtype, seed, tokenizer)
