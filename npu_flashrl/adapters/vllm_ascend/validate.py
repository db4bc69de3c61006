"""What a weight sync accepts: every `(name, tensor)` is checked by name before anything of it is
written (form, each name once per call, known name, dtype class, device, shape, NaN/Inf as the
rollout model will hold it, the quantizer's own entry), and every refusal is a WeightSyncError
naming the tensor and what was expected."""
from __future__ import annotations

from typing import Callable, Dict, List, Optional, Tuple

import torch

from npu_flashrl.adapters.vllm_ascend import experts as _experts
from npu_flashrl.adapters.vllm_ascend.schemes import ExpertTarget, LinearTarget
from npu_flashrl.quant import WeightSyncError


class Validator:
    """The rules of one rollout model (its parameters, quantized targets and fused-MoE experts)."""

    def __init__(self, model: torch.nn.Module, targets: Dict[str, LinearTarget],
                 experts: Dict[str, "ExpertTarget"]):
        self.model = model
        self.targets = targets
        self.experts = experts
        self.params = dict(model.named_parameters())
        # where a tensor without a parameter of its own (inv_freq, a tied lm_head) would go
        self.device = next(iter(self.params.values())).device if self.params else torch.device("cpu")
        self._packed = dict(getattr(model, "packed_modules_mapping", {}) or {})
        # every quantized layer by path (linear and fused-MoE)
        self._layers = {t.path: t for t in list(targets.values()) + list(experts.values())}
        self._expert_names = _experts.expert_name_mapping(model)

    def target(self, name: str):
        """The quantized layer (linear or fused-MoE) `name` loads into, or None."""
        return self.targets.get(name) or self.experts.get(name)

    @staticmethod
    def once(name: str, index: int, seen: Dict[str, int]) -> None:
        """Refuse a name a call already brought (`seen`: name -> item index, of this call)."""
        first = seen.setdefault(name, index)
        if first != index:
            raise WeightSyncError(f"{name}: appears twice in one load_weights call (items {first} "
                                  f"and {index}); a sync sends each tensor once")

    @staticmethod
    def item(index: int, item) -> Tuple[str, torch.Tensor]:
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
        return name, readable(name, tensor)

    def check(self, name: str, tensor, quantizer, values: bool = True, device: bool = True,
              deferred: Optional["DeferredChecks"] = None) -> None:
        """Refuse a tensor by name: type, dtype class, device (with `device`: the cold load reads
        from disk), shape, and (with `values`) NaN/Inf as the rollout model will hold it (an fp32
        1e5 is Inf in an fp16 model); with `deferred`, the value check is read back with the
        call's others (`DeferredChecks`)."""
        if not isinstance(tensor, torch.Tensor):
            raise WeightSyncError(f"{name}: expected a torch.Tensor, got {type(tensor).__name__}")
        readable(name, tensor)
        target = self.target(name)
        if target is not None:
            if not tensor.is_floating_point():
                raise WeightSyncError(f"{name}: expected a floating-point tensor (bf16/fp16/fp32) "
                                      f"to quantize online, got {tensor.dtype}")
            if device:
                self._check_device(name, tensor, target.weight_device())
            want = target.full_shape(name)
            if tuple(tensor.shape) != tuple(want):
                raise WeightSyncError(f"{name}: expected shape {tuple(want)}, got {tuple(tensor.shape)}")
            quantizer.check(name, tensor)
            dtype = quantizer.compute_dtype
        else:
            resolved = self.resolve(name)
            if resolved is None:
                raise WeightSyncError(f"{name}: no such parameter in the rollout model")
            self._refuse_fused(name, resolved)
            param = self.params.get(resolved)
            if param is not None and not param.is_floating_point():
                if tensor.dtype != param.dtype:
                    raise WeightSyncError(f"{name}: expected a {param.dtype} tensor (the parameter's "
                                          f"dtype), got {tensor.dtype}")
            elif not tensor.is_floating_point():
                # a bool or integer tensor would be cast into the float parameter (a norm of 0/1)
                raise WeightSyncError(f"{name}: expected a floating-point tensor (bf16/fp16/fp32), "
                                      f"got {tensor.dtype}")
            if device:
                self._check_device(name, tensor, param.device if param is not None else self.device)
            want = self._full_shape(name, resolved)
            if want is not None and tuple(tensor.shape) != tuple(want):
                raise WeightSyncError(f"{name}: expected shape {tuple(want)}, got {tuple(tensor.shape)}")
            dtype = param.dtype if param is not None and param.is_floating_point() else tensor.dtype
        if values and tensor.is_floating_point():
            if deferred is not None:
                defer_finite(deferred, name, tensor, dtype)
            else:
                refuse_nonfinite(name, tensor, dtype)

    def _refuse_fused(self, name: str, resolved: str) -> None:
        """A quantized layer's own parameter (vLLM's fused `qkv_proj.weight_scale`, a fused-MoE
        `w13_weight`) is not what a sync sends: the sync writes it from the HF shards (float, or
        on the INT8 wire each shard's int8 weight and scale). Only its float bias is sent as is."""
        path, _, leaf = resolved.rpartition(".")
        layer = self._layers.get(path)
        if layer is None or leaf == "bias":
            return
        shards = list(layer.shard_names())
        raise WeightSyncError(
            f"{name}: is the rollout's own {leaf} of its quantized layer {path} (vLLM's fused "
            f"name); a weight sync sends the HF names it is made of: {short(shards)} (float, or on "
            "the INT8 wire each one's int8 weight and its weight_scale)")

    @staticmethod
    def _check_device(name: str, tensor: torch.Tensor, want: torch.device) -> None:
        """The parameter's device, or the CPU (copied in, as vLLM's loaders do); never a third
        device, which the quantizer and the loaders would meet half-way through a sync."""
        if tensor.device.type == "cpu" or tensor.device == want:
            return
        raise WeightSyncError(f"{name}: is on {tensor.device}; expected {want} (where the rollout "
                              "model's parameter lives) or the CPU")

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
            return (target.full_shape(weight_name)[0],)
        param = self.params.get(resolved)
        if param is None:
            return None
        if getattr(param, "output_dim", None) is None and getattr(param, "input_dim", None) is None:
            return tuple(param.shape)  # replicated (norms)
        return None

    def resolve(self, name: str) -> Optional[str]:
        """The rollout model's parameter a non-quantized HF tensor loads into, or None."""
        if name in self.params:
            return name
        if name.endswith("rotary_emb.inv_freq"):
            return name
        for fused, shards in self._packed.items():
            for s in shards:
                if f".{s}." in name:
                    fused_name = name.replace(f".{s}.", f".{fused}.")
                    if fused_name in self.params:
                        return fused_name
        if name == "lm_head.weight" and getattr(getattr(self.model, "config", None),
                                                "tie_word_embeddings", False):
            return name  # vLLM drops it (tied to the embedding); its shape is still checked
        expert = _experts.resolve_float_expert(self._expert_names, name)  # unquantized experts
        if expert is not None and expert in self.params:
            return expert
        return None


def short(names, n: int = 6) -> str:
    return ", ".join(names[:n]) + (" ..." if len(names) > n else "")


def readable(name: str, tensor):
    """A pushed tensor as vLLM's loaders read it, or a WeightSyncError naming it: a Parameter or
    a tensor that requires grad is read as its values (detached: the same storage, no copy); a
    sparse or meta tensor is refused (vLLM's loaders copy dense values)."""
    if not isinstance(tensor, torch.Tensor):
        return tensor  # `check` names what it got
    if tensor.layout != torch.strided:
        raise WeightSyncError(f"{name}: is a sparse tensor ({str(tensor.layout).replace('torch.', '')}); "
                              "expected a dense (strided) tensor of the weight's values (send "
                              "`.to_dense()`)")
    if tensor.device.type == "meta":
        raise WeightSyncError(f"{name}: is a meta tensor (no data: a model or state dict that "
                              "was never materialized); expected the weight's values")
    if tensor.requires_grad or isinstance(tensor, torch.nn.Parameter):
        tensor = tensor.detach()
    return tensor


class DeferredChecks:
    """The value checks of one load_weights call (a bucket), read back to the host together: each
    check adds a device-side flag (True: passed, a sufficient condition) and the check itself,
    which raises its own WeightSyncError. `raise_first()` reads all flags in one host
    synchronisation; only when some flag is False does it run those checks, in call order, so
    the first real failure raises with its own message (a conservative flag may send back a
    check that still passes; a flag added `exact` always refuses when False, by the name it was
    added with if its check passes on a re-run: nothing succeeds silently). A list call writes
    nothing before `raise_first()`. A streamed call reads its checks back before its sync's
    first write and at its end (`sync_load.SyncLoad`), so its checks hold no tensor the caller
    may refill: each keeps the few device values its refusal needs (a tensor's extremes, its
    own copy of a scale)."""

    def __init__(self):
        self._flags: List[torch.Tensor] = []
        self._checks: List[Tuple[Callable[[], None], Optional[str]]] = []
        self._scales: List[torch.Tensor] = []
        self._scale_checks: List[Callable[[], None]] = []
        self._scale_dtype: Optional[torch.dtype] = None
        self._seen: set = set()
        self._extremes: List[Tuple[torch.Tensor, torch.Tensor]] = []  # streamed scales' (min, max)
        self._extreme_checks: List[Tuple[Callable[[], None], Optional[str]]] = []

    def add(self, flag: torch.Tensor, check: Callable[[], None], exact: Optional[str] = None) -> None:
        """`exact`: the name a False `flag` is refused by when `check` passes on its re-run."""
        self._flags.append(flag.reshape(1))
        self._checks.append((check, exact))

    def add_scales(self, scales: torch.Tensor, dtype: torch.dtype, check: Callable[[], None]) -> None:
        """INT8-wire scales, tested together (a few launches per call, not per tensor): every
        scale > 0 and 128 x scale finite in the rollout's `dtype` (|int8| <= 128, so every
        dequantized value is then finite too: the pair check's sufficient condition). `scales`
        must keep their values until `raise_first()` (a streamed call passes its own copy)."""
        key = (scales.data_ptr(), scales.numel(), scales.dtype)
        if key not in self._seen:  # a pair's scale validated in this call is tested once
            self._seen.add(key)
            self._scales.append(scales.reshape(-1))
        self._scale_checks.append(check)
        self._scale_dtype = dtype

    def add_extremes(self, lo: torch.Tensor, hi: torch.Tensor, dtype: torch.dtype,
                     check: Callable[[], None], exact: Optional[str] = None) -> None:
        """One streamed INT8-wire scale, by its min and max (device scalars): the `add_scales`
        test on them, all of a call's in a few launches at `raise_first()`; `check` refuses
        from them, no tensor is kept."""
        self._extremes.append((lo.reshape(()), hi.reshape(())))
        self._extreme_checks.append((check, exact))
        self._scale_dtype = dtype

    def _extremes_flags(self) -> None:
        if not self._extremes:
            return
        lo = torch.stack([e[0] for e in self._extremes]).float()
        hi = torch.stack([e[1] for e in self._extremes]).float()
        ok = (lo > 0) & torch.isfinite((hi * 128).to(self._scale_dtype))
        self._flags.append(ok)  # one flag per scale, its check beside it
        self._checks.extend(self._extreme_checks)
        self._extremes, self._extreme_checks = [], []

    def _scales_flag(self) -> None:
        self._extremes_flags()
        if not self._scales:
            return
        s = torch.cat([t.float() for t in self._scales]) if len(self._scales) > 1 \
            else self._scales[0].float()
        # one pass over the scales: min > 0 (NaN fails it) and 128 x max finite in the rollout's
        # dtype (rounding is monotone, so then 128 x every scale is)
        lo, hi = torch.aminmax(s)
        ok = (lo > 0) & torch.isfinite((hi * 128).to(self._scale_dtype))
        checks = self._scale_checks

        def each() -> None:
            for check in checks:
                check()
        self.add(ok, each)
        self._scales, self._scale_checks, self._seen = [], [], set()

    def raise_first(self) -> None:
        self._scales_flag()
        flags, checks = self._flags, self._checks
        self._flags, self._checks = [], []
        if not flags:
            return
        together = torch.cat([f.to(flags[0].device) for f in flags])
        if bool(together.all()):  # the call's one host synchronisation
            return
        for ok, (check, exact) in zip(together.tolist(), checks):
            if not ok:
                check()
                if exact is not None:
                    raise WeightSyncError(
                        f"{exact}: its value check failed on the device but passed when run "
                        "again (its values changed during the load_weights call); refusing the sync")


class Flagging:
    """A quantizer handing its NaN / Inf refusal back as device flags (`finite`, appended to
    `flags`) instead of reading it back itself (`defers_finite_check` quantizers)."""

    def __init__(self, quantizer, flags: list):
        self._quantizer, self._flags = quantizer, flags

    def quantize(self, name, weight, transposed=False):
        return self._quantizer.quantize(name, weight, transposed=transposed, finite=self._flags)

    def __getattr__(self, attr):
        return getattr(self._quantizer, attr)


def defer_finite(deferred: DeferredChecks, name: str, t: torch.Tensor, dtype: torch.dtype) -> None:
    """`refuse_nonfinite` of `t`, read back with the call's other checks (no host
    synchronisation here): the flag and the refusal keep `t`'s extremes (two device scalars),
    not `t` (a streamed tensor may be refilled by its sender after its yield)."""
    if t.device.type == "meta" or t.numel() == 0:
        return
    lo, hi = torch.aminmax(t)
    src = t.dtype  # the refusal must not hold `t`
    deferred.add(_finite(lo, hi, dtype), lambda: _refuse_extremes(name, lo, hi, src, dtype),
                 exact=name)


def _finite(lo: torch.Tensor, hi: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """Extremes finite as `dtype` holds them (casting is monotone: the extremes decide)."""
    if dtype.is_floating_point and dtype != lo.dtype:
        lo, hi = lo.to(dtype), hi.to(dtype)
    return torch.isfinite(lo) & torch.isfinite(hi)


def _refuse_extremes(name: str, lo: torch.Tensor, hi: torch.Tensor, src: torch.dtype,
                     dtype: torch.dtype) -> None:
    """`refuse_nonfinite`'s refusal, from the extremes of a tensor of dtype `src`."""
    if bool(_finite(lo, hi, dtype)):
        return
    note = "" if src == dtype or not dtype.is_floating_point or not bool(_finite(lo, hi, src)) else \
        f" as {_short(dtype)} (the rollout dtype; finite in {_short(src)})"
    raise WeightSyncError(f"{name}: contains NaN or Inf{note}; refusing the sync")


def _short(dtype: torch.dtype) -> str:
    return str(dtype).replace("torch.", "")


def refuse_nonfinite(name: str, t: torch.Tensor, dtype: torch.dtype) -> None:
    """Refuse NaN/Inf in `t` as `dtype` will hold it (an fp32 1e5 is Inf in fp16), from one
    reduction pass and no temporary of the tensor's size."""
    if t.device.type == "meta" or t.numel() == 0:
        return
    lo, hi = torch.aminmax(t)
    _refuse_extremes(name, lo, hi, t.dtype, dtype)
