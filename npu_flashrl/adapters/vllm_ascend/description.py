"""vllm-ascend checkpoint description: which layers run vllm-ascend's W8A8 methods.

vllm-ascend's "ascend" method needs a `quant_model_description.json`. For a bf16 checkpoint
(profile-free INT8) or a compressed-tensors w8a8 checkpoint (RedHatAI style) we build that
description in memory, so the model lands on vllm-ascend's own W8A8_DYNAMIC layers (a bf16
checkpoint under `fn: w4a8_profile_free`: W4A8_DYNAMIC, with the entry's `group_size` at the top
level; the type and keys are the entry's quantizer's `description_type` / `description_keys`): a rule,
with every weight of the checkpoint also listed explicitly (the scheme-registry layout,
`lines/v0_23_0.py`, skips its json lookup only for a non-empty description, and its
`apply_vllm_mapper` copies it into a plain dict, dropping the rule). ModelSlim checkpoints with their own json are left alone.

MoE (Qwen3-MoE / Qwen2-MoE names): every routed expert's `mlp.experts.E.{gate,up,down}_proj` (and
a shared expert's projections) is W8A8_DYNAMIC, so vLLM's FusedMoE layer lands on vllm-ascend's
W8A8 dynamic fused-MoE method; the router `mlp.gate` and `mlp.shared_expert_gate` are FLOAT (no
llm-compressor MoE recipe quantizes them). What vllm-ascend asks for the FusedMoE layer
`model.layers.N.mlp.experts`: with the model type's packed mapping (`quant_config.py` or
`modelslim_config.py`, whichever the line's layout has; "qwen3_moe": `"experts":
["experts.0.gate_proj", "experts.0.up_proj", "experts.0.down_proj"]`) it reads
`...mlp.experts.0.{gate,up,down}_proj.weight`, all three alike, both in `is_layer_skipped_ascend`
and for the scheme; without a mapping, the scheme-registry layout reads `...mlp.experts.weight`
(answered by the rule) and the quant_config layout every key containing the prefix. The router
(a ReplicatedLinear given the quant config) is looked up as `...mlp.gate.weight` and must be FLOAT
to stay unquantized.
"""
from __future__ import annotations

import json
import os
import re
from typing import List, Optional, Sequence

from npu_flashrl.adapters.vllm_ascend.mla import MLA_PROJECTIONS
from npu_flashrl.adapters.vllm_ascend.names import in_vision_tower
from npu_flashrl.quant import projections
# the quant types live in their scheme modules (re-exported here for the description's users)
from npu_flashrl.adapters.vllm_ascend.schemes.base import UnsupportedScheme  # noqa: F401
from npu_flashrl.adapters.vllm_ascend.schemes.w8a8_dynamic import W8A8_DYNAMIC
from npu_flashrl.adapters.vllm_ascend.schemes.w8a8_static import W8A8  # noqa: F401

# The seven decoder projections FlashRL quantizes (one home: `quant.projections`).
PROJECTIONS = projections.DENSE
# The module vLLM's FusedMoE layer is registered under (`model.layers.N.mlp.experts`).
FUSED_EXPERTS = "experts"
EXPERT_COUNT_KEYS = ("num_experts", "num_local_experts", "n_routed_experts")
FLOAT = "FLOAT"
DESCRIPTION_FILE = "quant_model_description.json"


class QuantDescription(dict):
    """vllm-ascend's quant description, answered by a rule for names not listed explicitly.

    vllm-ascend looks up `description["<prefix>.weight"]` for every linear/embedding layer and
    raises KeyError for a missing key; a rule lets one description fit any model size.
    """

    def __init__(self, rule_quantized: str = W8A8_DYNAMIC, ignore: Sequence[str] = (),
                 explicit: Optional[dict] = None, source: str = ""):
        super().__init__(explicit or {})
        self.rule_quantized = rule_quantized
        self.ignore = tuple(ignore)
        self.source = source

    def quant_type(self, key: str) -> str:
        module = key[: -len(".weight")] if key.endswith(".weight") else key
        if matches_ignore(module, self.ignore) or in_vision_tower(module):
            return FLOAT  # a VL model's vision tower and merger stay 16-bit (names.py)
        last = module.rsplit(".", 1)[-1]
        if key.endswith(".weight") and (last in PROJECTIONS or last in MLA_PROJECTIONS
                                        or last == FUSED_EXPERTS):
            # `...mlp.experts.weight` is the FusedMoE layer itself (the pinned line asks for it as
            # a whole, the scheme-registry layout when the model type has no packed mapping):
            # typed like its experts.
            return self.rule_quantized
        return FLOAT  # embeddings, norms, lm_head, the MoE router `mlp.gate`, shared_expert_gate

    def __missing__(self, key: str) -> str:
        return self.quant_type(key)

    def fill(self, weight_names, where: str = "") -> "QuantDescription":
        """List every `<module>.weight` of `weight_names` explicitly, typed by the rule. The
        experts of one fused-MoE layer must share a type (one FusedMoE method runs them all)."""
        for name in weight_names:
            if name.endswith(".weight"):
                self[name] = self.quant_type(name)
        _check_experts_uniform(self, where or self.source)
        return self


_EXPERT_RE = re.compile(r"^(.*\.experts)\.(\d+)\.[^.]+\.weight$")


def _check_experts_uniform(desc: dict, where: str) -> None:
    """vllm-ascend builds one method per FusedMoE layer from expert 0's entries (the packed
    mapping): an expert typed otherwise would get its weights truncated into int8 or run int8
    values as floats."""
    types: dict = {}
    for name, typ in desc.items():
        m = _EXPERT_RE.match(name)
        if m:
            types.setdefault(m.group(1), {}).setdefault(typ, []).append(name)
    for layer, by_type in sorted(types.items()):
        if len(by_type) > 1:
            detail = "; ".join(f"{t}: {sorted(n)[0]} (+{len(n) - 1} more)"
                               for t, n in sorted(by_type.items()))
            raise UnsupportedScheme(
                f"{where}: the experts of fused-MoE layer {layer} are not all quantized alike "
                f"({detail}); vllm-ascend runs one method for the whole layer: quantize or ignore "
                "all its experts")


def matches_ignore(module: str, ignore: Sequence[str]) -> bool:
    """compressed-tensors' `ignore` matching: "re:<regex>" is re.match on the module name,
    anything else is the module name (or its last components)."""
    for pattern in ignore:
        if pattern.startswith("re:"):
            if re.match(pattern[3:], module):
                return True
        elif module == pattern or module.endswith("." + pattern):
            return True
    return False


def profile_free_description(quant_type: str = W8A8_DYNAMIC,
                             top_level: Optional[dict] = None) -> QuantDescription:
    """Quantize the seven projections of every decoder layer as `quant_type` (the quant type the
    entry's quantizer serves: W8A8_DYNAMIC, W4A8_DYNAMIC); embeddings, norms, lm_head FLOAT.
    `top_level`: the description's keys beside the per-weight types, as a ModelSlim description
    of that type carries them (W4A8_DYNAMIC: `group_size`, read by the layers when built)."""
    return QuantDescription(quant_type, ignore=("lm_head",), explicit=dict(top_level or {}),
                            source="npu_flashrl:profile-free")


def compressed_tensors_description(qcfg: dict, where: str = "quantization_config") -> QuantDescription:
    """Translate a compressed-tensors w8a8 config into a vllm-ascend description.

    Accepted: int8 symmetric per-channel static weights with int8 symmetric dynamic per-token
    activations (RedHatAI w8a8) -> W8A8_DYNAMIC; `ignore` modules -> FLOAT. Anything else is
    refused with the offending field named: vllm-ascend has no kernel for it.
    """
    groups = qcfg.get("config_groups")
    if not isinstance(groups, dict) or not groups:
        raise UnsupportedScheme(f"{where}: compressed-tensors config has no config_groups")
    for gname, group in groups.items():
        w = group.get("weights") or {}
        a = group.get("input_activations") or {}
        loc = f"{where}.config_groups.{gname}"
        checks = [
            ("weights.num_bits", w.get("num_bits"), 8),
            ("weights.type", w.get("type"), "int"),
            ("weights.symmetric", w.get("symmetric"), True),
            ("weights.strategy", w.get("strategy"), "channel"),
            ("input_activations.num_bits", a.get("num_bits"), 8),
            ("input_activations.type", a.get("type"), "int"),
            ("input_activations.symmetric", a.get("symmetric"), True),
            ("input_activations.dynamic", a.get("dynamic"), True),
            ("input_activations.strategy", a.get("strategy"), "token"),
        ]
        for field, got, want in checks:
            if got != want:
                raise UnsupportedScheme(
                    f"{loc}.{field} = {got!r}: vllm-ascend W8A8_DYNAMIC runs int8 symmetric "
                    f"per-channel weights with int8 symmetric dynamic per-token activations "
                    f"(expected {field} = {want!r}); this scheme is not supported on Ascend")
        targets = group.get("targets") or []
        if targets and not all(t in ("Linear", "re:.*") for t in targets) and not all(
                any(p in t for p in PROJECTIONS) or t.startswith("re:") for t in targets):
            raise UnsupportedScheme(f"{loc}.targets = {targets!r}: only Linear targets (or 're:' "
                                    "module patterns) are supported")
    fmt = qcfg.get("format")
    if fmt not in (None, "int-quantized", "naive-quantized"):
        raise UnsupportedScheme(f"{where}.format = {fmt!r}: expected 'int-quantized' (int8 weights "
                                "stored unpacked)")
    ignore = qcfg.get("ignore") or []
    if not isinstance(ignore, list) or not all(isinstance(p, str) for p in ignore):
        raise UnsupportedScheme(f"{where}.ignore = {ignore!r}: expected a list of module names or "
                                "'re:' patterns")
    for pattern in ignore:
        if pattern.startswith("re:"):
            try:
                re.compile(pattern[3:])
            except re.error as exc:
                raise UnsupportedScheme(f"{where}.ignore: {pattern!r} is not a valid regular "
                                        f"expression ({exc})") from None
    return QuantDescription(W8A8_DYNAMIC, ignore=list(ignore), source="compressed-tensors")


def check_compressed_tensors_weights(desc: QuantDescription, weight_names, where: str) -> None:
    """A compressed-tensors checkpoint's int8 weights carry a `weight_scale`; every one must be
    typed W8A8_DYNAMIC and every W8A8_DYNAMIC weight must have one, or a layer would run int8
    values as floats (a quantized MoE router, an expert the ignore list left out, ...)."""
    names = set(weight_names)
    for name in sorted(names):
        if not name.endswith(".weight"):
            continue
        module = name[: -len(".weight")]
        scaled = f"{module}.weight_scale" in names
        typed = desc.quant_type(name)
        if scaled and typed != W8A8_DYNAMIC:
            raise UnsupportedScheme(
                f"{where}: {name} is stored int8 (it has {module}.weight_scale) but vllm-ascend "
                f"would run {module} as {typed} (a MoE router / shared_expert_gate stays float); "
                "quantize it with it in quantization_config.ignore (llm-compressor: "
                "ignore=['lm_head', 're:.*mlp.gate$'])")
        if typed == W8A8_DYNAMIC and not scaled:
            raise UnsupportedScheme(
                f"{where}: {name} has no {module}.weight_scale, but quantization_config does not "
                f"ignore {module}; add it to quantization_config.ignore or store it quantized")


def read_hf_quant_config(model_dir: str) -> Optional[dict]:
    path = os.path.join(model_dir, "config.json")
    try:
        with open(path) as f:
            cfg = json.load(f)
    except FileNotFoundError:
        raise FileNotFoundError(f"{path}: no config.json in the model directory") from None
    except json.JSONDecodeError as exc:
        raise ValueError(f"{path}: not valid JSON ({exc})") from None
    return cfg.get("quantization_config") or cfg.get("compression_config")


def checkpoint_weight_names(model_dir: str) -> List[str]:
    """Tensor names of a checkpoint directory: the safetensors index, else the safetensors file
    headers (no tensor data is read), else the decoder Linear weights and lm_head that config.json
    implies (a config-only directory, e.g. load_format=dummy; see `config_weight_names`)."""
    index = os.path.join(model_dir, "model.safetensors.index.json")
    if os.path.exists(index):
        with open(index) as f:
            return sorted(json.load(f).get("weight_map", {}))
    files = sorted(f for f in os.listdir(model_dir) if f.endswith(".safetensors"))
    if files:
        from safetensors import safe_open

        names: List[str] = []
        for fname in files:
            with safe_open(os.path.join(model_dir, fname), framework="pt") as sf:
                names += list(sf.keys())
        return sorted(names)
    path = os.path.join(model_dir, "config.json")
    with open(path) as f:
        return config_weight_names(json.load(f), where=path)


def _int_field(cfg: dict, key: str, default: int, where: str) -> int:
    value = cfg.get(key, default)
    if value is None:
        return default
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        raise ValueError(f"{where}: {key} = {value!r}: expected a non-negative integer")
    return value


def config_weight_names(cfg: dict, where: str = "config.json") -> List[str]:
    """The Linear weight names (HF checkpoint names) a Llama/Qwen-style config implies, plus
    lm_head. A MoE config (`num_experts` / `num_local_experts` / `n_routed_experts` > 0) has, in
    each sparse layer, the router `mlp.gate` and `mlp.experts.E.{gate,up,down}_proj` for every
    expert (plus `mlp.shared_expert.*` and `mlp.shared_expert_gate` with
    `shared_expert_intermediate_size`, `mlp.shared_experts.*` with `n_shared_experts`). A layer
    is sparse as vLLM's Qwen3-MoE / Qwen2-MoE decide it: not in `mlp_only_layers` and
    `(i + 1) % decoder_sparse_step == 0`; DeepSeek-style `first_k_dense_replace` keeps the first
    layers dense."""
    layers = _int_field(cfg, "num_hidden_layers", 0, where)
    # Qwen3-MoE's config.json says num_experts (transformers 4) or num_local_experts (transformers
    # 5 saves it under its attribute_map name), DeepSeek n_routed_experts
    experts = next((n for n in (_int_field(cfg, k, 0, where) for k in EXPERT_COUNT_KEYS) if n), 0)
    step = _int_field(cfg, "decoder_sparse_step", 1, where) or 1
    first_dense = _int_field(cfg, "first_k_dense_replace", 0, where)
    mlp_only = cfg.get("mlp_only_layers") or []
    if not isinstance(mlp_only, list) or not all(isinstance(i, int) for i in mlp_only):
        raise ValueError(f"{where}: mlp_only_layers = {mlp_only!r}: expected a list of layer indices")
    shared = (_int_field(cfg, "shared_expert_intermediate_size", 0, where) > 0,
              _int_field(cfg, "n_shared_experts", 0, where) > 0)
    attn = [f"self_attn.{p}" for p in ("q_proj", "k_proj", "v_proj", "o_proj")]
    mlp = ("gate_proj", "up_proj", "down_proj")
    names: List[str] = []
    for i in range(layers):
        layer = f"model.layers.{i}"
        names += [f"{layer}.{m}.weight" for m in attn]
        sparse = experts > 0 and i not in mlp_only and (i + 1) % step == 0 and i >= first_dense
        if not sparse:
            names += [f"{layer}.mlp.{p}.weight" for p in mlp]
            continue
        names.append(f"{layer}.mlp.gate.weight")
        names += [f"{layer}.mlp.experts.{e}.{p}.weight" for e in range(experts) for p in mlp]
        if shared[0]:
            names += [f"{layer}.mlp.shared_expert.{p}.weight" for p in mlp]
            names.append(f"{layer}.mlp.shared_expert_gate.weight")
        if shared[1]:
            names += [f"{layer}.mlp.shared_experts.{p}.weight" for p in mlp]
    return names + ["lm_head.weight"]


def describe_checkpoint(model_dir: str, quant_type: str = W8A8_DYNAMIC,
                        top_level=None) -> Optional[QuantDescription]:
    """The description vllm-ascend should use for `model_dir`, or None to keep upstream's
    (a ModelSlim checkpoint with its own quant_model_description.json). A bare bf16 checkpoint's
    projections are typed `quant_type` with the `top_level` keys (`profile_free_description`; a
    dict, or a callable returning it, called for a bare bf16 checkpoint only: it may refuse one)."""
    if os.path.exists(os.path.join(model_dir, DESCRIPTION_FILE)):
        return None
    qcfg = read_hf_quant_config(model_dir)
    if qcfg is None:
        if callable(top_level):
            top_level = top_level()
        return profile_free_description(quant_type, top_level).fill(
            checkpoint_weight_names(model_dir), where=model_dir)
    method = qcfg.get("quant_method")
    if method == "compressed-tensors" or "config_groups" in qcfg:
        where = f"{os.path.join(model_dir, 'config.json')}: quantization_config"
        names = checkpoint_weight_names(model_dir)
        desc = compressed_tensors_description(qcfg, where=where)
        if any(n.endswith(".weight_scale") for n in names):  # not a config-only directory
            check_compressed_tensors_weights(desc, names, where=model_dir)
        return desc.fill(names, where=where)
    raise UnsupportedScheme(
        f"{os.path.join(model_dir, 'config.json')}: quantization_config.quant_method = {method!r} "
        "is not supported on Ascend; use a bf16 checkpoint (profile-free INT8), a "
        "compressed-tensors w8a8 checkpoint, or a ModelSlim checkpoint")



def checkpoint_is_quantized(model_dir: str) -> bool:
    """True for a W8A8 checkpoint (ModelSlim description or an HF quantization_config): its
    int8 weights and (smoothed) layernorms are final, nothing is to be transformed at load."""
    if os.path.exists(os.path.join(model_dir, DESCRIPTION_FILE)):
        return True
    return read_hf_quant_config(model_dir) is not None
