"""In-place, bucket-safe INT8 weight reload for vllm-ascend's W8A8 linear layers.

`Int8WeightLoader` replaces `model.load_weights`. Before `process_weights_after_loading` (cold
load) it quantizes the stream and hands it to vLLM's own loaders. After it, it stages this rank's
shard of each fused layer (q/k/v, gate/up) through the layer's own weight loader into a small int8
buffer, and once all shards of that layer arrived in this sync it writes them, transposed, into
the processed [in, out] parameter IN PLACE, plus the scale and every derived copy (asked of the
line's `layout`). No new parameter storage, no second post-processing, data pointers unchanged.
The quantizers (how a full-precision tensor becomes int8) are `npu_flashrl.quant`.
"""
from __future__ import annotations

import dataclasses
from typing import Dict, Iterable, List, Optional, Set, Tuple

import torch

from npu_flashrl._logging import get_logger
from npu_flashrl.adapters.vllm_ascend import layout as _layout
from npu_flashrl.quant import OnlineQuantizer, WeightSyncError

logger = get_logger("vllm_ascend")

@dataclasses.dataclass
class _Target:
    """One quantized vLLM linear layer (possibly fused) and how HF shards map into it."""
    path: str
    layer: torch.nn.Module
    shards: Tuple[str, ...]           # HF projection names in fused order, e.g. (q_proj, k_proj, v_proj)
    shard_ids: Tuple[object, ...]     # what the layer's weight_loader calls them ('q', 0, None ...)
    full_shapes: Tuple[Tuple[int, int], ...]
    static: bool                      # AscendW8A8LinearMethod (static activations)

    def hf_name(self, shard: str) -> str:
        return f"{self.path.rsplit('.', 1)[0]}.{shard}.weight"

    @staticmethod
    def shard_of(hf_name: str) -> str:
        """'model.layers.0.self_attn.q_proj.weight' -> 'q_proj'."""
        return hf_name.rsplit(".", 2)[-2]


@dataclasses.dataclass
class _Staging:
    target: _Target
    weight: torch.nn.Parameter        # int8 [out_part, in_part] view of [in_part, out_part] memory
    scale: Optional[torch.nn.Parameter]
    received: Set[str] = dataclasses.field(default_factory=set)


def _inner_method(layer):
    qm = getattr(layer, "quant_method", None)
    return getattr(qm, "quant_method", None)


def _full_shapes(layer, shards) -> Tuple[Tuple[int, int], ...]:
    in_full = layer.input_size
    if hasattr(layer, "total_num_heads"):  # QKVParallelLinear
        q = layer.total_num_heads * layer.head_size
        kv = layer.total_num_kv_heads * layer.head_size
        return ((q, in_full), (kv, in_full), (kv, in_full))
    if hasattr(layer, "output_sizes") and len(shards) > 1:
        return tuple((o, in_full) for o in layer.output_sizes)
    return ((layer.output_size, in_full),)


def find_targets(model: torch.nn.Module) -> Dict[str, _Target]:
    """Map every HF projection weight name to its quantized vLLM layer."""
    static_cls, dynamic_cls = _layout.current().method_classes()
    packed = dict(getattr(model, "packed_modules_mapping", {}) or {})
    targets: Dict[str, _Target] = {}
    for path, module in model.named_modules():
        inner = _inner_method(module)
        if not isinstance(inner, (static_cls, dynamic_cls)):
            continue
        short = path.rsplit(".", 1)[-1]
        shards = tuple(packed.get(short, [short]))
        if hasattr(module, "total_num_heads"):
            ids: Tuple[object, ...] = ("q", "k", "v")
        elif len(shards) > 1:
            ids = tuple(range(len(shards)))
        else:
            ids = (None,)
        t = _Target(path, module, shards, ids, _full_shapes(module, shards),
                    isinstance(inner, static_cls))
        for shard in shards:
            targets[t.hf_name(shard)] = t
    return targets


def _stage_param(data: torch.Tensor, template: torch.nn.Parameter) -> torch.nn.Parameter:
    """A buffer in the unprocessed layout that the layer's own weight_loader can fill: it carries
    the template's sharding attributes (output_dim / input_dim), so TP narrowing is upstream's."""
    p = torch.nn.Parameter(data, requires_grad=False)
    for attr in ("output_dim", "input_dim", "packed_dim", "packed_factor"):
        if hasattr(template, attr):
            setattr(p, attr, getattr(template, attr))
    return p


class Int8WeightLoader:
    """The INT8 rollout model's `load_weights`: quantizes incoming HF tensors online.

    One instance per vLLM model. A *sync* is everything between two `end_sync()` calls; it may
    arrive as any number of `load_weights` calls in any split and order.
    """

    def __init__(self, model: torch.nn.Module, quantizer: OnlineQuantizer, original_load_weights):
        self.model = model
        self.quantizer = quantizer
        self._original = original_load_weights
        self.targets = find_targets(model)
        self._pending: Dict[str, _Staging] = {}
        self._params = dict(model.named_parameters())
        self._packed = dict(getattr(model, "packed_modules_mapping", {}) or {})

    # ------------------------------------------------------------------ public API
    def processed(self) -> bool:
        layers = {id(t.layer): t.layer for t in self.targets.values()}
        return bool(layers) and all(getattr(l, "_npu_flashrl_processed", False) for l in layers.values())

    def load_weights(self, weights: Iterable[Tuple[str, torch.Tensor]]) -> Set[str]:
        if not self.processed():
            return self._original(self._cold_stream(weights))
        if isinstance(weights, dict):
            weights = list(weights.items())
        checked = isinstance(weights, (list, tuple))
        if checked:
            for name, tensor in weights:  # refuse a bad call before writing anything of it
                self._validate(name, tensor)
        loaded: Set[str] = set()
        passthrough: List[Tuple[str, torch.Tensor]] = []
        try:
            for name, tensor in weights:
                # streamed: the quantizer finds NaN/Inf in projections during its own pass
                self._validate(name, tensor, values=not checked and name not in self.targets)
                target = self.targets.get(name)
                if target is None:
                    passthrough.append((name, self.quantizer.transform(name, tensor)))
                    continue
                self._stage(target, name, tensor)
                loaded.add(name)
                if len(self._pending[target.path].received) == len(target.shards):
                    self._commit(target)
            if passthrough:
                loaded |= set(self._load_float(passthrough))
                self._refresh_static_biases(n for n, _ in passthrough)
        except Exception:
            # Staged (uncommitted) shards of this sync are dropped: live weights stay as they were.
            self._pending.clear()
            raise
        return loaded

    def end_sync(self) -> List[str]:
        """End the current sync. Raises WeightSyncError listing shards that never arrived (the
        layers they belong to keep their previous weights)."""
        missing = []
        for st in self._pending.values():
            missing += [st.target.hf_name(s) for s in st.target.shards if s not in st.received]
        self._pending.clear()
        if missing:
            raise WeightSyncError(
                f"weight sync ended with {len(missing)} shard(s) missing: {missing[:8]}"
                f"{' ...' if len(missing) > 8 else ''}; those layers keep their previous weights")
        return missing

    def pending(self) -> Dict[str, List[str]]:
        return {p: sorted(st.received) for p, st in self._pending.items()}

    # ------------------------------------------------------------------ cold load
    def _cold_stream(self, weights):
        """Before post-processing: quantize float projections in the stream for vLLM's loaders;
        a w8a8 checkpoint's int8 weights pass through and get the zero weight_offset vllm-ascend
        expects (compressed-tensors has none)."""
        for name, tensor in weights:
            target = self.targets.get(name)
            if target is not None and tensor.is_floating_point():
                self._validate(name, tensor, values=False)  # the quantizer checks values
                q, scale = self.quantizer.quantize(name, tensor)
                yield name, q
                if scale is not None:
                    yield name[: -len("weight")] + "weight_scale", scale.unsqueeze(1)
                    yield name[: -len("weight")] + "weight_offset", torch.zeros_like(scale).unsqueeze(1)
                continue
            if name.endswith(".weight_scale") and name[: -len("_scale")] in self.targets:
                yield name, tensor
                offset_name = name[: -len("weight_scale")] + "weight_offset"
                yield offset_name, torch.zeros_like(tensor)
                continue
            yield name, self.quantizer.transform(name, tensor)

    # ------------------------------------------------------------------ reload
    def _validate(self, name: str, tensor, values: bool = True) -> None:
        """Refuse a tensor by name: type, dtype, shape, and (with `values`) NaN/Inf."""
        if not isinstance(tensor, torch.Tensor):
            raise WeightSyncError(f"{name}: expected a torch.Tensor, got {type(tensor).__name__}")
        target = self.targets.get(name)
        if target is not None:
            if not tensor.is_floating_point():
                raise WeightSyncError(f"{name}: expected a floating-point tensor (bf16/fp16/fp32) "
                                      f"to quantize online, got {tensor.dtype}")
            want = target.full_shapes[target.shards.index(_Target.shard_of(name))]
            if tuple(tensor.shape) != tuple(want):
                raise WeightSyncError(f"{name}: expected shape {tuple(want)}, got {tuple(tensor.shape)}")
        else:
            if self._resolve_param(name) is None:
                raise WeightSyncError(f"{name}: no such parameter in the rollout model")
            if not (tensor.is_floating_point() or tensor.dtype == torch.bool):
                raise WeightSyncError(f"{name}: expected a floating-point tensor, got {tensor.dtype}")
        if values and tensor.is_floating_point() and tensor.numel() and not _all_finite(tensor):
            raise WeightSyncError(f"{name}: contains NaN or Inf; refusing the sync")

    def _resolve_param(self, name: str) -> Optional[str]:
        if name in self._params:
            return name
        if name.endswith("rotary_emb.inv_freq"):
            return name
        for fused, shards in self._packed.items():
            for s in shards:
                if f".{s}." in name:
                    fused_name = name.replace(f".{s}.", f".{fused}.")
                    if fused_name in self._params:
                        return fused_name
        if name == "lm_head.weight" and getattr(getattr(self.model, "config", None),
                                                "tie_word_embeddings", False):
            return name
        return None

    def _stage(self, target: _Target, name: str, tensor: torch.Tensor) -> None:
        shard = _Target.shard_of(name)
        idx = target.shards.index(shard)
        try:
            # int8 produced in [in, out] memory: the processed layout, so the commit is a memcpy
            q, scale = self.quantizer.quantize(name, tensor, transposed=True)
        except ValueError as exc:
            raise WeightSyncError(f"{name}: {exc}; refusing the sync") from None
        st = self._pending.get(target.path)
        layer = target.layer
        if st is None:
            w = layer.weight  # processed: [in_part, out_part]
            # [out, in] view of an [in, out] buffer: upstream's loader narrows it like the
            # unprocessed parameter, while the bytes already sit in the processed layout.
            buf = torch.empty(w.shape, dtype=torch.int8, device=w.device)
            st = _Staging(target, _stage_param(buf.t(), w), None)
            if scale is not None:
                st.scale = _stage_param(torch.empty((w.shape[1], 1), dtype=torch.float32,
                                                    device=w.device), layer.weight_scale)
            self._pending[target.path] = st
        loader = layer.weight_loader
        sid = target.shard_ids[idx]
        args = () if sid is None else (sid,)
        try:
            loader(st.weight, q, *args)
            if scale is not None:
                loader(st.scale, scale.unsqueeze(1), *args)
        except AssertionError as exc:
            raise WeightSyncError(f"{name}: does not fit {target.path} ({exc})") from None
        st.received.add(shard)

    @torch.no_grad()
    def _commit(self, target: _Target) -> None:
        st = self._pending.pop(target.path)
        layer = target.layer
        # In place: the processed [in, out] (NZ on NPU) storage keeps its address; the staging
        # buffer is already [in, out], so this is a straight copy.
        layer.weight.data.copy_(st.weight.data.t())
        if st.scale is not None:
            s = st.scale.data.flatten()
            layer.weight_scale.data.copy_(s.to(layer.weight_scale.dtype))
            _layout.current().commit_extras(layer)
            if target.static:
                _layout.current().refresh_static(layer)

    def _refresh_static_biases(self, names) -> None:
        """A static W8A8 layer computes with quant_bias, not bias: re-fold after a bias update."""
        for name in names:
            if name.endswith(".bias"):
                target = self.targets.get(name[: -len("bias")] + "weight")
                if target is not None and target.static:
                    _layout.current().refresh_static(target.layer)

    def _load_float(self, weights: List[Tuple[str, torch.Tensor]]):
        loaded = self._original(iter(weights))
        return loaded if loaded is not None else {n for n, _ in weights}


def _all_finite(t: torch.Tensor) -> bool:
    """One reduction pass, no temporary of the tensor's size (NaN propagates through min/max)."""
    lo, hi = torch.aminmax(t)
    return bool(torch.isfinite(lo)) and bool(torch.isfinite(hi))


def attach(model: torch.nn.Module, quantizer: OnlineQuantizer) -> Int8WeightLoader:
    """Give `model` the INT8 `load_weights` (idempotent; returns the loader)."""
    existing = getattr(model, "_npu_flashrl_loader", None)
    if existing is not None:
        existing.quantizer = quantizer
        return existing
    loader = Int8WeightLoader(model, quantizer, model.load_weights)
    model._npu_flashrl_loader = loader
    model.load_weights = loader.load_weights
    logger.debug("npu_flashrl: INT8 weight loader attached to %s (%d quantized projections, %s)",
                 type(model).__name__, len(loader.targets), quantizer.name)
    return loader


def end_weight_sync(model: torch.nn.Module) -> List[str]:
    loader = getattr(model, "_npu_flashrl_loader", None)
    if loader is None:
        raise RuntimeError("this model has no npu_flashrl INT8 loader (was npu_flashrl active when "
                           "the rollout engine was built?)")
    return loader.end_sync()

