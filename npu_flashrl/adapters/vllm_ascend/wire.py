"""The INT8 wire, receiver side: commit pre-quantized W8A8_DYNAMIC shards in place.

The trainer (`npu_flashrl.quant.wire`) sends a projection as `<p>.weight` int8 [out, in] and
`<p>.weight_scale` fp32 [out, 1], quantized by the rollout's own kernel and compute dtype. Every
sync (`sync.SyncState`) holds one `WireReceiver`, which it asks about every tensor:

- `weight_of(name, tensor)`: the projection weight a tensor belongs to when it is a wire tensor
  (an int8 projection weight, or a projection's `weight_scale` / `weight_offset`), else None;
- `validate(...)`: refuse it by name before anything is written (dtype, shape, a NaN / Inf / <= 0
  scale, a scale neither float32 nor the rollout's dtype, a non-zero offset, a loader whose
  quantizer keeps its own scales);
- `check_pair(...)`: refuse a complete pair the rollout would compute Inf / NaN with (a finite,
  positive, absurd scale: its dequantized values must be finite in the rollout's dtype);
- `take(...)`: hold a weight until its scale arrived or a scale until its weight (either order:
  another sender or checkpoint engine may reorder, and they may come in different buckets) and
  return the complete pair as it came (no copy), which the sync hands to its staging
  (`SyncLoad.stage_payload`, `in_place`, as its scheme's payload): a linear layer's staging writes it straight
  into the live weight in its processed layout (one pass over the int8 bytes, no buffer of the
  fused layer), the same per-layer commit then writes the scales and derived tensors.

A pair still incomplete at the end of the sync is a missing shard (`missing`): the end of the
sync names it and drops it, and a failed call drops it with everything else staged (`drop`).

The value checks run on the [out] scales, never per int8 element: an int8 payload cannot hold
NaN or Inf, and its magnitudes are at most 128, so a pair whose every scale is finite, > 0 and
has 128 x scale finite in the rollout's dtype dequantizes to finite values (rounding is
monotone); only a scale failing that bound makes a list call read its int8 rows (`check_pair`),
for the row's exact magnitude. A call's scale checks are read back together with its other
checks (`validate.DeferredChecks`): a list call's once, before anything of it is written; a
streamed call's before its sync's first write and at the end of the call, from each scale's
min, max and largest row (three device scalars per scale, no copy of it).
"""
from __future__ import annotations

import math
from typing import Callable, Dict, List, Optional, Set, Tuple

import torch

from npu_flashrl.config import FN_INT8_PROFILE_FREE
from npu_flashrl.quant import WeightSyncError
from npu_flashrl.quant.wire import PER_CHANNEL_INT8, WireFormat

# the only quantizer whose scales the trainer can reproduce (fresh absmax/127 per row)
WIRE_FN = FN_INT8_PROFILE_FREE


def _short(dtype: torch.dtype) -> str:
    return str(dtype).replace("torch.", "")


def _refuse_offset(name: str) -> None:
    raise WeightSyncError(f"{name}: non-zero weight_offset; the INT8 rollout is symmetric "
                          "(W8A8_DYNAMIC offsets are zero)")


def _refuse_streamed_scale(fmt: WireFormat, name: str, weight_name: str, lo: torch.Tensor,
                           hi: torch.Tensor, row: torch.Tensor, dtype: torch.dtype) -> None:
    """`WireReceiver.validate`'s and `check_pair`'s refusals of a streamed scale, from its
    extremes (its pair's int8 is written before the read-back and not read again: the bound
    128 x scale decides, as `check_pair` with `q` None). `fmt`: its layer's wire format."""
    lo_, hi_ = float(lo), float(hi)
    if not (math.isfinite(lo_) and math.isfinite(hi_)):
        raise WeightSyncError(f"{name}: contains NaN or Inf; refusing the sync")
    if lo_ <= 0:
        raise WeightSyncError(f"{name}: scales must be > 0, got min {lo_}; refusing the sync")
    if not bool(torch.isfinite((hi.float() * 128).to(dtype))):
        _refuse_bound(fmt, weight_name, int(row), hi_, dtype)


def _refuse_bound(fmt: WireFormat, weight_name: str, row: int, scale: float, dtype: torch.dtype) -> None:
    raise WeightSyncError(
        f"{fmt.scale_name(weight_name)}: row {row}'s scale "
        f"{scale:g} times 128 (the largest int8 magnitude; {weight_name} came in a streamed "
        f"call and is not read again) is {scale * 128:g}, not finite in {_short(dtype)} (the "
        "rollout's dtype): the rollout could compute Inf / NaN with it; refusing the sync")


def _refuse_overflow(fmt: WireFormat, weight_name: str, q: Optional[torch.Tensor], s: torch.Tensor,
                     bound: torch.Tensor, dtype: torch.dtype) -> None:
    """`WireReceiver.check_pair`'s refusal once a row's bound (128 x its scale `s`, in the
    rollout's dtype) is not finite: a streamed pair (`q` None) is refused on the bound; a pair
    with its int8 `q` reads its rows for each row's exact magnitude and is refused only when a
    dequantized value is not finite. `fmt`: its layer's wire format (the scale's name)."""
    if q is None:
        row = int((~torch.isfinite(bound)).nonzero()[0, 0])
        _refuse_bound(fmt, weight_name, row, float(s[row]), dtype)
    lo, hi = torch.aminmax(q, dim=1)
    absmax = torch.maximum(hi.float(), -lo.float())
    deq = absmax * s
    bad = ~(torch.isfinite(deq.to(dtype)) & torch.isfinite(s.to(dtype)))
    if bool(bad.any()):
        row = int(bad.nonzero()[0, 0])
        raise WeightSyncError(
            f"{fmt.scale_name(weight_name)}: row {row}'s scale {float(s[row]):g} times the "
            f"largest int8 magnitude of {weight_name} in that row ({int(absmax[row])}) is "
            f"{float(deq[row]):g}, not finite in {_short(dtype)} (the rollout's dtype): the "
            "rollout would compute Inf / NaN with it; refusing the sync")


class WirePair:
    """One projection's int8 weight and scale of this sync, until both have arrived."""

    def __init__(self, weight_name: str, fmt: WireFormat):
        self.name = weight_name
        self.scale_name = fmt.scale_name(weight_name)
        self.q: Optional[torch.Tensor] = None
        self.scale: Optional[torch.Tensor] = None
        self.borrowed = False  # holds a view of the caller's (bucket) tensor
        self.bounded = False  # its scale's streamed check covers the pair's bound (`take`)

    def missing(self) -> List[str]:
        return [n for n, t in ((self.name, self.q), (self.scale_name, self.scale)) if t is None]

    def buffers(self):
        return tuple(t for t in (self.q, self.scale) if t is not None)

    def keep(self) -> None:
        """Copy what is held out of the caller's tensors (a bucket buffer is reused after the
        call). Only a half waiting for its other half pays this copy, as it came (no transpose:
        the staging writes it in the processed layout)."""
        if self.borrowed:
            self.q = None if self.q is None else self.q.clone()
            self.scale = None if self.scale is None else self.scale.clone()
            self.borrowed = False


class WireReceiver:
    """The INT8-wire pairs of one sync. `target_of(name)`: the quantized layer (its target) an HF
    weight name loads into, or None; `quantizer`: the rollout's online quantizer (its fn and
    compute dtype decide what the wire may carry)."""

    def __init__(self, target_of: Callable[[str], object], quantizer):
        self._target_of = target_of
        self.quantizer = quantizer
        self._pairs: Dict[str, WirePair] = {}

    def _layer(self, weight_name: str):
        return self._target_of(weight_name)

    @staticmethod
    def _format(layer) -> WireFormat:
        """The tensor names of `layer`'s scheme on the wire (a scheme without a wire format: its
        checkpoint's, so that such a tensor is refused as a wire tensor by name)."""
        if layer is None:
            return PER_CHANNEL_INT8
        return layer.scheme.wire or layer.scheme.checkpoint

    def weight_of(self, name: str, tensor) -> Optional[str]:
        """The projection weight `name` is a wire tensor of, or None (a float-wire tensor). An
        int8 projection weight is wire data whichever half of its pair comes first; one whose
        scale never comes is named at the end of the sync."""
        if not isinstance(name, str) or not isinstance(tensor, torch.Tensor):
            return None
        if tensor.dtype == torch.int8 and self._layer(name) is not None:
            return name
        weight = name.rpartition(".")[0] + ".weight"
        layer = self._layer(weight)
        if layer is not None and self._format(layer).weight_of(name) == weight:
            return weight
        return None

    def half(self, name: str, weight_name: str) -> Optional[int]:
        """Which half of `weight_name`'s pair wire tensor `name` is: 0 the int8 weight, 1 its
        scale, None the (zero) offset."""
        if name == weight_name:
            return 0
        return None if self._format(self._layer(weight_name)).is_offset(name) else 1

    def held(self, weight_name: str) -> List[Optional[torch.Tensor]]:
        """[int8, scale] of `weight_name` held from earlier calls of this sync (None: not yet)."""
        pair = self._pairs.get(weight_name)
        return [None, None] if pair is None else [pair.q, pair.scale]

    def validate(self, name: str, weight_name: str, tensor: torch.Tensor, deferred=None,
                 kept: bool = True) -> None:
        """Refuse a wire tensor by name; with `deferred` (a `validate.DeferredChecks`), the value
        checks (zero offsets; finite, positive scales) are read back with the call's others.
        `kept` False: the caller may refill `tensor` after this item (a streamed call): a
        scale's deferred check keeps its extremes and largest row (three device scalars), not
        the tensor, and covers its pair's bound (128 x scale finite in the rollout's dtype)
        too. No check reads the int8 weight: its values cannot be NaN / Inf, and its row
        magnitudes are at most 128, so the scales decide alone (`check_pair`)."""
        quantizer = self.quantizer
        if getattr(quantizer, "name", None) != WIRE_FN:
            raise WeightSyncError(
                f"{name}: an INT8-wire tensor reached a rollout whose fn is "
                f"{getattr(quantizer, 'name', '?')!r}; the INT8 wire carries fresh per-channel "
                f"scales and needs fn '{WIRE_FN}' (FlashRL's `int8` profile scales live on the rollout "
                "only). Drop `wire: int8` from the FlashRL config entry or use fn int8_profile_free")
        layer = self._layer(weight_name)
        if layer.scheme.wire is None:
            raise WeightSyncError(
                f"{name}: {layer.path} runs vllm-ascend {layer.scheme.quant_type}, which has no "
                "INT8 wire format; send its float weights (drop `wire: int8`)")
        out = tuple(layer.full_shape(weight_name))
        if name == weight_name:
            if tuple(tensor.shape) != out:
                raise WeightSyncError(f"{name}: expected int8 shape {out}, got {tuple(tensor.shape)}")
            return
        out_rows = out[0]
        if not tensor.is_floating_point():
            raise WeightSyncError(f"{name}: expected a floating-point scale/offset, got {tensor.dtype}")
        if tuple(tensor.shape) not in ((out_rows,), (out_rows, 1)):
            raise WeightSyncError(f"{name}: expected shape ({out_rows}, 1) (W8A8_DYNAMIC, one per output "
                                  f"row of {weight_name}), got {tuple(tensor.shape)}")
        if self._format(layer).is_offset(name):
            if not tensor.numel():
                return
            nonzero = tensor.ne(0).any()
            if deferred is not None:  # an exact flag: its refusal needs no tensor
                deferred.add(~nonzero, lambda: _refuse_offset(name), exact=name)
            elif bool(nonzero):
                _refuse_offset(name)
            return
        dtype = quantizer.compute_dtype
        if tensor.dtype not in (torch.float32, dtype):
            # another float type would be rounded twice on the way to the rollout's dtype
            raise WeightSyncError(
                f"{name}: expected a float32 or {_short(dtype)} (the rollout's dtype) scale, got "
                f"{_short(tensor.dtype)}; send the scales the quantizer computed (float32) "
                "without casting them")
        if tensor.numel() and deferred is not None and not kept:
            s = tensor.reshape(-1).float()
            hi, row = s.max(0)
            lo = s.min()
            deferred.add_extremes(lo, hi, dtype, lambda: _refuse_streamed_scale(
                self._format(layer), name, weight_name, lo, hi, row, dtype), exact=name)
        elif tensor.numel() and deferred is not None:
            deferred.add_scales(tensor, dtype, lambda: self.validate(name, weight_name, tensor))
        elif tensor.numel():
            lo, hi = torch.aminmax(tensor.float())
            if not (bool(torch.isfinite(lo)) and bool(torch.isfinite(hi))):
                raise WeightSyncError(f"{name}: contains NaN or Inf; refusing the sync")
            if float(lo) <= 0:
                raise WeightSyncError(f"{name}: scales must be > 0, got min {float(lo)}; refusing the sync")

    def check_pair(self, weight_name: str, q: Optional[torch.Tensor], scale: torch.Tensor,
                   deferred=None) -> None:
        """Refuse a pair the rollout would compute Inf / NaN with: every row's scale, and the
        scale times the row's largest int8 magnitude (what dequantizing gives), must be finite in
        the rollout's dtype (a finite, positive 1e38 passes `validate` and overflows here). With
        `deferred`, the scales-only test is read back with the call's others, and this whole
        check runs only when it fails. `q` None: a streamed call's pair, whose int8 is written
        before the read-back and not read again: the bound 128 x scale decides alone (sound for
        what a trainer sends: its quantizer sets a row's scale to absmax / 127, so every row but
        an all-zero one (scale 1) holds a 127, and the bound refuses only scales within 1/128 of
        overflowing the rollout's dtype, which no finite weight of that dtype gives)."""
        if not (scale.numel() if q is None else q.numel()):
            return
        dtype = self.quantizer.compute_dtype
        s = scale.reshape(-1).float()
        # |int8| <= 128: when 128 x every scale is finite in the rollout's dtype, so is every
        # dequantized value (rounding is monotone), and the int8 weight need not be read at all
        if deferred is not None:
            deferred.add_scales(s, dtype, lambda: self.check_pair(weight_name, q, scale))
            return
        bound = (s * 128).to(dtype)
        if not bool(torch.isfinite(bound).all()):
            _refuse_overflow(self._format(self._layer(weight_name)), weight_name, q, s, bound, dtype)

    def take(self, name: str, weight_name: str, tensor: torch.Tensor, borrowed: bool,
             pair_checked: bool = False, deferred=None
             ) -> Tuple[Set[str], Optional[Tuple[torch.Tensor, torch.Tensor]]]:
        """Take one wire tensor: (the names loaded, the projection's (int8, fp32 scale [out]) once
        both are here, else None). `borrowed`: the tensor is a view the caller reuses after this
        call (kept past the call only through `keep`). `pair_checked`: a pair it completes was
        checked already (`check_pair`, by a list call before anything of it was written);
        `deferred` (a streamed call's `DeferredChecks`, whose scales were validated `kept=False`):
        the pair's bound is read back with the call's other checks, on its scale. The pair is
        returned as it came: a complete pair is written before the call returns, so nothing of
        the caller's memory needs copying."""
        fmt = self._format(self._layer(weight_name))
        if fmt.is_offset(name):
            return {name}, None  # validated zero; the commit zeroes the live offset
        pair = self._pairs.get(weight_name)
        if pair is None:
            pair = self._pairs[weight_name] = WirePair(weight_name, fmt)
        if name == weight_name:
            pair.q = tensor
        else:
            pair.scale = tensor
            pair.bounded = deferred is not None  # its streamed check covers the pair's bound
        if pair.q is None or pair.scale is None:
            pair.borrowed = True
            if not borrowed:  # a streamed caller may reuse its buffer for its next item
                pair.keep()
            return {name}, None
        if deferred is not None:
            if not pair.bounded:  # a scale held from an earlier (list) call: a copy, kept
                self.check_pair(weight_name, None, pair.scale, deferred=deferred)
        elif not pair_checked:
            self.check_pair(weight_name, pair.q, pair.scale)
        del self._pairs[weight_name]
        return {weight_name, pair.scale_name}, (pair.q, pair.scale.reshape(-1).float())

    def keep(self) -> None:
        """End of a load_weights call: incomplete pairs copy what they hold of the caller's tensors."""
        for pair in self._pairs.values():
            pair.keep()

    def missing(self) -> List[str]:
        return [n for pair in self._pairs.values() for n in pair.missing()]

    def arrived_halves(self) -> List[str]:
        """The halves that came of the pairs still incomplete."""
        return [n for w, p in self._pairs.items() for n in sorted({w, p.scale_name} - set(p.missing()))]

    def received(self) -> Dict[str, List[str]]:
        return {w: sorted({w, p.scale_name} - set(p.missing())) for w, p in self._pairs.items()}

    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for p in self._pairs.values() for t in p.buffers())

    def drop(self) -> None:
        self._pairs.clear()
