"""vllm-ascend checkpoint description: which layers run vllm-ascend's W8A8 methods.

vllm-ascend's "ascend" method needs a `quant_model_description.json`. For a bf16 checkpoint
(profile-free INT8) or a compressed-tensors w8a8 checkpoint (RedHatAI style) we build that
description in memory, so the model lands on vllm-ascend's own W8A8_DYNAMIC layers: a rule,
with every weight of the checkpoint also listed explicitly (vllm-ascend 0.23 skips its json
lookup only for a non-empty description, and its `apply_vllm_mapper` copies it into a plain dict,
dropping the rule). ModelSlim checkpoints with their own json are left alone.
"""
from __future__ import annotations

import json
import os
import re
from typing import List, Optional, Sequence

# The seven decoder projections FlashRL quantizes (dense Llama/Qwen2-style names).
PROJECTIONS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
W8A8_DYNAMIC = "W8A8_DYNAMIC"
W8A8 = "W8A8"
FLOAT = "FLOAT"
DESCRIPTION_FILE = "quant_model_description.json"


class UnsupportedScheme(ValueError):
    """A checkpoint quantization scheme vllm-ascend's W8A8 layers cannot run."""


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
        if _ignored(module, self.ignore):
            return FLOAT
        if key.endswith(".weight") and module.rsplit(".", 1)[-1] in PROJECTIONS:
            return self.rule_quantized
        if key.endswith(".experts.weight"):
            # v0.10.1rc1 asks for a fused-MoE layer as a whole ("<prefix>.experts.weight")
            return self.rule_quantized
        return FLOAT

    def __missing__(self, key: str) -> str:
        return self.quant_type(key)

    def fill(self, weight_names) -> "QuantDescription":
        """List every `<module>.weight` of `weight_names` explicitly, typed by the rule."""
        for name in weight_names:
            if name.endswith(".weight"):
                self[name] = self.quant_type(name)
        return self


def _ignored(module: str, ignore: Sequence[str]) -> bool:
    for pattern in ignore:
        if pattern.startswith("re:"):
            if re.match(pattern[3:], module):
                return True
        elif module == pattern or module.endswith("." + pattern):
            return True
    return False


def profile_free_description() -> QuantDescription:
    """Quantize the seven projections of every decoder layer; embeddings, norms, lm_head FLOAT."""
    return QuantDescription(W8A8_DYNAMIC, ignore=("lm_head",), source="npu_flashrl:profile-free")


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
            raise UnsupportedScheme(f"{loc}.targets = {targets!r}: only Linear targets are supported")
    fmt = qcfg.get("format")
    if fmt not in (None, "int-quantized", "naive-quantized"):
        raise UnsupportedScheme(f"{where}.format = {fmt!r}: expected 'int-quantized' (int8 weights "
                                "stored unpacked)")
    ignore = list(qcfg.get("ignore") or [])
    return QuantDescription(W8A8_DYNAMIC, ignore=ignore, source="compressed-tensors")


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
    headers (no tensor data is read), else the dense decoder projections and lm_head that
    config.json's `num_hidden_layers` implies (a config-only directory, e.g. load_format=dummy)."""
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
    with open(os.path.join(model_dir, "config.json")) as f:
        layers = int(json.load(f).get("num_hidden_layers", 0))
    attn = ("q_proj", "k_proj", "v_proj", "o_proj")
    return [f"model.layers.{i}.{'self_attn' if p in attn else 'mlp'}.{p}.weight"
            for i in range(layers) for p in PROJECTIONS] + ["lm_head.weight"]


def describe_checkpoint(model_dir: str) -> Optional[QuantDescription]:
    """The description vllm-ascend should use for `model_dir`, or None to keep upstream's
    (a ModelSlim checkpoint with its own quant_model_description.json)."""
    if os.path.exists(os.path.join(model_dir, DESCRIPTION_FILE)):
        return None
    qcfg = read_hf_quant_config(model_dir)
    if qcfg is None:
        return profile_free_description().fill(checkpoint_weight_names(model_dir))
    method = qcfg.get("quant_method")
    if method == "compressed-tensors" or "config_groups" in qcfg:
        return compressed_tensors_description(
            qcfg, where=f"{os.path.join(model_dir, 'config.json')}: quantization_config"
        ).fill(checkpoint_weight_names(model_dir))
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
