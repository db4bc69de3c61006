"""Multi-head latent attention (DeepSeek-V2/V3 MLA) on the CPU harness, built as vllm-ascend builds
it on the NPU.

On the NPU, vllm-ascend registers `AscendMultiHeadLatentAttention` for vLLM's
`MultiHeadLatentAttentionWrapper` (`register_ascend_customop`), its platform patches vLLM's MLA
prefill-backend choice (`vllm_ascend.patch.platform.patch_mla_prefill_backend`) and picks
`vllm_ascend.attention.mla_v1.AscendMLABackend` for an MLA model; the backend's `AscendMLAImpl`
holds the layer's projections and, in `process_weights_after_loading`, derives the absorbed
per-head matrices `W_UK_T` [N, P, L] and `W_UV` [N, L, V] from `kv_b_proj` (kept 16-bit: that
method asserts kv_b_proj is unquantized). `enable_ascend_mla` does both registrations on the CPU
platform of `cpu_vllm` (vLLM's own CPU platform refuses MLA), so model build, weight loading and
post-processing are upstream's.

What cannot run here: `AscendMLAImpl.forward` (torch_npu's MLA prolog / fused infer attention
kernels and the paged latent KV cache). `use_cpu_mla_forward` replaces the layer's forward by
the same attention in plain torch, reading the tensors the NPU kernels read: the (INT8)
`fused_qkv_a_proj`, `q_a_layernorm`, the (INT8) `q_b_proj`, `kv_a_layernorm`, the rotary
embedding, the derived `W_UK_T` / `W_UV` (absorbed: q_nope @ W_UK_T scores against the latent
cache, the latent output through W_UV), and the (INT8) `o_proj`. A stale `W_UK_T` / `W_UV` after
a weight sync therefore changes the logits, as it would on the device. Also for DeepSeek's
shared experts: vllm-ascend's fused-MoE layer asks for a second NPU stream, which is the
emulated machine's one in-order stream here.
"""
from __future__ import annotations

import logging

import torch

logger = logging.getLogger(__name__)

ASCEND_MLA_BACKEND = "vllm_ascend.attention.mla_v1.AscendMLABackend"


def enable_ascend_mla() -> None:
    """Register vllm-ascend's MLA layer for vLLM's MLA wrapper and let the CPU platform pick
    vllm-ascend's MLA backend (idempotent)."""
    from vllm.model_executor import custom_op

    from npu_flashrl.sim import cpu_vllm
    from vllm_ascend.ops.mla import AscendMultiHeadLatentAttention

    _scipy_stand_in()
    # vllm-ascend's own platform patch (its NPU platform imports it): MLA prefill runs inside
    # AscendMLAImpl.forward, vLLM's prefill backend is a no-op there
    import vllm_ascend.patch.platform.patch_mla_prefill_backend  # noqa: F401

    registry = getattr(custom_op, "op_registry_oot", None)
    if registry is None:
        registry = custom_op.CustomOp.op_registry_oot
    have = registry.get("MultiHeadLatentAttentionWrapper")
    if have is None:
        custom_op.CustomOp.register_oot(_decorated_op_cls=AscendMultiHeadLatentAttention,
                                        name="MultiHeadLatentAttentionWrapper")
    elif have is not AscendMultiHeadLatentAttention:
        raise RuntimeError(f"MultiHeadLatentAttentionWrapper is registered as {have!r}, not "
                           "vllm-ascend's AscendMultiHeadLatentAttention")
    _shared_experts_on_the_in_order_stream()
    cls = cpu_vllm._platform_cls()
    if getattr(cls, "_npu_flashrl_mla", False):
        return
    cpu_pick = cls.get_attn_backend_cls.__func__

    def get_attn_backend_cls(klass, selected_backend, attn_selector_config, *args, **kwargs):
        if attn_selector_config.use_mla and not attn_selector_config.use_sparse:
            return ASCEND_MLA_BACKEND
        return cpu_pick(klass, selected_backend, attn_selector_config, *args, **kwargs)

    cls.get_attn_backend_cls = classmethod(get_attn_backend_cls)
    cls._npu_flashrl_mla = True
    use_cpu_mla_forward()
    logger.debug("CPU harness: MLA layers are vllm-ascend's (AscendMLABackend), forward in plain torch")


def _shared_experts_on_the_in_order_stream() -> None:
    """Stand-in for the second NPU stream vllm-ascend's fused-MoE layer asks for before running
    a model's shared experts (`utils.shared_experts_calculation_stream()`, evaluated even when the
    overlap is off): the emulated machine's one in-order stream (`torch.npu.current_stream()`)."""
    import torch_npu  # noqa: F401  (the emulation, installed by cpu_vllm.prepare_process)
    from vllm_ascend import utils

    if getattr(utils, "_SHARED_EXPERTS_CALCULATION_STREAM", "absent") is None:
        utils._SHARED_EXPERTS_CALCULATION_STREAM = torch.npu.current_stream()


def _scipy_stand_in() -> None:
    """Stand-in for scipy where the CPU stack lacks it (vllm-ascend declares it; the stack installs
    vllm-ascend without its dependencies): the MLA layer's post-processing imports
    `vllm_ascend.attention.sfa_v1` (an isinstance check), which imports scipy at module level for
    DeepSeek-V3.2's sparse-attention Hadamard matrices only. The stand-in is in `sys.modules` only
    while that module is imported (nothing else in the process sees a scipy); any use of it raises."""
    import importlib
    import importlib.util
    import sys
    import types

    if "vllm_ascend.attention.sfa_v1" in sys.modules or "scipy" in sys.modules or \
            importlib.util.find_spec("scipy") is not None:
        return

    class _Absent(types.ModuleType):
        def __getattr__(self, item):
            if item.startswith("__") and item.endswith("__"):
                raise AttributeError(item)
            raise ModuleNotFoundError(f"scipy.{item}: scipy is not installed (CPU harness stand-in; "
                                      "only DeepSeek-V3.2 sparse attention needs it)")

    sys.modules["scipy"] = _Absent("scipy")
    try:
        importlib.import_module("vllm_ascend.attention.sfa_v1")
    finally:
        del sys.modules["scipy"]


def use_cpu_mla_forward() -> None:
    """Test-harness substitution (not a product patch): `AscendMultiHeadLatentAttention.forward`
    in plain torch on the CPU (see the module doc)."""
    from vllm_ascend.ops.mla import AscendMultiHeadLatentAttention

    if getattr(AscendMultiHeadLatentAttention.forward, "__npu_flashrl_plain__", False):
        return
    _cpu_mla_forward.__npu_flashrl_plain__ = True
    AscendMultiHeadLatentAttention.forward = _cpu_mla_forward


def _linear(layer, x):
    out = layer(x)
    return out[0] if isinstance(out, tuple) else out


def _cpu_mla_forward(self, positions, hidden_states, kv_cache=None, attn_metadata=None):
    """Causal MLA over one sequence, absorbed form (as AscendMLAImpl decodes)."""
    impl = self.mla_attn.impl
    t = hidden_states.shape[0]
    n, p, r = impl.num_heads, impl.qk_nope_head_dim, impl.qk_rope_head_dim
    lora = impl.kv_lora_rank
    if impl.fused_qkv_a_proj is not None:
        qkv_a = _linear(impl.fused_qkv_a_proj, hidden_states)
        q_c, kv_a = qkv_a.split([impl.q_lora_rank, lora + r], dim=-1)
        q = _linear(impl.q_proj, impl.q_a_layernorm(q_c))
    else:
        q = _linear(impl.q_proj, hidden_states)
        kv_a = _linear(impl.kv_a_proj_with_mqa, hidden_states)
    q = q.view(t, n, p + r)
    q_nope, q_pe = q.split([p, r], dim=-1)
    kv_c, k_pe = kv_a.split([lora, r], dim=-1)
    kv_c = impl.kv_a_layernorm(kv_c.contiguous())
    q_pe, k_pe = impl.rotary_emb(positions, q_pe.contiguous(), k_pe.unsqueeze(1).contiguous())
    # absorbed: scores = (q_nope W_UK^T) kv_c^T + q_pe k_pe^T; out = softmax(scores) kv_c W_UV
    q_lat = torch.bmm(q_nope.transpose(0, 1).float(), impl.W_UK_T.float())        # [N, T, L]
    scores = torch.matmul(q_lat, kv_c.float().t()) + \
        torch.matmul(q_pe.transpose(0, 1).float(), k_pe.view(t, r).float().t())    # [N, T, T]
    mask = torch.ones(t, t, dtype=torch.bool).triu(1)
    scores = (scores * impl.scale).masked_fill(mask, float("-inf"))
    lat = torch.matmul(scores.softmax(-1), kv_c.float())                           # [N, T, L]
    out = torch.bmm(lat, impl.W_UV.float()).transpose(0, 1)                        # [T, N, V]
    out = out.reshape(t, n * impl.v_head_dim).to(hidden_states.dtype)
    return _linear(impl.o_proj, out)
