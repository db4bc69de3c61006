"""Multi-head latent attention (DeepSeek-V2 / V3 / R1): which MLA projections the INT8 rollout
quantizes, following vllm-ascend and ModelSlim.

- `q_a_proj`, `kv_a_proj_with_mqa` (vLLM fuses them into `fused_qkv_a_proj`, vllm-ascend's packed
  mapping for deepseek_v2 / v3: `["q_a_proj", "kv_a_proj_with_mqa"]`), `q_b_proj` (or `q_proj`
  without a q LoRA rank) and `o_proj`: quantized. ModelSlim's DeepSeek-V3 / R1 W8A8 recipes
  quantize the MLA projections (W8A8 static in its "mixed" recipe, W8A8_DYNAMIC in its dynamic
  one, which is the scheme the online quantizer produces).
- `kv_b_proj`: kept 16-bit. vllm-ascend's `AscendMLAImpl.process_weights_after_loading` asserts
  it is unquantized and derives from it, on every post-processing run, the absorbed per-head
  matrices `W_UK_T` [heads, nope, kv_lora] and `W_UV` [heads, kv_lora, v] (written in place after
  the first run, so their storage stays put for captured graphs). An in-place weight sync writes
  kv_b_proj through vLLM's loader; verl's `process_weights_after_loading` after the last bucket
  re-derives the two matrices (server-mode verl and the pinned line's verl call it after every
  sync; a line whose verl does not refuses MLA INT8 rollouts: `StackLine.refused_architectures`).
- The router `mlp.gate` (and its `e_score_correction_bias`), embeddings, norms, lm_head: FLOAT, as
  for every MoE model (the description's rule). Shared experts (`mlp.shared_experts.*_proj`) and
  the first dense layers' MLP: quantized like any decoder projection.
"""
from npu_flashrl.quant.projections import MLA as MLA_PROJECTIONS  # noqa: E402  (one home)
