"""vllm-ascend adapter: INT8 rollout models and in-place, bucket-safe weight reload.

Three pieces, each small:

1. Quant-method redirect (`describe_checkpoint`): vllm-ascend's "ascend" method needs a
   `quant_model_description.json`. For a bf16 checkpoint (profile-free INT8) or a
   compressed-tensors w8a8 checkpoint (RedHatAI style) we build that description in memory, as a
   rule rather than a list of names, so the model lands on vllm-ascend's own W8A8_DYNAMIC layers.
   ModelSlim checkpoints with their own json are left alone.
2. Online quantizers (`QUANTIZERS`): how an incoming full-precision HF tensor becomes INT8, one
   class per method: fresh per-channel scales (`int8_profile_free`) or FlashRL's fixed-scale
   profile (`int8`). They work on the FULL incoming tensor, before tensor-parallel sharding, so
   every rank computes the same per-channel scales a fresh load would.
3. `Int8WeightLoader`: replaces `model.load_weights`. Before `process_weights_after_loading`
   (cold load) it quantizes the stream and hands it to vLLM's own loaders. After it, it stages
   this rank's shard of each fused layer (q/k/v, gate/up) through the layer's own weight loader
   into a small int8 buffer, and once all shards of that layer arrived in this sync it writes
   them, transposed, into the processed [in, out] parameter IN PLACE, plus the scale and every
   derived copy. No new parameter storage, no second post-processing, data pointers unchanged.
"""
from __future__ import annotations

import dataclasses
import json
import os
import re
from typing import Dict, Iterable, List, Optional, Sequence, Set, Tuple

import torch

from npu_flashrl import kernels
from npu_flashrl._logging import get_logger

logger = get_logger("vllm_ascend")

# The seven decoder projections FlashRL quantizes (dense Llama/Qwen2-style names).
PROJECTIONS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
W8A8_DYNAMIC = "W8A8_DYNAMIC"
W8A8 = "W8A8"
FLOAT = "FLOAT"
DESCRIPTION_FILE = "quant_model_description.json"


class WeightSyncError(ValueError):
    """A weight sync was refused; the message names the parameter. Live weights are unchanged
    for every layer the failing tensor belongs to."""


class UnsupportedScheme(ValueError):
    """A checkpoint quantization scheme vllm-ascend's W8A8 layers cannot run."""


# --------------------------------------------------------------------------- 1. redirect

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
        return FLOAT

    def __missing__(self, key: str) -> str:
        return self.quant_type(key)


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


def describe_checkpoint(model_dir: str) -> Optional[QuantDescription]:
    """The description vllm-ascend should use for `model_dir`, or None to keep upstream's
    (a ModelSlim checkpoint with its own quant_model_description.json)."""
    if os.path.exists(os.path.join(model_dir, DESCRIPTION_FILE)):
        return None
    qcfg = read_hf_quant_config(model_dir)
    if qcfg is None:
        return profile_free_description()
    method = qcfg.get("quant_method")
    if method == "compressed-tensors" or "config_groups" in qcfg:
        return compressed_tensors_description(
            qcfg, where=f"{os.path.join(model_dir, 'config.json')}: quantization_config")
    raise UnsupportedScheme(
        f"{os.path.join(model_dir, 'config.json')}: quantization_config.quant_method = {method!r} "
        "is not supported on Ascend; use a bf16 checkpoint (profile-free INT8), a "
        "compressed-tensors w8a8 checkpoint, or a ModelSlim checkpoint")


# --------------------------------------------------------------------------- 2. quantizers

class OnlineQuantizer:
    """How an incoming full-precision HF tensor becomes what the INT8 rollout model holds."""

    name = ""
    writes_scales = True

    def __init__(self, compute_dtype: torch.dtype = torch.bfloat16):
        self.compute_dtype = compute_dtype

    def quantize(self, name: str, weight: torch.Tensor, transposed: bool = False
                 ) -> Tuple[torch.Tensor, Optional[torch.Tensor]]:
        """Full weight [out, in] -> (int8 [out, in], fp32 scale [out] or None to keep scales).
        `transposed`: the int8 result lives in [in, out] memory (see the kernels)."""
        raise NotImplementedError

    def transform(self, name: str, tensor: torch.Tensor) -> torch.Tensor:
        """A non-quantized tensor as the INT8 model wants it (identity unless a profile says)."""
        return tensor


class PerChannelQuantizer(OnlineQuantizer):
    """Profile-free: fresh symmetric per-channel scales on every sync (absmax / 127)."""

    name = "int8_profile_free"

    def quantize(self, name, weight, transposed=False):
        return kernels.quantize_weight_per_channel(weight, self.compute_dtype, transposed=transposed)


class ProfileQuantizer(OnlineQuantizer):
    """FlashRL's `int8` profile: fixed scales (the checkpoint's weight_scale stays), layernorm
    smoothing, the up/down beta; same math as flash_rl 1.0.3 `linear_quantize`."""

    name = "int8"
    writes_scales = False

    def __init__(self, profile: Dict[str, dict], compute_dtype: torch.dtype = torch.bfloat16):
        super().__init__(compute_dtype)
        self.profile = profile

    def _entry(self, name):
        try:
            return self.profile[name]
        except KeyError:
            raise WeightSyncError(f"{name}: not in the int8 profile; the profile was made for "
                                  "another model (re-run `npu-flashrl profile`)") from None

    def quantize(self, name, weight, transposed=False):
        e = self._entry(name)
        w = weight.to(self.compute_dtype)
        return kernels.quantize_weight_with_scales(w, e["output_scale"], e["input_scale"],
                                                   transposed=transposed), None

    def transform(self, name, tensor):
        e = self.profile.get(name)
        if e is None:
            return tensor
        # Layernorm smoothing: FlashRL computes `w * output_scale * input_scale` then casts.
        out = tensor.to(self.compute_dtype) * e["output_scale"] * e["input_scale"]
        return out.to(e.get("type", self.compute_dtype))


QUANTIZERS = {PerChannelQuantizer.name: PerChannelQuantizer, ProfileQuantizer.name: ProfileQuantizer}


def make_quantizer(fn: str, compute_dtype: torch.dtype, profile: Optional[dict] = None) -> OnlineQuantizer:
    if fn == ProfileQuantizer.name:
        if profile is None:
            raise ValueError("fn 'int8' needs a FlashRL int8 profile (setup -p PROFILE); "
                             "use fn 'int8_profile_free' to quantize without one")
        return ProfileQuantizer(profile, compute_dtype)
    if fn == PerChannelQuantizer.name:
        return PerChannelQuantizer(compute_dtype)
    raise ValueError(f"unknown INT8 function {fn!r}; known: {sorted(QUANTIZERS)}")


# --------------------------------------------------------------------------- 3. loader

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
    from npu_flashrl import compat

    _, static_cls, dynamic_cls = compat.quant_method_classes()
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
            fp32 = getattr(layer, "weight_scale_fp32", None)
            if isinstance(fp32, torch.Tensor):
                # vllm-ascend derives it from the param-dtype scale; keep that relation.
                fp32.copy_(layer.weight_scale.data.to(torch.float32))
            layer.weight_offset.data.zero_()
            if target.static:
                _refresh_static(layer)

    def _refresh_static_biases(self, names) -> None:
        """A static W8A8 layer computes with quant_bias, not bias: re-fold after a bias update."""
        for name in names:
            if name.endswith(".bias"):
                target = self.targets.get(name[: -len("bias")] + "weight")
                if target is not None and target.static:
                    _refresh_static(target.layer)

    def _load_float(self, weights: List[Tuple[str, torch.Tensor]]):
        loaded = self._original(iter(weights))
        return loaded if loaded is not None else {n for n, _ in weights}


def _all_finite(t: torch.Tensor) -> bool:
    """One reduction pass, no temporary of the tensor's size (NaN propagates through min/max)."""
    lo, hi = torch.aminmax(t)
    return bool(torch.isfinite(lo)) and bool(torch.isfinite(hi))


@torch.no_grad()
def _refresh_static(layer) -> None:
    """Static W8A8: deq_scale = input_scale * weight_scale, and the float bias folded into
    quant_bias (vllm-ascend adds quant_bias to the int32 accumulator and ignores `bias`)."""
    deq = (layer.input_scale.data.float() * layer.weight_scale.data.float()).flatten()
    if layer.deq_scale.dtype == torch.int64:
        deq_store = deq.view(torch.int32).to(torch.int64) & 0xFFFFFFFF
    else:
        deq_store = deq.to(layer.deq_scale.dtype)
    layer.deq_scale.data.copy_(deq_store)
    layer.quant_bias.data.copy_(static_quant_bias(layer, deq))


def static_quant_bias(layer, deq: torch.Tensor) -> torch.Tensor:
    """int32 bias for AscendW8A8LinearMethod: out = (x_q @ W_q + quant_bias) * deq_scale with
    x_q = round(x / input_scale + input_offset), so
    quant_bias = round(bias / deq_scale) - input_offset * sum_k W_q[:, k]."""
    w = layer.weight.data  # processed [in, out]
    wsum = w.to(torch.int64).sum(dim=0)
    offset = int(layer.input_offset.data.flatten()[0].item())
    bias = getattr(layer, "bias", None)
    fb = torch.zeros_like(deq) if bias is None else torch.round(bias.data.float() / deq)
    return (fb.to(torch.int64) - offset * wsum).to(torch.int32)


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


# --------------------------------------------------------------------------- patches
from npu_flashrl import compat, patches  # noqa: E402  (patches are declared after the pieces)

_online: Dict[str, object] = {"fn": None, "profile": None}


def configure_online_quantization(fn: Optional[str], profile: Optional[dict] = None) -> None:
    """Which quantizer models built from now on get (None: leave models unquantized)."""
    _online.update(fn=fn, profile=profile)


_DYNAMIC_PWAL = "vllm_ascend.quantization.w8a8_dynamic:AscendW8A8DynamicLinearMethod.process_weights_after_loading"
_STATIC_PWAL = "vllm_ascend.quantization.w8a8:AscendW8A8LinearMethod.process_weights_after_loading"
_VERSIONS = "vllm-ascend " + ", ".join(compat.SUPPORTED_VLLM_ASCEND)


def _process_once(original, static: bool):
    def process_weights_after_loading(self, layer):
        # Upstream transposes and re-allocates on every call: a second call would corrupt the
        # layer, so run it once per layer and remember that the layout is now [in, out].
        if getattr(layer, "_npu_flashrl_processed", False):
            return
        original(self, layer)
        if static:
            _fold_checkpoint_bias(layer)
        layer._npu_flashrl_processed = True
    return process_weights_after_loading


@torch.no_grad()
def _fold_checkpoint_bias(layer) -> None:
    bias = getattr(layer, "bias", None)
    if bias is None or not bool(bias.data.abs().sum() > 0):
        return
    if bool(layer.quant_bias.data.abs().sum() > 0):
        return  # the exporter (ModelSlim) already folded the bias into quant_bias
    deq = kernels.reference.decode_deq_scale(layer.deq_scale.data).flatten()
    layer.quant_bias.data.copy_(static_quant_bias(layer, deq))
    logger.debug("npu_flashrl: folded float bias into quant_bias of %s",
                 getattr(layer, "prefix", type(layer).__name__))


@patches.register("ascend_w8a8_dynamic_process_once", _DYNAMIC_PWAL, _VERSIONS,
                  "post-processing runs once per layer and marks its [in,out] layout")
def _apply_dynamic_once():
    compat.import_quantization()
    patches.replace(_DYNAMIC_PWAL, lambda orig: _process_once(orig, static=False))


@patches.register("ascend_w8a8_static_process_once", _STATIC_PWAL, _VERSIONS,
                  "post-processing runs once per layer; float bias folded into quant_bias")
def _apply_static_once():
    compat.import_quantization()
    patches.replace(_STATIC_PWAL, lambda orig: _process_once(orig, static=True))


def _redirect(original):
    def get_quant_config(model_config, load_config):
        if model_config.quantization == "ascend":
            desc = describe_checkpoint(model_config.model)
            if desc is not None:
                from vllm_ascend.quantization.quant_config import AscendQuantConfig

                logger.info("npu_flashrl: %s -> vllm-ascend %s layers (%s description)",
                            model_config.model, desc.rule_quantized, desc.source)
                return AscendQuantConfig(desc)
        return original(model_config, load_config)
    return get_quant_config


@patches.register("ascend_quant_description", compat.GET_QUANT_CONFIG_TARGET, "vllm 0.10.1, 0.11.0",
                  "bf16 and compressed-tensors w8a8 checkpoints load on vllm-ascend W8A8_DYNAMIC")
def _apply_redirect():
    compat.check_vllm_ascend()
    compat.import_quantization()
    patches.replace(compat.GET_QUANT_CONFIG_TARGET, _redirect)


_OVERRIDE_TARGET = "vllm_ascend.quantization.quant_config:AscendQuantConfig.override_quantization_method"


def _override(original):
    def override_quantization_method(cls, hf_quant_cfg, user_quant):
        chosen = original(hf_quant_cfg, user_quant)
        if chosen is None and user_quant in (None, "ascend") and isinstance(hf_quant_cfg, dict) \
                and hf_quant_cfg.get("quant_method") == "compressed-tensors":
            from vllm.platforms import current_platform

            if "ascend" in (getattr(current_platform, "supported_quantization", None) or []):
                return "ascend"  # e.g. the CPU rehearsal, where torch.npu is not available
        return chosen
    override_quantization_method.__npu_flashrl_original__ = original
    return classmethod(override_quantization_method)


@patches.register("ascend_claims_compressed_tensors", _OVERRIDE_TARGET, _VERSIONS,
                  "compressed-tensors w8a8 checkpoints go to 'ascend' on any platform that runs it")
def _apply_override():
    compat.import_quantization()
    patches.replace(_OVERRIDE_TARGET, _override)


def _online_choice(vllm_config):
    """(fn, profile, required) for a model built under `vllm_config`. The engine's own choice
    (additional_config, written where the engine args were built and pickled to every vLLM
    process) wins over this process's `configure_online_quantization` (tests, rehearsal)."""
    from npu_flashrl.adapters import vllm_engine

    choice = vllm_engine.engine_choice(vllm_config)
    if choice is None:
        return _online["fn"], _online["profile"], False
    if not choice.get("quantized"):
        return None, None, False
    profile = None
    if choice.get("profile"):
        from npu_flashrl.profile import load_profile

        profile = load_profile(choice["profile"])
    return choice.get("fn"), profile, True


def _attach_on_init(original):
    def initialize_model(*args, **kwargs):
        model = original(*args, **kwargs)
        vllm_config = kwargs.get("vllm_config") or (args[0] if args else None)
        model_config = getattr(vllm_config, "model_config", None)
        fn, profile, required = _online_choice(vllm_config)
        if getattr(model_config, "quantization", None) != "ascend":
            if required:
                raise RuntimeError(
                    f"npu_flashrl: the engine was configured for INT8 ({fn}) but "
                    f"{type(model).__name__} was built with quantization="
                    f"{getattr(model_config, 'quantization', None)!r}: it would run unquantized. "
                    "Something replaced the engine's quantization after npu_flashrl set it; "
                    "unset FLASHRL_CONFIG or remove the other quantization setting")
            if fn:
                logger.warning("npu_flashrl: INT8 function %s is configured but the model was "
                               "built with quantization=%r; it will run unquantized", fn,
                               getattr(model_config, "quantization", None))
            return model
        # Every INT8 model gets the quantizing loader: a float tensor pushed into vllm-ascend's
        # int8 parameters would otherwise be truncated silently. Without a configured function,
        # reloads use fresh per-channel scales.
        dtype = getattr(model_config, "dtype", torch.bfloat16)
        loader = attach(model, make_quantizer(fn or PerChannelQuantizer.name, dtype, profile))
        if not loader.targets:
            if required:
                raise RuntimeError(
                    f"npu_flashrl: FLASHRL_CONFIG asks for INT8 ({fn}) but {type(model).__name__} "
                    "has no vllm-ascend W8A8 linear layers: the rollout would run unquantized. "
                    "Check the checkpoint's quant description (every projection FLOAT?)")
            logger.warning("npu_flashrl: %s has no vllm-ascend W8A8 linear layers; nothing to "
                           "quantize", type(model).__name__)
        return model
    return initialize_model


@patches.register("model_loader_int8_load_weights", compat.INITIALIZE_MODEL_TARGET, "vllm 0.10.1, 0.11.0",
                  "models built while active get the INT8 online-quantizing load_weights")
def _apply_attach():
    patches.replace(compat.INITIALIZE_MODEL_TARGET, _attach_on_init)


PATCHES = ("ascend_w8a8_dynamic_process_once", "ascend_w8a8_static_process_once",
           "ascend_quant_description", "ascend_claims_compressed_tensors",
           "model_loader_int8_load_weights")
