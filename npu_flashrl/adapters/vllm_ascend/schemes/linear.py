"""What vllm-ascend's W8A8 linear schemes share: the layer (possibly fused: q/k/v, gate/up) a sync
writes into, its HF shards, and its staging. After post-processing both hold an int8 weight
[in, out] (NZ on the NPU) and a per-output-channel `weight_scale`; they differ in what they
derive from it (`w8a8_dynamic`, `w8a8_static`)."""
from __future__ import annotations

import dataclasses
from typing import Dict, List, Sequence, Tuple

import torch

from npu_flashrl.adapters.vllm_ascend.schemes.base import (
    LINEAR, PER_CHANNEL_INT8, LayerStaging, Scheme, stage_param)
from npu_flashrl.adapters.vllm_ascend.schemes.registry import find_targets
from npu_flashrl import kernels
from npu_flashrl.quant import WeightSyncError

@dataclasses.dataclass
class LinearTarget:
    """One quantized vLLM linear layer (possibly fused) and how HF shards map into it."""
    path: str
    layer: torch.nn.Module
    shards: Tuple[str, ...]           # HF projection names in fused order, e.g. (q_proj, k_proj, v_proj)
    shard_ids: Tuple[object, ...]     # what the layer's weight_loader calls them ('q', 0, None ...)
    full_shapes: Tuple[Tuple[int, int], ...]
    scheme: "LinearScheme"

    @property
    def static(self) -> bool:
        """Static activations (AscendW8A8LinearMethod)."""
        return self.scheme.static

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

def _full_shapes(layer, shards) -> Tuple[Tuple[int, int], ...]:
    in_full = layer.input_size
    if hasattr(layer, "total_num_heads"):  # QKVParallelLinear
        q = layer.total_num_heads * layer.head_size
        kv = layer.total_num_kv_heads * layer.head_size
        return ((q, in_full), (kv, in_full), (kv, in_full))
    if hasattr(layer, "output_sizes") and len(shards) > 1:
        return tuple((o, in_full) for o in layer.output_sizes)
    return ((layer.output_size, in_full),)

class LinearShardStaging(LayerStaging):
    """What every staging of a (fused) linear layer shares: one HF shard goes through the layer's
    own `weight_loader` (TP narrowing, the fused q/k/v and gate/up offsets are upstream's) into
    the staged parameters, and the layer is complete once every shard arrived."""

    def load_shard(self, name: str, *pairs) -> None:
        """Load shard `name`'s tensors, `pairs` of (staged parameter, tensor as the checkpoint
        holds it), with the layer's weight_loader under the shard's id; a tensor that does not
        fit is refused naming it."""
        t = self.target
        shard = t.shard_of(name)
        sid = t.shard_ids[t.shards.index(shard)]
        args = () if sid is None else (sid,)
        loader = t.layer.weight_loader
        try:
            for param, tensor in pairs:
                loader(param, tensor, *args)
        except AssertionError as exc:
            raise WeightSyncError(f"{name}: does not fit {t.path} ({exc})") from None
        self.received.add(shard)

    def complete(self) -> bool:
        return len(self.received) == len(self.target.shards)

    def missing(self) -> List[str]:
        return [self.target.hf_name(s) for s in self.target.shards if s not in self.received]


class LinearStaging(LinearShardStaging):
    """A (fused) linear layer: q/k/v or gate/up shards, or a single projection. `received` holds
    the shard names (q_proj ...).

    `in_place` (the INT8 wire's pairs: final int8 values, checked before they are staged): each
    shard is written by the layer's weight_loader straight into the live weight, whose processed
    [in, out] storage it sees as [out, in], so every int8 byte is written once and no buffer of
    the fused layer is held; `commit()` then writes only the scales and derived tensors. The
    live layer holds new and old shards until it is complete, so the sync counts it as written
    (`SyncLoad.stage_payload`): a failure from then on makes the model refuse to
    generate. Otherwise (online quantization) shards wait in a processed-layout buffer and the
    commit copies it in, so a refused sync leaves the layer untouched."""

    def __init__(self, target: LinearTarget, with_scale: bool, in_place: bool = False):
        super().__init__(target)
        layer = target.layer
        w = layer.weight  # processed: [in_part, out_part]
        # In place only into ND storage: an NZ-cast weight (the pinned line casts every W8A8
        # weight; the current line when VLLM_ASCEND_ENABLE_NZ is on) keeps its bytes in fractal
        # blocks, so a narrowed [out, in] view of it is not the rows a shard fills; it takes the
        # buffered path's one whole-tensor copy, which torch_npu converts.
        self.in_place = in_place and kernels.storage_format(w.data) == kernels.ACL_FORMAT_ND
        if self.in_place:
            # the live storage itself, seen as the unprocessed [out, in] parameter
            self.weight = stage_param(w.data.t(), w)
        else:
            # [out, in] view of an [in, out] buffer: upstream's loader narrows it like the
            # unprocessed parameter, while the bytes already sit in the processed layout.
            buf = torch.empty(w.shape, dtype=torch.int8, device=w.device)
            self.weight = stage_param(buf.t(), w)
        self.scale = None
        if with_scale:  # the profile quantizer keeps the checkpoint's scales
            self.scale = stage_param(torch.empty((w.shape[1], 1), dtype=torch.float32,
                                                 device=w.device), layer.weight_scale)

    def stage(self, name, payload) -> None:
        q, scale = payload.q, payload.scale
        pairs = [(self.weight, q)]
        if scale is not None:
            pairs.append((self.scale, scale.unsqueeze(1)))
        self.load_shard(name, *pairs)

    def buffers(self):
        weight = () if self.in_place else (self.weight.data,)  # in place: the live weight
        return weight + (() if self.scale is None else (self.scale.data,))

    @torch.no_grad()
    def commit(self) -> None:
        layer = self.target.layer
        if not self.in_place:
            # In place: the processed [in, out] (NZ on NPU) storage keeps its address; the
            # staging buffer is already [in, out], so this is a straight copy.
            layer.weight.data.copy_(self.weight.data.t())
        if self.scale is not None:
            s = self.scale.data.flatten()
            layer.weight_scale.data.copy_(s.to(layer.weight_scale.dtype))
            self.target.scheme.commit_derived(layer)

class LinearScheme(Scheme):
    """A vllm-ascend W8A8 linear scheme: targets are its (fused) linear layers by HF shard."""
    static = False
    wire = PER_CHANNEL_INT8

    def targets(self, model: torch.nn.Module, layers: Sequence[Tuple[str, torch.nn.Module]]
                ) -> Dict[str, LinearTarget]:
        packed = dict(getattr(model, "packed_modules_mapping", {}) or {})
        targets: Dict[str, LinearTarget] = {}
        for path, module in layers:
            short = path.rsplit(".", 1)[-1]
            shards = tuple(packed.get(short, [short]))
            if hasattr(module, "total_num_heads"):
                ids: Tuple[object, ...] = ("q", "k", "v")
            elif len(shards) > 1:
                ids = tuple(range(len(shards)))
            else:
                ids = (None,)
            t = LinearTarget(path, module, shards, ids, _full_shapes(module, shards), self)
            for shard in shards:
                targets[t.hf_name(shard)] = t
        return targets

    def new_staging(self, target, with_scale: bool, in_place: bool = False) -> LinearStaging:
        return LinearStaging(target, with_scale, in_place)

def find_linear_targets(model: torch.nn.Module) -> Dict[str, LinearTarget]:
    """Every HF projection weight name -> its quantized vLLM linear layer."""
    return find_targets(model, LINEAR)

