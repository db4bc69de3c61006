"""What a weight sync writes into: the model's quantized linear layers (vllm-ascend W8A8 /
W8A8_DYNAMIC, possibly fused) by HF projection name. The fused-MoE experts are `experts.py`.
Both kinds answer `path`, `layer`, `full_shape(name)`, `holds(name)` and `weight_device()`, which is all the
validation and the staging of a sync ask of a target."""
from __future__ import annotations

import dataclasses
from typing import Dict, Tuple

import torch

from npu_flashrl.adapters.vllm_ascend import layout as _layout
from npu_flashrl.adapters.vllm_ascend.description import UnsupportedScheme


@dataclasses.dataclass
class LinearTarget:
    """One quantized vLLM linear layer (possibly fused) and how HF shards map into it."""
    path: str
    layer: torch.nn.Module
    shards: Tuple[str, ...]           # HF projection names in fused order, e.g. (q_proj, k_proj, v_proj)
    shard_ids: Tuple[object, ...]     # what the layer's weight_loader calls them ('q', 0, None ...)
    full_shapes: Tuple[Tuple[int, int], ...]
    static: bool                      # AscendW8A8LinearMethod (static activations)

    def hf_name(self, shard: str) -> str:
        return f"{self.path.rsplit('.', 1)[0]}.{shard}.weight"

    def full_shape(self, name: str) -> Tuple[int, int]:
        return self.full_shapes[self.shards.index(self.shard_of(name))]

    def holds(self, name: str) -> bool:
        """Every rank holds a part of every linear layer (TP narrows inside the loader)."""
        return True

    def weight_device(self) -> torch.device:
        return self.layer.weight.device

    def shard_names(self) -> Tuple[str, ...]:
        """The HF names one complete write of this layer needs."""
        return tuple(self.hf_name(s) for s in self.shards)

    @staticmethod
    def shard_of(hf_name: str) -> str:
        """'model.layers.0.self_attn.q_proj.weight' -> 'q_proj'."""
        return hf_name.rsplit(".", 2)[-2]


def inner_method(layer):
    """The vllm-ascend scheme object behind a layer's quant method wrapper (None: unquantized)."""
    return getattr(getattr(layer, "quant_method", None), "quant_method", None)


def _full_shapes(layer, shards) -> Tuple[Tuple[int, int], ...]:
    in_full = layer.input_size
    if hasattr(layer, "total_num_heads"):  # QKVParallelLinear
        q = layer.total_num_heads * layer.head_size
        kv = layer.total_num_kv_heads * layer.head_size
        return ((q, in_full), (kv, in_full), (kv, in_full))
    if hasattr(layer, "output_sizes") and len(shards) > 1:
        return tuple((o, in_full) for o in layer.output_sizes)
    return ((layer.output_size, in_full),)


def find_targets(model: torch.nn.Module) -> Dict[str, LinearTarget]:
    """Map every HF projection weight name to its quantized vLLM layer."""
    layout = _layout.current()
    static_cls, dynamic_cls = layout.method_classes()
    wrapper_cls = layout.linear_wrapper_class()
    packed = dict(getattr(model, "packed_modules_mapping", {}) or {})
    targets: Dict[str, LinearTarget] = {}
    for path, module in model.named_modules():
        inner = inner_method(module)
        if not isinstance(inner, (static_cls, dynamic_cls)):
            if inner is not None and isinstance(getattr(module, "quant_method", None), wrapper_cls):
                # refused at attach (engine build): otherwise its projections would pass through
                # to vLLM's loaders and float weights would land in int8 parameters
                raise UnsupportedScheme(f"{path}: {layout.unsupported_reason(inner)}")
            continue
        short = path.rsplit(".", 1)[-1]
        shards = tuple(packed.get(short, [short]))
        if hasattr(module, "total_num_heads"):
            ids: Tuple[object, ...] = ("q", "k", "v")
        elif len(shards) > 1:
            ids = tuple(range(len(shards)))
        else:
            ids = (None,)
        t = LinearTarget(path, module, shards, ids, _full_shapes(module, shards),
                         isinstance(inner, static_cls))
        for shard in shards:
            targets[t.hf_name(shard)] = t
    return targets
