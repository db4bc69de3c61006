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
from npu_flashrl.adapters.vllm_ascend import experts as _experts
from npu_flashrl.adapters.vllm_ascend import layout as _layout
from npu_flashrl.adapters.vllm_ascend import wire as _wire
from npu_flashrl.adapters.vllm_ascend.description import UnsupportedScheme
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

    def full_shape(self, name: str) -> Tuple[int, int]:
        return self.full_shapes[self.shards.index(self.shard_of(name))]

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

    def missing(self) -> List[str]:
        return [self.target.hf_name(s) for s in self.target.shards if s not in self.received]

    def buffers(self):
        return (self.weight.data,) + (() if self.scale is None else (self.scale.data,))


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
    layout = _layout.current()
    static_cls, dynamic_cls = layout.method_classes()
    wrapper_cls = layout.linear_wrapper_class()
    packed = dict(getattr(model, "packed_modules_mapping", {}) or {})
    targets: Dict[str, _Target] = {}
    for path, module in model.named_modules():
        inner = _inner_method(module)
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

    What a failed sync leaves: a list/dict call is checked whole (form, names, shapes, dtypes,
    NaN/Inf in the rollout dtype, profile entries) before anything of it is written. A streamed
    call (generator) is checked item by item; if it fails after something of the sync was
    written, the model holds weights of two syncs: it is marked inconsistent, `end_sync` raises
    saying so, and the model's forward raises until a complete sync (every parameter, no
    failure) ends cleanly.
    """

    # Non-projection tensors of a streamed sync are written in small groups: at most this many
    # bytes are held (or one tensor, when it alone is larger), never the whole stream.
    passthrough_buffer_bytes = 64 << 20

    def __init__(self, model: torch.nn.Module, quantizer: OnlineQuantizer, original_load_weights,
                 prequantized_checkpoint: bool = False):
        self.model = model
        self.quantizer = quantizer
        self._original = original_load_weights
        # The cold-loaded checkpoint is already W8A8 (its layernorms already smoothed): the
        # cold stream must not transform it again.
        self.prequantized_checkpoint = prequantized_checkpoint
        self.targets = find_targets(model)
        # fused-MoE experts (W8A8_DYNAMIC): HF expert name -> its layer
        self.experts = _experts.find_expert_targets(model)
        self._pending: Dict[str, object] = {}  # layer path -> _Staging / ExpertStaging
        self._params = dict(model.named_parameters())
        self._packed = dict(getattr(model, "packed_modules_mapping", {}) or {})
        self._expert_names = _experts.expert_name_mapping(model)
        target_layers = {t.path for t in self._layers().values()}
        # What a complete sync writes: every target layer and every float parameter outside
        # them (plus the targets' float biases); checkpoint-only tensors (scales) are not pushed.
        self._required_float = {n for n in self._params
                                if n.rsplit(".", 1)[0] not in target_layers or n.endswith(".bias")}
        self._required_layers = target_layers
        self.inconsistent: Optional[str] = None
        self._hooks: list = []
        self._reset_sync()
        self.check_quantizer()

    # ------------------------------------------------------------------ public API
    def _layers(self) -> Dict[str, object]:
        """Every quantized layer (linear and fused-MoE) by path."""
        out = {t.path: t for t in self.targets.values()}
        out.update((t.path, t) for t in self.experts.values())
        return out

    def processed(self) -> bool:
        layers = [t.layer for t in self._layers().values()]
        is_processed = _layout.current().is_processed
        return bool(layers) and all(is_processed(l) for l in layers)

    def check_quantizer(self) -> None:
        """Refuse a quantizer that cannot handle every projection of this model (a profile made
        for another model, or FlashRL's dense-only profile on a MoE model) now, before any sync
        writes anything."""
        if self.experts and getattr(self.quantizer, "dense_only", False):
            example = next(iter(self.experts))
            raise WeightSyncError(
                f"{example}: {type(self.model).__name__} is a MoE model and fn "
                f"{self.quantizer.name!r} (FlashRL's int8 profile) knows the dense projections "
                f"only ({len(self.experts)} expert weights have no profile entry); use fn "
                "'int8_profile_free' (fresh per-channel scales per expert at every sync)")
        bad = []
        for name in self.targets:
            try:
                self.quantizer.check(name, None)
            except WeightSyncError:
                bad.append(name)
        if bad:
            raise WeightSyncError(
                f"{bad[0]}: not in the {self.quantizer.name} profile ({len(bad)} of "
                f"{len(self.targets)} projections missing); the profile was made for another "
                "model (re-run `npu-flashrl profile`)")

    def load_weights(self, weights: Iterable[Tuple[str, torch.Tensor]]) -> Set[str]:
        if not self.processed():
            # A layer that was processed before and is not now was put back into its checkpoint
            # layout by vLLM's layerwise reload, which holds the tensors it is given until the
            # layer is complete, possibly past this call: give it copies, not the caller's
            # (bucket) tensors. A cold load from disk needs no copy.
            reloading = any(getattr(t.layer, "_npu_flashrl_processed", False)
                            for t in self.targets.values())
            return self._original(self._cold_stream(weights, copy=reloading))
        if isinstance(weights, dict):
            weights = list(weights.items())
        checked = isinstance(weights, (list, tuple))
        loaded: Set[str] = set()
        buffer: List[Tuple[str, torch.Tensor]] = []
        buffered = 0
        try:
            if checked:
                # refuse a bad call before writing anything of it
                weights = [self._item(i, w) for i, w in enumerate(weights)]
                for name, tensor in weights:
                    wired = _wire.wire_weight(self, name, tensor)  # INT8 wire (wire.py)
                    if wired is None:
                        self._validate(name, tensor)
                    else:
                        _wire.validate(self, name, wired, tensor)
            for i, item in enumerate(weights):
                name, tensor = item if checked else self._item(i, item)
                wired = _wire.wire_weight(self, name, tensor)
                if wired is not None:  # pre-quantized: staged as it is (wire.py)
                    if not checked:
                        _wire.validate(self, name, wired, tensor)
                    loaded |= _wire.stage(self, name, wired, tensor, borrowed=checked)
                    continue
                target = self.targets.get(name)
                expert = self.experts.get(name)
                if not checked:
                    # streamed: the quantizer finds NaN/Inf in projections during its own pass
                    self._validate(name, tensor, values=target is None and expert is None)
                if expert is not None:
                    if self._stage_expert(expert, name, tensor):
                        loaded.add(name)
                    continue
                if target is None:
                    size = tensor.numel() * tensor.element_size()
                    if buffer and buffered + size > self.passthrough_buffer_bytes:
                        loaded |= self._flush(buffer)
                        buffered = 0
                    buffer.append((name, self.quantizer.transform(name, tensor)))
                    buffered += size
                    del tensor, item  # the buffer holds the only reference we keep
                    if buffered >= self.passthrough_buffer_bytes:
                        loaded |= self._flush(buffer)
                        buffered = 0
                    continue
                self._stage(target, name, tensor)
                loaded.add(name)
                if len(self._pending[target.path].received) == len(target.shards):
                    self._commit(target)
            if buffer:
                loaded |= self._flush(buffer)
            _wire.keep_pending(self)
        except Exception as exc:
            # Staged (uncommitted) shards of this sync are dropped: their layers keep their
            # previous weights. Anything already written this sync makes the model inconsistent.
            self._pending.clear()
            self._failed(exc)
            raise
        return loaded

    def end_sync(self) -> List[str]:
        """End the current sync. Raises WeightSyncError when it failed part-way or when shards
        never arrived (those layers keep their previous weights); returns [] otherwise."""
        missing = []
        for st in self._pending.values():
            missing += st.missing()
        self._pending.clear()
        failure, wrote = self._sync_failure, self._sync_wrote
        complete = (failure is None and not missing and self._required_layers <= self._sync_layers
                    and self._required_float <= self._sync_float)
        self._reset_sync()
        if missing and wrote:
            failure = (f"{len(missing)} shard(s) never arrived: {missing[:8]}"
                       f"{' ...' if len(missing) > 8 else ''}")
            self._mark_inconsistent(failure)
        if complete and self.inconsistent is not None:
            logger.info("npu_flashrl: a complete weight sync replaced the mixed weights; the "
                        "model generates again")
            self._clear_inconsistent()
        if failure is not None or missing:
            if failure is None:
                failure = (f"{len(missing)} shard(s) missing: {missing[:8]}"
                           f"{' ...' if len(missing) > 8 else ''}")
            tail = (f"the model holds weights of two syncs and refuses to generate until a "
                    f"complete sync succeeds" if self.inconsistent is not None
                    else "nothing of it was written; the model keeps its previous weights")
            raise WeightSyncError(f"weight sync failed: {failure}; {tail}")
        return missing

    def pending(self) -> Dict[str, List[str]]:
        return {p: sorted(st.received) for p, st in self._pending.items()}

    def staging_bytes(self) -> int:
        """Bytes held by staged, uncommitted layers of this sync (MoE: one layer's int8 experts
        per layer being received)."""
        return sum(t.numel() * t.element_size()
                   for st in self._pending.values() for t in st.buffers())

    # ------------------------------------------------------------------ sync state
    def _reset_sync(self) -> None:
        self._sync_failure: Optional[str] = None
        self._sync_wrote = False
        self._sync_layers: Set[str] = set()
        self._sync_float: Set[str] = set()

    def _failed(self, exc: BaseException) -> None:
        if self._sync_failure is None:
            self._sync_failure = str(exc)
        if self._sync_wrote:
            self._mark_inconsistent(str(exc))

    def _mark_inconsistent(self, reason: str) -> None:
        if self.inconsistent is None:
            self.inconsistent = reason
            logger.error("npu_flashrl: weight sync failed part-way (%s); the model refuses to "
                         "generate until a complete sync succeeds", reason)
            check = self._refuse_forward
            mods = [self.model] + [t.layer for t in self._layers().values()]
            self._hooks = [m.register_forward_pre_hook(check) for m in mods]

    def _clear_inconsistent(self) -> None:
        self.inconsistent = None
        for h in self._hooks:
            h.remove()
        self._hooks = []

    def _refuse_forward(self, module, args):
        # Registered only while inconsistent, so a healthy model pays nothing.
        raise WeightSyncError(f"the model holds weights of two syncs after a failed weight sync "
                              f"({self.inconsistent}); run a complete sync before generating")

    # ------------------------------------------------------------------ cold load
    def _cold_stream(self, weights, copy: bool = False):
        """Before post-processing: quantize float projections in the stream for vLLM's loaders;
        a w8a8 checkpoint's int8 weights pass through and get the zero weight_offset vllm-ascend
        expects (compressed-tensors has none). That offset is yielded at the end, and only when
        the stream brought none: vLLM 0.23's layerwise reload counts the elements loaded into
        a layer, and a second offset would make it process the layer before its scales came.
        The other tensors of a W8A8 checkpoint are already what the INT8 model wants (the
        profile's smoothing is in them)."""
        missing_offsets: Dict[str, torch.Tensor] = {}
        seen_offsets: Set[str] = set()
        for name, tensor in weights:
            if name.endswith(".weight_offset"):
                seen_offsets.add(name)
                missing_offsets.pop(name, None)
            target = self.targets.get(name) or self.experts.get(name)
            if target is not None and tensor.is_floating_point():
                self._validate(name, tensor, values=False)  # the quantizer checks values
                q, scale = self.quantizer.quantize(name, tensor)
                yield name, q
                if scale is not None:
                    yield name[: -len("weight")] + "weight_scale", scale.unsqueeze(1)
                    yield name[: -len("weight")] + "weight_offset", torch.zeros_like(scale).unsqueeze(1)
                continue
            weight_name = name[: -len("_scale")]
            if name.endswith(".weight_scale") and (weight_name in self.targets or weight_name in self.experts):
                yield name, tensor.clone() if copy else tensor
                offset = name[: -len("weight_scale")] + "weight_offset"
                if offset not in seen_offsets:
                    missing_offsets[offset] = torch.zeros_like(tensor)
                continue
            out = tensor if self.prequantized_checkpoint else self.quantizer.transform(name, tensor)
            yield name, out.clone() if copy and out is tensor else out
        yield from missing_offsets.items()

    # ------------------------------------------------------------------ reload
    @staticmethod
    def _item(index: int, item) -> Tuple[str, torch.Tensor]:
        """One `(name, tensor)` pair of a sync, or a WeightSyncError naming what it got."""
        if isinstance(item, str):
            raise WeightSyncError(f"{item}: expected a (name, tensor) pair, got a bare string "
                                  f"(item {index} of the weights)")
        if not isinstance(item, (tuple, list)) or len(item) != 2:
            what = (f"a {len(item)}-item {type(item).__name__}" if isinstance(item, (tuple, list))
                    else f"a {type(item).__name__}")
            label = item[0] if isinstance(item, (tuple, list)) and item and isinstance(item[0], str) \
                else f"weights item {index}"
            raise WeightSyncError(f"{label}: expected a (name, tensor) pair, got {what}")
        name, tensor = item
        if not isinstance(name, str):
            raise WeightSyncError(f"weights item {index}: expected a parameter name (str) first, "
                                  f"got {type(name).__name__}")
        return name, tensor

    def _validate(self, name: str, tensor, values: bool = True) -> None:
        """Refuse a tensor by name: type, dtype, shape, and (with `values`) NaN/Inf as the
        rollout model will hold it (an fp32 1e5 is Inf in an fp16 model)."""
        if not isinstance(tensor, torch.Tensor):
            raise WeightSyncError(f"{name}: expected a torch.Tensor, got {type(tensor).__name__}")
        target = self.targets.get(name) or self.experts.get(name)
        if target is not None:
            if not tensor.is_floating_point():
                raise WeightSyncError(f"{name}: expected a floating-point tensor (bf16/fp16/fp32) "
                                      f"to quantize online, got {tensor.dtype}")
            want = target.full_shape(name)
            if tuple(tensor.shape) != tuple(want):
                raise WeightSyncError(f"{name}: expected shape {tuple(want)}, got {tuple(tensor.shape)}")
            self.quantizer.check(name, tensor)
            dtype = self.quantizer.compute_dtype
        else:
            resolved = self._resolve_param(name)
            if resolved is None:
                raise WeightSyncError(f"{name}: no such parameter in the rollout model")
            if not (tensor.is_floating_point() or tensor.dtype == torch.bool):
                raise WeightSyncError(f"{name}: expected a floating-point tensor, got {tensor.dtype}")
            want = self._full_shape(name, resolved)
            if want is not None and tuple(tensor.shape) != tuple(want):
                raise WeightSyncError(f"{name}: expected shape {tuple(want)}, got {tuple(tensor.shape)}")
            param = self._params.get(resolved)
            dtype = param.dtype if param is not None and param.is_floating_point() else tensor.dtype
        if values and tensor.is_floating_point() and not _finite_as(tensor, dtype):
            raise WeightSyncError(f"{name}: contains NaN or Inf{_as_note(tensor, dtype)}; "
                                  "refusing the sync")

    def _full_shape(self, name: str, resolved: str) -> Optional[Tuple[int, ...]]:
        """The HF (unsharded) shape `name` must have, or None when it cannot be told."""
        module_path, _, leaf = resolved.rpartition(".")
        try:
            module = self.model.get_submodule(module_path)
        except AttributeError:
            return None
        if hasattr(module, "org_vocab_size") and leaf == "weight":  # (padded) vocab-parallel
            return (module.org_vocab_size, module.embedding_dim)
        weight_name = name[: -len("bias")] + "weight" if name.endswith(".bias") else None
        target = self.targets.get(weight_name) if weight_name else None
        if target is not None:  # a projection's bias: its out features
            return (target.full_shapes[target.shards.index(_Target.shard_of(weight_name))][0],)
        param = self._params.get(resolved)
        if param is None:
            return None
        if getattr(param, "output_dim", None) is None and getattr(param, "input_dim", None) is None:
            return tuple(param.shape)  # replicated (norms)
        return None

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
            return name  # vLLM drops it (tied to the embedding); its shape is still checked
        expert = _experts.resolve_float_expert(self._expert_names, name)  # unquantized experts
        if expert is not None and expert in self._params:
            return expert
        return None

    def _stage(self, target: _Target, name: str, tensor: torch.Tensor) -> None:
        q, scale = self._quantize(name, tensor)
        self._stage_quantized(target, name, q, scale)

    def _stage_quantized(self, target: _Target, name: str, q: torch.Tensor,
                         scale: Optional[torch.Tensor]) -> None:
        """Stage one shard's int8 [out, in] and fp32 scale [out] (None: keep the scales)."""
        shard = _Target.shard_of(name)
        idx = target.shards.index(shard)
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

    def _quantize(self, name: str, tensor: torch.Tensor):
        """(int8, scale) of one pushed projection / expert shard, produced in [in, out] memory
        (the processed layout, so a commit is a memcpy); the quantizer's refusals name it."""
        try:
            return self.quantizer.quantize(name, tensor, transposed=True)
        except WeightSyncError:
            raise
        except ValueError as exc:
            raise WeightSyncError(f"{name}: {exc}; refusing the sync") from None

    def _stage_expert(self, target, name: str, tensor: torch.Tensor) -> bool:
        """Stage one expert shard; commit its layer once every local shard arrived. False for an
        expert this rank does not hold (expert parallel): checked, then dropped as vLLM does."""
        if name not in target.local:
            return False
        q, scale = self._quantize(name, tensor)
        return self._stage_expert_quantized(target, name, q, scale)

    def _stage_expert_quantized(self, target, name: str, q: torch.Tensor,
                                scale: Optional[torch.Tensor]) -> bool:
        """Stage one expert shard's int8 and fp32 scale; commit its layer when complete."""
        if name not in target.local:
            return False
        if scale is None:  # the profile quantizer keeps scales: refused at attach for MoE
            raise WeightSyncError(f"{name}: {self.quantizer.name} gives no expert scales")
        st = self._pending.get(target.path)
        if st is None:
            st = self._pending[target.path] = _experts.ExpertStaging(target)
        st.stage(name, q, scale)
        if st.complete():
            self._pending.pop(target.path)
            self._sync_wrote = True
            self._sync_layers.add(target.path)
            st.commit()
        return True

    @torch.no_grad()
    def _commit(self, target: _Target) -> None:
        st = self._pending.pop(target.path)
        layer = target.layer
        self._sync_wrote = True
        self._sync_layers.add(target.path)
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

    def _flush(self, buffer: List[Tuple[str, torch.Tensor]]) -> Set[str]:
        """Write buffered non-projection tensors through vLLM's loaders and empty the buffer."""
        names = [n for n, _ in buffer]
        self._sync_wrote = True
        try:
            loaded = self._original(iter(buffer))
        except AssertionError as exc:  # validated above; a loader's own rule we could not see
            raise WeightSyncError(f"{names[0] if len(names) == 1 else names}: does not fit the "
                                  f"rollout model ({str(exc) or 'a vLLM weight loader assertion'})") from None
        finally:
            buffer.clear()
        self._sync_float.update(r for r in map(self._resolve_param, names) if r)
        self._refresh_static_biases(names)
        return set(loaded) if loaded is not None else set(names)


def _finite_as(t: torch.Tensor, dtype: torch.dtype) -> bool:
    """NaN/Inf check of `t` as `dtype` will hold it, in one reduction pass and no temporary of
    the tensor's size: casting is monotonic, so the extremes decide an overflow."""
    if t.device.type == "meta" or t.numel() == 0:
        return True
    lo, hi = torch.aminmax(t)
    if dtype.is_floating_point and dtype != t.dtype:
        lo, hi = lo.to(dtype), hi.to(dtype)
    return bool(torch.isfinite(lo)) and bool(torch.isfinite(hi))


def _as_note(t: torch.Tensor, dtype: torch.dtype) -> str:
    if t.dtype == dtype or not dtype.is_floating_point or not _finite_as(t, t.dtype):
        return ""
    return f" as {str(dtype).replace('torch.', '')} (the rollout dtype; finite in {str(t.dtype).replace('torch.', '')})"


def attach(model: torch.nn.Module, quantizer: OnlineQuantizer,
           prequantized_checkpoint: bool = False) -> Int8WeightLoader:
    """Give `model` the INT8 `load_weights` (idempotent; returns the loader).
    `prequantized_checkpoint`: the model is cold-loaded from a W8A8 checkpoint."""
    existing = getattr(model, "_npu_flashrl_loader", None)
    if existing is not None:
        previous, existing.quantizer = existing.quantizer, quantizer
        try:
            existing.check_quantizer()
        except WeightSyncError:
            existing.quantizer = previous
            raise
        return existing
    loader = Int8WeightLoader(model, quantizer, model.load_weights, prequantized_checkpoint)
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

