"""Test checkpoint writers (offline; nothing is downloaded).

`write_w8a8_compressed_tensors(bf16_dir, out_dir)` turns a bf16 HF checkpoint into a
RedHatAI-style compressed-tensors W8A8 checkpoint, the way llm-compressor's
`QuantizationModifier(targets="Linear", scheme="W8A8", ignore=[...])` writes one:

* every Linear weight of every decoder layer that `ignore` does not name gets int8 symmetric
  per-output-channel weights (`weight` int8 [out, in], `weight_scale` [out, 1] in the model dtype),
  computed and compressed with the compressed-tensors library (`calculate_qparams` and the
  "int-quantized" `IntQuantizationCompressor`). Dense: q/k/v/o and gate/up/down. MoE (Qwen3-MoE,
  Qwen2-MoE): q/k/v/o and every expert's `mlp.experts.E.{gate,up,down}_proj` (and a shared
  expert's projections);
* activations are declared int8 symmetric dynamic per-token (nothing stored for them);
* `ignore` is `["lm_head"]` for a dense model and `["lm_head", "re:.*mlp.gate$"]` for a MoE one
  (plus `"re:.*mlp.shared_expert_gate$"` when the model has that gate): the MoE router stays in
  the model dtype, as in llm-compressor's MoE recipes, e.g. `examples/awq/qwen3_moe_example.py`
  and `examples/quantization_w4a4_fp4/qwen_30b_a3b.py` (Qwen3-30B-A3B) and the INT8 W8A8 MoE
  example `examples/quantizing_moe/deepseek_moe_w8a8_int8.py` ("since the MoE gate layers are
  sensitive to quantization, we add them to the ignore list"); Qwen1.5-MoE's
  `examples/quantizing_moe/qwen_example.py` adds `re:.*mlp.shared_expert_gate$`.
  Embeddings, norms, biases and the ignored weights are copied byte for byte;
* optionally (default on) a SmoothQuant-style smoothing is folded in first, as llm-compressor's
  SmoothQuantModifier does for the RedHatAI checkpoints. Dense layers: input_layernorm -> q/k/v,
  post_attention_layernorm -> gate/up and up -> down. That makes the layernorms of the w8a8
  checkpoint differ from the bf16 ones, which is exactly what FlashRL's int8 profile measures.
  MoE layers: input_layernorm -> q/k/v ONLY. llm-compressor's mappings for Qwen2/Qwen3-MoE
  (`QWEN_MOE_SMOOTHQUANT_MAPPINGS` in `modifiers/transform/smoothquant/utils.py`, added in
  llm-compressor PR #2609, commit 077b0bf) smooth the attention input alone, as its Mixtral and
  DeepSeek-V2 mappings do: "MLP smoothing (post_attention_layernorm) is intentionally omitted for
  MoE. A single smoothing scale across all experts causes inter-expert imbalance, degrading PPL
  even with the router gate properly balanced." (post_attention_layernorm also feeds the router,
  which is not quantized.) So the MoE post_attention_layernorm and all expert weights are left
  as they are before quantization.

The output is sharded one decoder layer per safetensors file (plus one for everything else) with a
`model.safetensors.index.json`, so readers are exercised on multi-shard checkpoints. Tokenizer and
other side files are copied. transformers loads the result through its compressed-tensors
integration.
"""
from __future__ import annotations

import json
import os
import re
import shutil
from typing import Dict, List, Optional

import torch

from npu_flashrl.adapters.vllm_ascend.description import matches_ignore

_LAYER_RE = re.compile(r"^(.*\.layers\.\d+)\.")
DENSE_IGNORE = ("lm_head",)
MOE_IGNORE = ("lm_head", "re:.*mlp.gate$")
SHARED_EXPERT_GATE_IGNORE = "re:.*mlp.shared_expert_gate$"


def is_moe_checkpoint(weight_names) -> bool:
    return any(".mlp.experts." in n for n in weight_names)


def default_ignore(weight_names) -> List[str]:
    """llm-compressor's ignore list for this checkpoint (see the module doc for the recipes)."""
    names = list(weight_names)
    if not is_moe_checkpoint(names):
        return list(DENSE_IGNORE)
    ignore = list(MOE_IGNORE)
    if any(".mlp.shared_expert_gate." in n for n in names):
        ignore.append(SHARED_EXPERT_GATE_IGNORE)
    return ignore


def w8a8_quantization_config(ignore=DENSE_IGNORE) -> dict:
    """The `quantization_config` of a RedHatAI `*-quantized.w8a8` checkpoint (compressed-tensors)."""
    from compressed_tensors.quantization import (QuantizationArgs, QuantizationConfig,
                                                 QuantizationScheme, QuantizationStatus)

    scheme = QuantizationScheme(
        targets=["Linear"],
        weights=QuantizationArgs(num_bits=8, type="int", symmetric=True, strategy="channel",
                                 dynamic=False, observer="minmax"),
        input_activations=QuantizationArgs(num_bits=8, type="int", symmetric=True,
                                           strategy="token", dynamic=True, observer=None),
    )
    cfg = QuantizationConfig(config_groups={"group_0": scheme}, format="int-quantized",
                             ignore=list(ignore), quantization_status=QuantizationStatus.COMPRESSED)
    return cfg.model_dump(mode="json")


def _tensor_index(model_dir: str) -> Dict[str, str]:
    """name -> safetensors file (absolute path) for a HF checkpoint dir."""
    from safetensors import safe_open

    index_path = os.path.join(model_dir, "model.safetensors.index.json")
    if os.path.exists(index_path):
        with open(index_path) as f:
            weight_map = json.load(f)["weight_map"]
        return {k: os.path.join(model_dir, v) for k, v in weight_map.items()}
    files = sorted(f for f in os.listdir(model_dir) if f.endswith(".safetensors"))
    if not files:
        raise FileNotFoundError(f"{model_dir}: no *.safetensors files")
    out = {}
    for fname in files:
        path = os.path.join(model_dir, fname)
        with safe_open(path, framework="pt") as f:
            for k in f.keys():
                out[k] = path
    return out


def _smoothing(act_proxy: torch.Tensor, weights: List[torch.Tensor], alpha: float) -> torch.Tensor:
    """SmoothQuant factor s per input channel: s = a^alpha / w^(1-alpha) (weights' columns * s)."""
    w_max = torch.stack([w.float().abs().amax(dim=0) for w in weights]).amax(dim=0)
    a = act_proxy.float().abs().clamp(min=1e-5)
    s = a.pow(alpha) / w_max.clamp(min=1e-5).pow(1.0 - alpha)
    return s / s.mean()  # keep magnitudes in a sensible range


def _smooth_layer(t: Dict[str, torch.Tensor], prefix: str, alpha: float) -> None:
    """Fold SmoothQuant smoothing into one decoder layer's tensors (in place in dict `t`).

    A sparse (MoE) layer is smoothed on the attention input only (module doc: llm-compressor's
    QWEN_MOE_SMOOTHQUANT_MAPPINGS); a dense layer of a MoE model (`mlp_only_layers`) like any
    dense layer."""
    def w(n):
        return f"{prefix}.{n}.weight"

    ln_in, ln_post = f"{prefix}.input_layernorm.weight", f"{prefix}.post_attention_layernorm.weight"
    groups = [(ln_in, [w("self_attn.q_proj"), w("self_attn.k_proj"), w("self_attn.v_proj")])]
    if is_moe_checkpoint(t):
        for ln, linears in groups:
            _smooth_group(t, ln, linears, alpha)
        return
    groups.append((ln_post, [w("mlp.gate_proj"), w("mlp.up_proj")]))
    for ln, linears in groups:
        _smooth_group(t, ln, linears, alpha)
    up, down = w("mlp.up_proj"), w("mlp.down_proj")
    if up in t and down in t:
        # up rows scaled by 1/s, down columns by s: silu(gate) * up is linear in up's output.
        s = _smoothing(t[up].float().abs().amax(dim=1), [t[down]], alpha)
        t[up] = (t[up].float() / s.view(-1, 1)).to(t[up].dtype)
        t[down] = (t[down].float() * s.view(1, -1)).to(t[down].dtype)
        bias = f"{prefix}.mlp.up_proj.bias"
        if bias in t:
            t[bias] = (t[bias].float() / s).to(t[bias].dtype)


def _smooth_group(t: Dict[str, torch.Tensor], ln: str, linears: List[str], alpha: float) -> None:
    """Divide layernorm `ln` by s and multiply the columns of the `linears` it feeds by s."""
    if ln not in t or not all(n in t for n in linears):
        return
    dtype = t[ln].dtype
    s = _smoothing(t[ln], [t[n] for n in linears], alpha)
    t[ln] = (t[ln].float() / s).to(dtype)
    for n in linears:
        t[n] = (t[n].float() * s.view(1, -1)).to(t[n].dtype)


def _linear_weights(t: Dict[str, torch.Tensor], prefix: str, ignore) -> List[str]:
    """The decoder layer's Linear weights to quantize (`targets: Linear` minus `ignore`): every
    2-D `<module>.weight` under `prefix` (norms and biases are 1-D) whose module is not ignored."""
    out = []
    for name, tensor in t.items():
        if not (name.startswith(prefix + ".") and name.endswith(".weight")) or tensor.dim() != 2:
            continue
        if not matches_ignore(name[: -len(".weight")], ignore):
            out.append(name)
    return sorted(out)


def _quantize_layer(t: Dict[str, torch.Tensor], prefix: str,
                    ignore=DENSE_IGNORE) -> Dict[str, torch.Tensor]:
    """int8 per-channel symmetric weights + weight_scale via compressed-tensors' compressor."""
    from compressed_tensors.quantization import QuantizationArgs, QuantizationConfig, QuantizationScheme
    from compressed_tensors.quantization.utils import calculate_qparams

    qcfg = QuantizationConfig.model_validate(w8a8_quantization_config(ignore))
    scheme: QuantizationScheme = qcfg.config_groups["group_0"]
    wargs: QuantizationArgs = scheme.weights

    state, names_to_scheme = {}, {}
    for name in _linear_weights(t, prefix, ignore):
        module = name[: -len(".weight")]
        weight = t[name]
        min_vals = weight.amin(dim=1, keepdim=True)
        max_vals = weight.amax(dim=1, keepdim=True)
        scale, zero_point = calculate_qparams(min_vals, max_vals, wargs)
        state[name] = weight
        state[f"{module}.weight_scale"] = scale.to(weight.dtype)  # [out, 1], model dtype
        state[f"{module}.weight_zero_point"] = zero_point
        names_to_scheme[module] = scheme
    compressed = _compress_int8(qcfg, state, names_to_scheme)
    out = {k: v for k, v in t.items() if k not in state}
    out.update(compressed)
    return out


def _compress_int8(qcfg, state: dict, names_to_scheme: dict) -> dict:
    """compressed-tensors' int-quantized compressor on `state` (module.weight / weight_scale /
    weight_zero_point by full name): older releases have an instance API over the whole state
    dict, newer a per-module classmethod on local names. Returns the compressed tensors by full
    name."""
    import inspect

    from compressed_tensors.compressors import IntQuantizationCompressor

    if "names_to_scheme" in inspect.signature(IntQuantizationCompressor.compress).parameters:
        return IntQuantizationCompressor(config=qcfg).compress(state, names_to_scheme=names_to_scheme)
    out = {}
    for module, scheme in names_to_scheme.items():
        local = {k[len(module) + 1:]: v for k, v in state.items() if k.startswith(module + ".")}
        out.update({f"{module}.{k}": v
                    for k, v in IntQuantizationCompressor.compress(local, scheme).items()})
    return out


def write_w8a8_compressed_tensors(bf16_dir: str, out_dir: str, smooth: bool = True,
                                  smooth_alpha: float = 0.5, ignore: Optional[List[str]] = None) -> str:
    """Write a RedHatAI-style compressed-tensors W8A8 checkpoint of `bf16_dir` into `out_dir`.

    `ignore` (compressed-tensors module names / "re:" patterns) defaults to llm-compressor's list
    for the model (`default_ignore`: lm_head, and for MoE the router and shared-expert gate)."""
    from safetensors import safe_open
    from safetensors.torch import save_file

    index = _tensor_index(bf16_dir)
    if ignore is None:
        ignore = default_ignore(index)
    os.makedirs(out_dir, exist_ok=True)

    groups: Dict[Optional[str], List[str]] = {}
    for name in index:
        m = _LAYER_RE.match(name)
        groups.setdefault(m.group(1) if m else None, []).append(name)
    layer_prefixes = sorted((p for p in groups if p is not None),
                            key=lambda p: (p.rsplit(".", 1)[0], int(p.rsplit(".", 1)[1])))
    order: List[Optional[str]] = [None] + layer_prefixes if None in groups else layer_prefixes
    n_files = len(order)

    weight_map = {}
    for i, prefix in enumerate(order):
        tensors = {}
        for name in groups[prefix]:
            with safe_open(index[name], framework="pt") as f:
                tensors[name] = f.get_tensor(name)
        if prefix is not None:
            if smooth:
                _smooth_layer(tensors, prefix, smooth_alpha)
            tensors = _quantize_layer(tensors, prefix, ignore)
        fname = f"model-{i + 1:05d}-of-{n_files:05d}.safetensors"
        save_file({k: v.contiguous() for k, v in tensors.items()}, os.path.join(out_dir, fname),
                  metadata={"format": "pt"})
        weight_map.update({k: fname for k in tensors})

    total = 0
    for fname in set(weight_map.values()):
        total += os.path.getsize(os.path.join(out_dir, fname))
    with open(os.path.join(out_dir, "model.safetensors.index.json"), "w") as f:
        json.dump({"metadata": {"total_size": total}, "weight_map": dict(sorted(weight_map.items()))},
                  f, indent=2)

    with open(os.path.join(bf16_dir, "config.json")) as f:
        config = json.load(f)
    config["quantization_config"] = w8a8_quantization_config(ignore)
    with open(os.path.join(out_dir, "config.json"), "w") as f:
        json.dump(config, f, indent=2)

    for fname in os.listdir(bf16_dir):
        src = os.path.join(bf16_dir, fname)
        if (fname.endswith(".safetensors") or fname in ("config.json", "model.safetensors.index.json")
                or not os.path.isfile(src)):
            continue
        shutil.copy2(src, os.path.join(out_dir, fname))
    return out_dir


def tiny_checkpoint_pair(root: str, seed: int = 0, smooth: bool = True,
                         config_overrides: Optional[dict] = None, moe: bool = False):
    """(bf16_dir, w8a8_dir) of a tiny Qwen2 (`moe`: Qwen3-MoE) under `root`, built once (reused
    when present)."""
    from npu_flashrl.sim import tiny_models

    build = tiny_models.build_tiny_qwen3_moe if moe else tiny_models.build_tiny_qwen2
    bf16_dir = os.path.join(root, "bf16")
    w8a8_dir = os.path.join(root, "w8a8")
    if not os.path.exists(os.path.join(bf16_dir, "config.json")):
        build(bf16_dir, torch.bfloat16, seed, config_overrides=config_overrides)
    if not os.path.exists(os.path.join(w8a8_dir, "config.json")):
        write_w8a8_compressed_tensors(bf16_dir, w8a8_dir, smooth=smooth)
    return bf16_dir, w8a8_dir


def tiny_moe_checkpoint_pair(root: str, seed: int = 0, smooth: bool = True,
                             config_overrides: Optional[dict] = None):
    """`tiny_checkpoint_pair` of a tiny Qwen3-MoE."""
    return tiny_checkpoint_pair(root, seed, smooth, config_overrides, moe=True)


def write_w4a8_description(bf16_dir: str, out_dir: str, group_size: int) -> str:
    """`out_dir`: the files of the bf16 checkpoint `bf16_dir` (symlinked) beside a ModelSlim-format
    `quant_model_description.json` that types every dense projection weight W4A8_DYNAMIC with
    `group_size` and everything else FLOAT: vllm-ascend then builds W4A8_DYNAMIC linear layers,
    and the cold load quantizes the float projections into what a ModelSlim W4A8 checkpoint carries."""
    from npu_flashrl.quant.projections import is_dense_projection

    os.makedirs(out_dir, exist_ok=True)
    for f in os.listdir(bf16_dir):
        src = os.path.join(bf16_dir, f)
        if os.path.isfile(src) and f != "quant_model_description.json":
            os.symlink(os.path.abspath(src), os.path.join(out_dir, f))
    desc = {"model_quant_type": "W4A8_DYNAMIC", "group_size": int(group_size)}
    for name in _tensor_index(bf16_dir):
        desc[name] = "W4A8_DYNAMIC" if is_dense_projection(name) else "FLOAT"
    with open(os.path.join(out_dir, "quant_model_description.json"), "w") as f:
        json.dump(desc, f, indent=1)
    return out_dir
