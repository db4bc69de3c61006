"""Weight stream from verl's Megatron actor to the INT8 rollout: what the pinned sync-mode verl sends,
checks, conversion.

``ActorRolloutRefWorker.rollout_mode`` sends ``per_tensor_generator(actor_module, actor_model_config,
weight_converter, tf_config, layer_name_mapping)`` (``verl/utils/megatron_utils.py``) to
``rollout.update_weights`` -> ``model.load_weights``. That generator already: broadcasts each tensor from
its PP stage, renumbers layers globally (``normalize_model_name`` + ``get_transformer_layer_offset``),
all-gathers TP shards and merges them (``default_tp_concat_fn``: QKV split per KV group into q, k, v;
``linear_fc1`` split per shard into gate, up; row-parallel tensors concatenated on dim 1), and maps names
with ``McoreToHFWeightConverterDense.convert_param`` (``verl/models/mcore/weight_converter.py``). So it
yields HF names with full, unsharded shapes, q/k/v (+bias) and gate/up separate, in the model's param
dtype (bf16 under Megatron's Float16Module; FSDP sends fp32 masters).

With ``actor.megatron.use_mbridge=True`` verl sends ``self.bridge.export_weights(actor_module)`` instead
and never calls ``per_tensor_generator``: the patch below does not see that stream (the INT8 reload's own
per-tensor checks in ``vllm_ascend.WeightSync`` still apply); ``workers.py`` logs a WARNING.

:func:`megatron_to_hf_stream` is the one place that converts for the INT8 reload: HF-named tensors of
the dense architectures the INT8 reload handles (:data:`DENSE_ARCHITECTURES`) are validated (the names
the loader consumes: full shapes from the HF config, layer index in range) and passed through
unchanged; Megatron-named tensors (full, or a list of TP shards in rank order, with a PP
``layer_offset``) are merged and split exactly as verl does and renamed with verl's converter when
importable. Any other architecture (DeepSeek-V3/MLA, MoE, VL ...) gets one
:class:`UnsupportedArchitectureError` ("INT8 rollout does not support <arch>") instead of shape errors
computed from dense formulas; with a bf16-only FLASHRL_CONFIG the stream of such a model passes
untouched (there is no INT8 reload to feed).
"""
from __future__ import annotations

import re
from typing import Any, Dict, Iterable, Iterator, List, Optional, Sequence, Tuple, Union

import torch

from npu_flashrl.adapters.megatron import _common
from npu_flashrl.adapters.megatron._common import PATCH_STREAM, WRAPPED, logger, when_imported
from npu_flashrl.marks import marked
from npu_flashrl import lines
from npu_flashrl.errors import NpuFlashrlError
from npu_flashrl.patches import register

# HF architectures whose weights verl sends through McoreToHFWeightConverterDense (the pinned
# sync-mode verl's verl/models/mcore/registry.py) and whose projections the INT8 reload quantizes (vLLM's fused
# qkv_proj / gate_up_proj, plain o_proj / down_proj).
DENSE_ARCHITECTURES = ("LlamaForCausalLM", "Qwen2ForCausalLM", "Qwen3ForCausalLM")
_DENSE_MODEL_TYPES = ("llama", "qwen2", "qwen3")


class WeightStreamError(NpuFlashrlError, ValueError):
    """A tensor of the trainer's weight stream that the rollout cannot take."""


_LAYER = re.compile(r"^(?:.*\.)?layers\.(\d+)\.(.+)$")

# Megatron (TE spec and local spec) -> HF, for names verl's converter does not cover or when verl
# is not importable. {L}: decoder layer number.
_MCORE_TO_HF = {
    "embedding.word_embeddings.weight": "model.embed_tokens.weight",
    "decoder.final_layernorm.weight": "model.norm.weight",
    "output_layer.weight": "lm_head.weight",
}
_MCORE_LAYER_TO_HF = {
    "input_layernorm.weight": "input_layernorm.weight",                          # local spec
    "self_attention.linear_qkv.layer_norm_weight": "input_layernorm.weight",     # TE spec
    "pre_mlp_layernorm.weight": "post_attention_layernorm.weight",               # local spec
    "mlp.linear_fc1.layer_norm_weight": "post_attention_layernorm.weight",       # TE spec
    "self_attention.linear_proj.weight": "self_attn.o_proj.weight",
    "self_attention.q_layernorm.weight": "self_attn.q_norm.weight",
    "self_attention.k_layernorm.weight": "self_attn.k_norm.weight",
    "mlp.linear_fc2.weight": "mlp.down_proj.weight",
    "self_attention.linear_qkv.weight": ("self_attn.q_proj.weight", "self_attn.k_proj.weight",
                                         "self_attn.v_proj.weight"),
    "self_attention.linear_qkv.bias": ("self_attn.q_proj.bias", "self_attn.k_proj.bias",
                                       "self_attn.v_proj.bias"),
    "mlp.linear_fc1.weight": ("mlp.gate_proj.weight", "mlp.up_proj.weight"),
}
# How Megatron shards each tensor over TP ranks: dim of the concatenation (None: replicated).
_ROW_PARALLEL = ("self_attention.linear_proj.weight", "mlp.linear_fc2.weight")
_REPLICATED = ("layernorm", "layer_norm", "final_layernorm")


def _cfg(config, name, default=None):
    if isinstance(config, dict):
        return config.get(name, default)
    return getattr(config, name, default)


def _dims(config) -> Dict[str, int]:
    hidden = int(_cfg(config, "hidden_size"))
    heads = int(_cfg(config, "num_attention_heads"))
    kv = int(_cfg(config, "num_key_value_heads") or heads)
    head_dim = int(_cfg(config, "head_dim") or hidden // heads)
    return dict(hidden=hidden, heads=heads, kv=kv, head_dim=head_dim,
                inter=int(_cfg(config, "intermediate_size")), layers=int(_cfg(config, "num_hidden_layers")),
                vocab=int(_cfg(config, "vocab_size")))


def hf_shapes(config) -> Dict[str, Tuple[int, ...]]:
    """Full HF shapes per layer-relative name (``self_attn.q_proj.weight`` ...) for a dense Qwen2/Llama."""
    d = _dims(config)
    q, kv, h, i = d["heads"] * d["head_dim"], d["kv"] * d["head_dim"], d["hidden"], d["inter"]
    return {
        "self_attn.q_proj.weight": (q, h), "self_attn.k_proj.weight": (kv, h), "self_attn.v_proj.weight": (kv, h),
        "self_attn.q_proj.bias": (q,), "self_attn.k_proj.bias": (kv,), "self_attn.v_proj.bias": (kv,),
        "self_attn.o_proj.weight": (h, q), "mlp.gate_proj.weight": (i, h), "mlp.up_proj.weight": (i, h),
        "mlp.down_proj.weight": (h, i), "input_layernorm.weight": (h,), "post_attention_layernorm.weight": (h,),
        "self_attn.q_norm.weight": (d["head_dim"],), "self_attn.k_norm.weight": (d["head_dim"],),
    }


def pp_layer_offset(pp_rank: int, pp_size: int, num_layers: int,
                    first_stage_layers: Optional[int] = None, last_stage_layers: Optional[int] = None) -> int:
    """Global index of the first decoder layer of PP stage ``pp_rank`` (Megatron's even split, or
    ``num_layers_in_first/last_pipeline_stage``), as ``get_transformer_layer_offset`` computes it."""
    if pp_size <= 1 or pp_rank == 0:
        return 0
    if first_stage_layers is None and last_stage_layers is None:
        if num_layers % pp_size:
            raise ValueError(f"{num_layers} layers do not split evenly over {pp_size} PP stages")
        return pp_rank * (num_layers // pp_size)
    first = first_stage_layers or 0
    last = last_stage_layers or 0
    middle = pp_size - (first_stage_layers is not None) - (last_stage_layers is not None)
    rest = num_layers - first - last
    per = rest // middle if middle else 0
    offset = first if first_stage_layers is not None else per
    return offset + (pp_rank - 1) * per


def _split_qkv(fused: torch.Tensor, d: Dict[str, int]) -> List[torch.Tensor]:
    """Megatron's fused QKV (rows: per KV group [q_per_kv heads of q, 1 head k, 1 head v]) -> q, k, v.
    Works on a TP-merged tensor (groups of all ranks in rank order) and on a single TP shard."""
    hd, q_per_kv = d["head_dim"], d["heads"] // d["kv"]
    group = (q_per_kv + 2) * hd
    if fused.shape[0] % group:
        raise WeightStreamError(f"linear_qkv rows {fused.shape[0]} not a multiple of the KV-group size {group}")
    g = fused.reshape(fused.shape[0] // group, group, *fused.shape[1:])
    q, k, v = g.split([q_per_kv * hd, hd, hd], dim=1)
    return [t.reshape(-1, *fused.shape[1:]) for t in (q, k, v)]


def _merge_tp(rel: str, shards: Sequence[torch.Tensor], d: Dict[str, int]) -> List[torch.Tensor]:
    """TP shards (rank order) of a Megatron tensor -> the HF tensors it holds, unsharded."""
    if rel.startswith("self_attention.linear_qkv.") and "layer_norm" not in rel:
        parts = [_split_qkv(s, d) for s in shards]       # each shard holds whole KV groups
        return [torch.cat([p[j] for p in parts], dim=0) for j in range(3)]
    if rel == "mlp.linear_fc1.weight":
        halves = [s.chunk(2, dim=0) for s in shards]      # each shard is [gate_r; up_r]
        return [torch.cat([h[j] for h in halves], dim=0) for j in range(2)]
    if any(r in rel for r in _REPLICATED):
        return [shards[0]]
    dim = 1 if rel in _ROW_PARALLEL else 0
    return [torch.cat(list(shards), dim=dim)]


_verl_converter_cache: Dict[str, Any] = {}


def _verl_convert(name: str, params: List[torch.Tensor]):
    """verl's own ``McoreToHFWeightConverterDense.convert_param`` when importable (None otherwise)."""
    conv = _verl_converter_cache.get("dense", False)
    if conv is False:
        try:
            from verl.models.mcore.weight_converter import McoreToHFWeightConverterDense

            conv = McoreToHFWeightConverterDense(None, None)  # convert_param uses neither config
        except Exception as exc:  # noqa: BLE001
            logger.debug("verl weight converter not importable (%s); using the built-in table", exc)
            conv = None
        _verl_converter_cache["dense"] = conv
    if conv is None:
        return None
    try:
        names, tensors = conv.convert_param(name, params)
    except (NotImplementedError, AssertionError):
        return None
    return list(names), list(tensors)


def _convert_megatron(name: str, value, d: Dict[str, int], layer_offset: int,
                      use_verl: bool) -> List[Tuple[str, torch.Tensor]]:
    shards = list(value) if isinstance(value, (list, tuple)) else [value]
    if name in _MCORE_TO_HF:
        # embedding / output_layer are vocab-parallel (dim 0); the final norm is replicated
        t = shards[0] if len(shards) == 1 or "layernorm" in name else torch.cat(shards, dim=0)
        return [(_MCORE_TO_HF[name], t)]
    m = _LAYER.match(name)
    if m is None or not name.startswith("decoder."):
        raise WeightStreamError(f"{name}: not a Megatron GPT (dense) parameter name this adapter knows")
    layer, rel = int(m.group(1)) + layer_offset, m.group(2)
    if rel not in _MCORE_LAYER_TO_HF:
        raise WeightStreamError(f"{name}: unsupported Megatron parameter (known: {sorted(_MCORE_LAYER_TO_HF)})")
    tensors = _merge_tp(rel, shards, d)
    global_name = f"decoder.layers.{layer}.{rel}"
    if use_verl:
        got = _verl_convert(global_name, tensors)
        if got is not None:
            return list(zip(*got))
    hf = _MCORE_LAYER_TO_HF[rel]
    hf = hf if isinstance(hf, tuple) else (hf,)
    return [(f"model.layers.{layer}.{h}", t) for h, t in zip(hf, tensors)]


def _is_megatron_name(name: str) -> bool:
    return (name.startswith("decoder.") or name in _MCORE_TO_HF) and "_extra_state" not in name


def _validate_hf(name: str, tensor: torch.Tensor, d: Dict[str, int], shapes: Dict[str, Tuple[int, ...]]) -> None:
    if not isinstance(tensor, torch.Tensor):
        raise WeightStreamError(f"{name}: expected a tensor, got {type(tensor).__name__}")
    m = re.match(r"^model\.layers\.(\d+)\.(.+)$", name)
    if m:
        layer, rel = int(m.group(1)), m.group(2)
        if layer >= d["layers"]:
            raise WeightStreamError(f"{name}: layer {layer} >= num_hidden_layers {d['layers']} "
                                    "(PP layer offset applied twice?)")
        want = shapes.get(rel)
        if want is not None and tuple(tensor.shape) != want:
            hint = " (a TP shard? the rollout needs full tensors)" if tensor.numel() < torch.Size(want).numel() else ""
            raise WeightStreamError(f"{name}: expected full shape {want}, got {tuple(tensor.shape)}{hint}")
    elif name in ("model.embed_tokens.weight", "lm_head.weight"):
        if tensor.dim() != 2 or tensor.shape[1] != d["hidden"] or tensor.shape[0] < d["vocab"]:
            raise WeightStreamError(f"{name}: expected ({d['vocab']}, {d['hidden']}), got {tuple(tensor.shape)}")
    elif name == "model.norm.weight" and tuple(tensor.shape) != (d["hidden"],):
        raise WeightStreamError(f"{name}: expected ({d['hidden']},), got {tuple(tensor.shape)}")


class UnsupportedArchitectureError(WeightStreamError):
    """The model is not one of the dense architectures the INT8 rollout reload handles."""


def architecture(config) -> str:
    """The HF config's first ``architectures`` entry, else ``model_type=<type>``."""
    archs = _cfg(config, "architectures") or []
    if archs:
        return str(archs[0])
    return f"model_type={_cfg(config, 'model_type')}"


def is_dense_supported(config) -> bool:
    archs = _cfg(config, "architectures") or []
    if archs:
        return all(a in DENSE_ARCHITECTURES for a in archs)
    return _cfg(config, "model_type") in _DENSE_MODEL_TYPES


def unsupported_message(config) -> str:
    return (f"INT8 rollout does not support {architecture(config)}: npu_flashrl's online INT8 weight reload "
            f"handles the dense architectures {', '.join(DENSE_ARCHITECTURES)} (what verl's "
            "McoreToHFWeightConverterDense sends). Use a bf16 rollout for this model (FLASHRL_CONFIG=bf16, or "
            "unset FLASHRL_CONFIG).")


def _int8_rollout() -> bool:
    """Does this process's FLASHRL_CONFIG ask for a quantized rollout? (no config: assume it does)."""
    import os

    if not os.environ.get("FLASHRL_CONFIG", "").strip():
        return True
    try:
        from npu_flashrl.config import is_quantized, load_config

        return any(is_quantized(e) for e in load_config().entries)
    except Exception:  # noqa: BLE001 - an unreadable config is reported by activation; be strict here
        return True


def megatron_to_hf_stream(named_tensors: Iterable[Tuple[str, Union[torch.Tensor, Sequence[torch.Tensor]]]],
                          config, layer_offset: int = 0, use_verl: bool = True,
                          validate: bool = True) -> Iterator[Tuple[str, torch.Tensor]]:
    """Turn what a Megatron trainer sends into HF-named, full tensors for the INT8 reload (lazily).

    ``named_tensors`` items are ``(name, tensor)`` or ``(name, [tp_rank0, tp_rank1, ...])``:

    * HF names (what the pinned sync-mode verl's ``per_tensor_generator`` and mbridge yield): validated against
      ``config`` (the HF config: full shapes of the projections and norms the INT8 reload consumes,
      layer index) and passed through unchanged; other names are not checked here;
    * Megatron names (``decoder.layers.{i}.self_attention.linear_qkv.weight`` ...; a ``module.`` prefix is
      stripped; ``_extra_state`` skipped): fused QKV (+bias) split per KV group into q/k/v, ``linear_fc1``
      into gate/up, TP shards merged (column-parallel on dim 0, row-parallel on dim 1, norms replicated),
      layer numbers shifted by ``layer_offset`` (this PP stage's first global layer, see
      :func:`pp_layer_offset`), renamed with verl's ``McoreToHFWeightConverterDense`` when importable.

    Tensors keep their dtype. Raises :class:`WeightStreamError` naming the tensor on anything else, and
    :class:`UnsupportedArchitectureError` (at the first tensor) when ``config`` is not a dense
    architecture of :data:`DENSE_ARCHITECTURES`: no dense-formula shape is computed for it.
    """
    if not is_dense_supported(config):
        raise UnsupportedArchitectureError(unsupported_message(config))
    d = _dims(config)
    shapes = hf_shapes(config)
    for name, value in named_tensors:
        while name.startswith("module."):
            name = name[len("module."):]
        if "_extra_state" in name:
            continue
        if _is_megatron_name(name):
            out = _convert_megatron(name, value, d, layer_offset, use_verl)
        else:
            if isinstance(value, (list, tuple)):
                raise WeightStreamError(f"{name}: HF-named tensors must arrive unsharded, got {len(value)} shards")
            out = [(name, value)]
        for hf_name, t in out:
            if validate:
                _validate_hf(hf_name, t, d, shapes)
            yield hf_name, t


def _wrap_per_tensor_generator(original):
    def per_tensor_generator(actor_module, model_config, *args, **kwargs):
        stream = original(actor_module, model_config, *args, **kwargs)
        if not is_dense_supported(model_config) and not _int8_rollout():
            return stream  # bf16 rollout of a model the INT8 reload does not handle: nothing to check
        return megatron_to_hf_stream(stream, model_config)

    per_tensor_generator.__wrapped__ = original
    setattr(per_tensor_generator, WRAPPED, True)
    return per_tensor_generator


@register(PATCH_STREAM, f"{_common.WORKER_MODULE}:per_tensor_generator", lines.versions("verl", verl_mode="sync"),
          doc="verl's Megatron->rollout weight stream passes megatron_to_hf_stream (validation; converts "
              "Megatron-named/sharded tensors if any)")
def _apply_stream() -> None:
    def patch(module):
        gen = getattr(module, "per_tensor_generator", None)
        if gen is None:
            logger.warning("npu_flashrl: %s has no per_tensor_generator; weight stream unchecked",
                           module.__name__)
            return
        if not marked(gen, WRAPPED):
            module.per_tensor_generator = _wrap_per_tensor_generator(gen)

    when_imported(_common.WORKER_MODULE, patch)

