"""FlashRL's int8 profile, computed shard by shard from safetensors checkpoints.

Format (FlashRL 1.0.3, `flash_rl.flash_quantization.profiling_int8`): a `torch.save`d dict keyed by
HF parameter name, each value `{'input_scale', 'output_scale', 'type'}`; online quantization is
`round(W * output_scale * input_scale).clamp(-128, 127).to(type)` for int8 entries and
`(W * input_scale).to(type)` for the others. Entries, in FlashRL's order:

* every tensor whose name contains ``layernorm``: input_scale = ln_w8a8 / ln_bf16 (fp32, shape of
  the weight), output_scale 1.0 (python float), type = dtype of the w8a8 layernorm;
* ``self_attn.{q,k,v}_proj.weight`` / ``mlp.{gate,up}_proj.weight``: input_scale = 1 / (that
  ratio of the feeding layernorm) as [1, in] fp32, output_scale = 1 / weight_scale as [out, 1] fp32,
  type int8; for up_proj a least-squares row factor beta (bf16 weight brought to the int8 grid vs the
  checkpoint's int8 weight) is folded in: output_scale = 1 / (weight_scale / beta);
* ``self_attn.o_proj.weight``: input_scale 1.0 (python float), output_scale = 1 / weight_scale;
* ``mlp.down_proj.weight``: input_scale = 1 / beta of the layer's up_proj as [1, intermediate].

Differences from FlashRL's own profiler, on purpose: it loads both whole models with transformers;
this reads one decoder layer's tensors at a time with `safetensors.safe_open`, and it checks the pair
(FlashRL does not): every bf16 projection quantized with its new entry must land on the W8A8
checkpoint's int8 weight within rounding, so `-m base -q Instruct-W8A8` is refused naming the
tensor. Numbers are the same (same fp32 ops in the
same order). `type` of the layernorm entries is the w8a8 checkpoint's dtype (bf16 for RedHatAI
checkpoints); FlashRL reports whatever dtype transformers loaded the quantized model in (float16 on
transformers 4.57 when no dtype is given), which only decides an intermediate cast. Tensors carry no
autograd state (FlashRL's do, as a side effect of computing from nn.Parameters).
"""
from __future__ import annotations

import io
import math
import os
import re
from typing import Any, Dict, Iterable, List, Mapping, Optional, Tuple

import torch

from npu_flashrl._files import special_file_problem
from npu_flashrl._logging import get_logger
from npu_flashrl.checkpoint import SafetensorsCheckpoint, _first_line  # noqa: F401  (re-exported)
from npu_flashrl.errors import ProfileError  # noqa: F401  (re-exported: npu_flashrl.profile.ProfileError)
from npu_flashrl.quant.projections import is_dense_projection
from npu_flashrl.quant.profile import MOE_FIX  # noqa: F401  (one home; verify / commands import it here)
from npu_flashrl.quant.profile import (  # noqa: F401  (the profile's name rules live with its quantizer)
    INPUT_LINEAR_MAP, LAYERNORM_KEY, OUTPUT_LINEAR_MAP, profile_entry_names, profile_problems)

logger = get_logger(__name__)

EXTRA_OUTPUT = ("mlp.up_proj.weight",)
PROFILE_FIELDS = ("input_scale", "output_scale", "type")

# FlashRL iterates named_parameters (module order); within a decoder layer that is:
_MODULE_ORDER = ("self_attn.q_proj.", "self_attn.k_proj.", "self_attn.v_proj.", "self_attn.o_proj.",
                 "mlp.gate_proj.", "mlp.up_proj.", "mlp.down_proj.", "input_layernorm.",
                 "post_attention_layernorm.")
_LAYER_RE = re.compile(r"^(.*?\.layers\.)(\d+)\.")


def _order_key(name: str) -> Tuple:
    m = _LAYER_RE.match(name)
    rest = name[m.end():] if m else name
    pos = next((i for i, p in enumerate(_MODULE_ORDER) if rest.startswith(p)), len(_MODULE_ORDER))
    return (m.group(1) if m else "", int(m.group(2)) if m else -1, pos, rest)


def _layer_groups(names: Iterable[str]) -> List[List[str]]:
    """Names grouped per decoder layer (FlashRL's lookups never leave a layer), non-layer names first."""
    groups: Dict[Tuple[str, int], List[str]] = {}
    for name in names:
        m = _LAYER_RE.match(name)
        key = (m.group(1), int(m.group(2))) if m else ("", -1)
        groups.setdefault(key, []).append(name)
    return [sorted(groups[k], key=_order_key) for k in sorted(groups)]


# ----------------------------------------------------------------------------- computation

def _least_square(from_p: torch.Tensor, to_p: torch.Tensor, dim: int = -1) -> torch.Tensor:
    to_p = to_p.float()
    return (to_p * from_p).sum(dim=dim, keepdim=True) / (from_p ** 2).sum(dim=dim, keepdim=True)


# The bf16 weight through its profile entry must land on the W8A8 checkpoint's int8 grid: a true
# pair misses by int8 rounding plus the bf16 rounding of the smoothed weights (relative RMS below
# 1%, no value off by more than 2); another model of the same shape misses by ~100%.
PAIR_MAX_REL_RMS = 0.05
PAIR_MAX_OFF2_FRACTION = 1e-3


def pair_problem(name: str, weight: torch.Tensor, int8_weight: torch.Tensor, entry: Mapping[str, Any]) -> Optional[str]:
    """Why `entry` does not map the bf16 `weight` onto the checkpoint's `int8_weight` (None: it does)."""
    for field in ("input_scale", "output_scale"):
        value = entry[field]
        bad = (value <= 0).any() if isinstance(value, torch.Tensor) else value <= 0
        if bool(bad):
            return f"{name}: {field} has non-positive values (scales of a true bf16/W8A8 pair are > 0)"
    ref = int8_weight.float()
    if ref.shape != weight.shape:
        return f"{name}: shape {tuple(ref.shape)} in the W8A8 checkpoint, {tuple(weight.shape)} in the bf16 one"
    online = torch.round(weight.float() * entry["output_scale"] * entry["input_scale"]).clamp(-128, 127)
    off = (online - ref).abs()
    rel_rms = float(off.pow(2).mean().sqrt() / ref.pow(2).mean().sqrt().clamp(min=1e-12))
    off2 = float((off > 2).float().mean())
    if rel_rms > PAIR_MAX_REL_RMS or off2 > PAIR_MAX_OFF2_FRACTION:
        return (f"{name}: the bf16 weight quantized with this profile misses the W8A8 checkpoint's int8 "
                f"weight (relative RMS error {rel_rms:.3g}, int8 rounding gives < {PAIR_MAX_REL_RMS}; "
                f"{100 * off2:.3g}% of the values off by more than 2)")
    return None


def _int8_entry(input_scale, original_output_scale: torch.Tensor) -> Dict[str, Any]:
    """One int8 linear's profile entry (PROFILE_FIELDS): the output scale is the inverse of the
    quantized checkpoint's, in fp32."""
    return {"input_scale": input_scale, "output_scale": 1.0 / original_output_scale.float(),
            "type": torch.int8}


class _CheckpointPair:
    """The bf16 checkpoint (-m) and its W8A8 checkpoint (-q) a profile is computed from, read one
    decoder layer at a time; each of FlashRL's passes over a layer is one method."""

    def __init__(self, bf16_dir: str, w8a8_dir: str):
        self.bf16_dir, self.w8a8_dir = bf16_dir, w8a8_dir
        self.bf16 = SafetensorsCheckpoint(bf16_dir)
        self._refuse_int8_base()
        self.quant = SafetensorsCheckpoint(w8a8_dir)
        self.ln_entries: Dict[str, dict] = {}
        self.lin_entries: Dict[str, dict] = {}
        self.out_entries: Dict[str, dict] = {}

    def close(self) -> None:
        self.bf16.close()
        self.quant.close()

    def _refuse_int8_base(self) -> None:
        bf16 = self.bf16
        int8_in_bf16 = sorted((n for n in bf16.names() if is_dense_projection(n) and bf16.dtype(n) == "I8"),
                              key=_order_key)
        if int8_in_bf16:
            bf16.close()
            first = int8_in_bf16[0]
            same = os.path.realpath(self.bf16_dir) == os.path.realpath(self.w8a8_dir)
            raise ProfileError(f"-m {self.bf16_dir}: {bf16.files[first]}: {first} is int8: -m must be the original "
                               f"bf16/fp16 checkpoint, not a W8A8 one"
                               + (" (-m and -q are the same dir)" if same else f" (-q {self.w8a8_dir} is the W8A8 one)"))

    def qget(self, name: str, what: str) -> torch.Tensor:
        if name not in self.quant:
            raise ProfileError(f"{self.w8a8_dir}: tensor {name!r} ({what}) not found; -q must be the "
                               f"compressed-tensors W8A8 checkpoint of the model given with -m ({self.bf16_dir})")
        return self.quant.get(name)

    def scale_of(self, name: str, rows: int) -> torch.Tensor:
        scale = self.qget(name + "_scale", "per-channel weight scale")
        if scale.numel() != rows:
            raise ProfileError(f"{self.w8a8_dir}: {name}_scale has {scale.numel()} values, expected one per "
                               f"output row ({rows}); only per-channel W8A8 checkpoints are supported")
        problem = weight_scale_problem(scale, f"{self.quant.files[name + '_scale']}: {name}_scale")
        if problem:  # the checkpoint's fault, said before any profile entry is made from it
            raise ProfileError(f"-q {problem}")
        return scale.view(-1, 1)

    def check_int8(self, name: str) -> None:
        dt = self.quant.dtype_str(name) if name in self.quant else None
        if dt is not None and dt != "I8":
            raise ProfileError(f"{self.w8a8_dir}: {name} is {dt}, expected int8 (I8): is -q a W8A8 checkpoint?")

    def layernorm_pass(self, group: List[str], input_scale: Dict[str, torch.Tensor]) -> None:
        """FlashRL pass 1: layernorm smoothing ratios."""
        for k in group:
            if LAYERNORM_KEY not in k:
                continue
            ln = self.bf16.get(k)
            lnq = self.qget(k, "layernorm weight")
            if lnq.shape != ln.shape:
                raise ProfileError(f"{k}: shape {tuple(lnq.shape)} in {self.w8a8_dir} but "
                                   f"{tuple(ln.shape)} in {self.bf16_dir}: not the same model")
            if bool((ln == 0).any()) or not bool(torch.isfinite(ln.float()).all()):
                bad = int(((ln == 0) | ~torch.isfinite(ln.float())).sum())
                raise ProfileError(f"-m {self.bf16.files[k]}: {k} has {bad} zero or non-finite value(s): the "
                                   f"smoothing ratio (W8A8 layernorm / bf16 layernorm) is undefined there")
            ratio = lnq / ln.float()
            self.ln_entries[k] = {"input_scale": ratio, "output_scale": 1.0, "type": lnq.dtype}
            input_scale[k] = ratio

    def _input_of(self, k: str, balance: str, smooth: str, input_scale: Dict[str, torch.Tensor]) -> torch.Tensor:
        input_name = k.replace(balance, smooth)
        if input_name not in input_scale:
            raise ProfileError(f"{self.bf16_dir}: {k} needs {input_name}, which is missing")
        return input_scale[input_name].view(1, -1)

    def _int8_linears(self, group: List[str], mapping: Dict[str, Optional[str]]):
        """Each name of `group` with the first (balance, smooth) of `mapping` whose balance it
        contains, checked to be an int8 weight (`check_int8`) as it comes."""
        for k in group:
            for balance, smooth in mapping.items():
                if balance in k:
                    self.check_int8(k)
                    yield k, balance, smooth
                    break

    def input_linear_pass(self, group: List[str], input_scale: Dict[str, torch.Tensor]) -> None:
        """Pass 2: linears fed by a layernorm (and o_proj)."""
        for k, balance, smooth in self._int8_linears(group, INPUT_LINEAR_MAP):
            original_output_scale = self.scale_of(k, self.bf16.shape(k)[0])
            if smooth is None:
                self.lin_entries[k] = _int8_entry(1.0, original_output_scale)
            else:
                input_scale_k = self._input_of(k, balance, smooth, input_scale)
                if any(e in k for e in EXTRA_OUTPUT):
                    w = self.bf16.get(k)
                    wq = self.qget(k, "int8 weight")
                    beta = _least_square(
                        (w.float() / input_scale_k / original_output_scale).view(w.shape[0], -1),
                        wq.view(w.shape[0], -1)).view(-1, 1)
                    del w, wq
                    input_scale[k] = beta
                    original_output_scale = original_output_scale.float() / beta
                self.lin_entries[k] = _int8_entry(1.0 / input_scale_k, original_output_scale)

    def output_linear_pass(self, group: List[str], input_scale: Dict[str, torch.Tensor]) -> None:
        """Pass 3: down_proj takes 1/beta of up_proj."""
        for k, balance, smooth in self._int8_linears(group, OUTPUT_LINEAR_MAP):
            input_scale_k = self._input_of(k, balance, smooth, input_scale)
            original_output_scale = self.scale_of(k, self.bf16.shape(k)[0])
            self.out_entries[k] = _int8_entry(1.0 / input_scale_k, original_output_scale)

    def pair_pass(self, group: List[str]) -> None:
        """Pass 4: -m and -q must be one model (base vs Instruct gives garbage)."""
        for k in group:
            entry = self.lin_entries.get(k) or self.out_entries.get(k)
            if entry is None:
                continue
            for field in ("input_scale", "output_scale"):
                _check_scale(entry[field], f"{k} {field}")
            problem = pair_problem(k, self.bf16.get(k), self.qget(k, "int8 weight"), entry)
            if problem:
                raise ProfileError(f"-m {self.bf16_dir} and -q {self.w8a8_dir} are not a bf16 model and its "
                                   f"W8A8 checkpoint; first offending tensor {problem}")


def compute_int8_profile(bf16_dir: str, w8a8_dir: str, progress: bool = True) -> Dict[str, dict]:
    """FlashRL's int8 profile from a bf16 checkpoint and its compressed-tensors W8A8 checkpoint."""
    from tqdm.auto import tqdm

    pair = _CheckpointPair(bf16_dir, w8a8_dir)
    try:
        groups = _layer_groups(pair.bf16.names())
        for group in tqdm(groups, desc="npu-flashrl profile (int8)", unit="layer", disable=not progress):
            input_scale: Dict[str, torch.Tensor] = {}
            pair.layernorm_pass(group, input_scale)
            pair.input_linear_pass(group, input_scale)
            pair.output_linear_pass(group, input_scale)
            pair.pair_pass(group)
    finally:
        pair.close()
    profile = {**pair.ln_entries, **pair.lin_entries, **pair.out_entries}
    if not any(v["type"] == torch.int8 for v in profile.values()):
        raise ProfileError(f"{bf16_dir}: no q/k/v/o/gate/up/down projection weights found; only dense "
                           f"Llama/Qwen2-style checkpoints are supported")
    return profile


# ----------------------------------------------------------------------------- files

def save_profile(profile: Mapping[str, dict], path: str) -> str:
    """torch.save the profile atomically (a failure leaves an existing file untouched)."""
    from npu_flashrl.config import atomic_write

    validate_profile(profile, path)
    buf = io.BytesIO()
    torch.save(dict(profile), buf)
    atomic_write(path, lambda f: f.write(buf.getvalue()), binary=True)
    return path


def make_profile(bf16_dir: str, w8a8_dir: str, output: str, fn: str = "int8",
                 progress: bool = True) -> Dict[str, dict]:
    """`npu-flashrl profile`: compute and save. Only fn=int8 has a profile."""
    if fn != "int8":
        raise ProfileError(f"--fn {fn}: only int8 has a profile (FlashRL's fp8 profile is refused: "
                           f"Ascend 910B has no FP8 matmul; int8_profile_free needs none)")
    from npu_flashrl.config import output_path_problem

    problem = output_path_problem(output)  # before reading two whole checkpoints
    if problem:
        raise ProfileError(f"-o {problem}")
    moe = moe_profile_problem(bf16_dir)
    if moe:
        raise ProfileError(f"-m {moe}; a MoE rollout needs no profile: {MOE_FIX}")
    modelslim = modelslim_profile_problem(w8a8_dir)
    if modelslim:
        raise ProfileError(f"-q {modelslim}")
    profile = compute_int8_profile(bf16_dir, w8a8_dir, progress=progress)
    save_profile(profile, output)
    logger.info("int8 profile with %d entries written to %s", len(profile), output)
    return profile


def weight_scale_problem(scale: torch.Tensor, where: str) -> Optional[str]:
    """Why a W8A8 checkpoint's weight_scale tensor is unusable (None: every value finite and > 0),
    naming each kind: a zero, negative, NaN or Inf scale is a corrupt checkpoint, not a bad profile."""
    if not scale.is_floating_point():
        return f"{where}: dtype {scale.dtype}, expected a floating weight scale"
    v = scale.float()
    kinds = [(int(torch.isnan(v).sum()), "NaN"), (int(torch.isinf(v).sum()), "infinite"),
             (int((v == 0).sum()), "zero"), (int((v < 0).sum()), "negative")]
    found = [f"{n} {kind}" for n, kind in kinds if n]
    if not found:
        return None
    return (f"{where}: {', '.join(found)} value(s) of {v.numel()}; a W8A8 checkpoint's weight scales are "
            f"finite and > 0: the checkpoint is corrupt (re-download or re-quantize it)")


def _check_scale(value: Any, where: str) -> None:
    if isinstance(value, (int, float)) and not isinstance(value, bool):
        if not math.isfinite(value):
            raise ProfileError(f"{where}: not finite ({value})")
        if value <= 0:
            raise ProfileError(f"{where}: {value} is not positive (scales of a bf16/W8A8 pair are > 0)")
        return
    if not isinstance(value, torch.Tensor):
        raise ProfileError(f"{where}: expected a float or a tensor; got {type(value).__name__}")
    if not value.is_floating_point():
        raise ProfileError(f"{where}: expected a floating tensor; got {value.dtype}")
    if not bool(torch.isfinite(value).all()):
        bad = int((~torch.isfinite(value)).sum())
        raise ProfileError(f"{where}: {bad} non-finite value(s) (a zero layernorm weight or "
                           f"weight_scale in the checkpoints?)")
    if bool((value <= 0).any()):
        bad = int((value <= 0).sum())
        raise ProfileError(f"{where}: {bad} non-positive value(s) (scales of a bf16 model and its own "
                           f"W8A8 checkpoint are > 0: was the profile made from two different models?)")


def validate_profile(profile: Any, source: str = "<profile>") -> Dict[str, dict]:
    """Check a profile's structure (FlashRL format); returns it. Raises ProfileError naming the key."""
    if not isinstance(profile, Mapping):
        raise ProfileError(f"{source}: expected a dict keyed by parameter name (FlashRL int8 profile); "
                           f"got {type(profile).__name__} (an fp8 profile is a list and is not supported)")
    if not profile:
        raise ProfileError(f"{source}: the profile is empty")
    for name, entry in profile.items():
        if not isinstance(name, str):
            raise ProfileError(f"{source}: key {name!r} is not a parameter name")
        if not isinstance(entry, Mapping) or any(f not in entry for f in PROFILE_FIELDS):
            raise ProfileError(f"{source}: entry {name!r} must be a dict with keys {PROFILE_FIELDS}")
        if not isinstance(entry["type"], torch.dtype):
            raise ProfileError(f"{source}: entry {name!r}: type must be a torch.dtype; got {entry['type']!r}")
        for field in ("input_scale", "output_scale"):
            _check_scale(entry[field], f"{source}: entry {name!r} {field}")
        if entry["type"] == torch.int8:
            ins, outs = entry["input_scale"], entry["output_scale"]
            if isinstance(ins, torch.Tensor) and (ins.dim() != 2 or ins.shape[0] != 1):
                raise ProfileError(f"{source}: entry {name!r} input_scale has shape {tuple(ins.shape)}, "
                                   f"expected [1, in_features]")
            if isinstance(outs, torch.Tensor) and (outs.dim() != 2 or outs.shape[1] != 1):
                raise ProfileError(f"{source}: entry {name!r} output_scale has shape {tuple(outs.shape)}, "
                                   f"expected [out_features, 1]")
    return dict(profile)


def _load_refusal(path: str, exc: BaseException) -> str:
    """Why torch.load(weights_only=True) refused `path`, without torch's advice to load it with
    weights_only=False (that runs whatever code the file carries: never for a profile)."""
    text = str(exc)
    if "weights_only" in text or "Weights only load failed" in text:
        detail = next((line.strip() for line in text.splitlines()
                       if "Unsupported" in line or "WeightsUnpickler error" in line), "")
        detail = detail.replace("WeightsUnpickler error: ", "").split(". ")[0]
        if "Unsupported global" in detail:  # a pickle naming code to run: refused, never retried
            return (f"{path}: refused: the file holds Python objects beyond tensors, numbers and dtypes "
                    f"({detail}); a FlashRL profile holds only those, so this is not one (or it was "
                    f"tampered with): make the profile with `npu-flashrl profile`")
        return f"{path}: not a readable torch profile (not a torch.save file{': ' + detail if detail else ''})"
    first = next((line.strip() for line in text.splitlines() if line.strip()), "")
    return f"{path}: not a readable torch profile ({type(exc).__name__}{': ' + first if first else ''})"


def load_profile(path: str) -> Dict[str, dict]:
    """Load and validate a FlashRL int8 profile: {param name: {input_scale, output_scale, type}}."""
    path = os.fspath(path)
    try:
        os.stat(path)
    except PermissionError as exc:  # not "not found": a directory on the way is not searchable
        raise ProfileError(f"{path}: cannot access: {exc.strerror} (check the permissions of its "
                           f"directories)") from exc
    except OSError:
        pass
    if not os.path.exists(path):
        raise ProfileError(f"{path}: profile not found (make one with `npu-flashrl profile -m BF16 -q W8A8 -o {path}`)")
    if os.path.isdir(path):
        raise ProfileError(f"{path}: is a directory; expected a profile file (.pt)")
    special = special_file_problem(path)
    if special:  # before opening: a FIFO would block here
        raise ProfileError(f"{path}: {special} (a profile .pt)")
    try:
        with open(path, "rb"):
            pass
    except OSError as exc:
        raise ProfileError(f"{path}: cannot read: {exc.strerror or exc} (the file exists; check its "
                           f"permissions)") from exc
    try:
        profile = torch.load(path, map_location="cpu", weights_only=True)
    except Exception as exc:
        raise ProfileError(_load_refusal(path, exc)) from None
    return validate_profile(profile, path)


# ----------------------------------------------------------------------------- consistency

def expected_profile_names(model_dir: str) -> List[str]:
    """Names FlashRL's profiler makes entries for, from a checkpoint's tensor names."""
    ckpt = SafetensorsCheckpoint(model_dir)
    try:
        return profile_entry_names(ckpt.names())
    finally:
        ckpt.close()


_EXPERT = re.compile(r"\.experts\.\d+\.(gate|up|down)_proj\.weight$")


def moe_profile_problem(model_dir: str) -> Optional[str]:
    """Why FlashRL's int8 profile cannot serve ``model_dir`` (None: a dense model): it has
    entries for the seven dense projections only, and a MoE model's routed experts are not among
    them. Read from the safetensors headers; an unreadable dir gives None (reported elsewhere)."""
    try:
        ckpt = SafetensorsCheckpoint(model_dir)
    except ProfileError:
        return None
    try:
        experts = [n for n in ckpt.names() if _EXPERT.search(n)]
        if not experts:
            return None
        first = sorted(experts, key=_order_key)[0]
        return (f"{ckpt.files[first]}: {first} is a MoE expert ({len(experts)} expert weights): "
                "FlashRL's int8 profile covers the dense projections only")
    finally:
        ckpt.close()


def modelslim_profile_problem(model_dir: str) -> Optional[str]:
    """Why FlashRL's int8 profile cannot be made from / used with ``model_dir`` because it is a
    ModelSlim checkpoint (None: it has no quant_model_description.json). The profile is made from a
    compressed-tensors W8A8 checkpoint: a ModelSlim one carries tensors no profile entry covers
    (`weight_offset`; a static W8A8 one `input_scale`, `deq_scale`, `quant_bias`), so setup's
    profile check would refuse the profile made from it. Its layers run with no profile instead."""
    from npu_flashrl.adapters.vllm_ascend.description import DESCRIPTION_FILE, FLOAT
    from npu_flashrl.config import FN_INT8_PROFILE_FREE
    from npu_flashrl.quant.w4a8 import W4A8_DYNAMIC, W4A8Quantizer

    path = os.path.join(model_dir, DESCRIPTION_FILE)
    if not os.path.exists(path):
        return None
    types: List[str] = []
    try:
        import json

        with open(path, encoding="utf-8") as f:
            desc = json.load(f)
        types = sorted({v for k, v in desc.items() if k.endswith(".weight") and isinstance(v, str) and v != FLOAT})
    except (OSError, UnicodeDecodeError, ValueError, AttributeError):
        pass  # unreadable: the description check names it; the refusal stands
    fn = W4A8Quantizer.name if types == [W4A8_DYNAMIC] else FN_INT8_PROFILE_FREE
    typed = f" (its layers typed {', '.join(types)})" if types else ""
    return (f"{model_dir} is a ModelSlim checkpoint ({path}{typed}): FlashRL's int8 profile (fn int8) is made "
            "from and used with a compressed-tensors W8A8 checkpoint, and no profile covers a ModelSlim "
            f"checkpoint's tensors; run it without a profile: npu-flashrl setup --fn {fn} -m {model_dir}")


def check_w8a8_checkpoint(model_dir: str, limit: int = 3) -> List[str]:
    """Why ``model_dir`` is not a W8A8 checkpoint (empty list: it is), from the safetensors headers.

    ``fn: int8`` loads the rollout model from a W8A8 checkpoint and keeps its ``weight_scale`` for
    every sync (the profile's scales assume them): its projections must be int8 with a
    ``weight_scale`` each. Each line names the file and the tensor.
    """
    modelslim = modelslim_profile_problem(model_dir)
    if modelslim:
        return [modelslim]
    try:
        ckpt = SafetensorsCheckpoint(model_dir)
    except ProfileError as exc:
        return [str(exc)]
    problems: List[str] = []
    try:
        projections = sorted((n for n in ckpt.names() if is_dense_projection(n)), key=_order_key)
        if not projections:
            return [f"{model_dir}: no q/k/v/o/gate/up/down_proj weights in its safetensors"]
        int8 = [n for n in projections if ckpt.dtype(n) == "I8"]
        if not int8:
            first = projections[0]
            return [f"{ckpt.files[first]}: {first} is {ckpt.dtype(first)}, not int8, and "
                    f"{first[:-len('weight')]}weight_scale is missing: not a W8A8 checkpoint"]
        for name in int8:
            scale = name[: -len("weight")] + "weight_scale"
            if scale not in ckpt:
                problems.append(f"{ckpt.files[name]}: {scale} is missing (int8 {name} without its scale)")
                if len(problems) >= limit:
                    break
    finally:
        ckpt.close()
    return problems


def corrupt_scale_problems(model_dir: str, limit: int = 3) -> List[str]:
    """W8A8 weight_scale tensors of ``model_dir`` with zero, negative, NaN or Inf values (one value
    per output row: small, read in full); each line names the file and the tensor."""
    try:
        ckpt = SafetensorsCheckpoint(model_dir)
    except ProfileError as exc:
        return [str(exc)]
    problems: List[str] = []
    try:
        for name in sorted((n for n in ckpt.names() if n.endswith("_proj.weight_scale")), key=_order_key):
            problem = weight_scale_problem(ckpt.get(name), f"{ckpt.files[name]}: {name}")
            if problem:
                problems.append(problem)
                if len(problems) >= limit:
                    break
    finally:
        ckpt.close()
    return problems


def check_profile_against_model(profile: Mapping[str, dict], model_dir: str, limit: int = 5) -> List[str]:
    """First `limit` inconsistencies between a profile and a checkpoint (empty list: consistent).

    Each line names the tensor: missing from the model, wrong shape, or a model tensor the profile
    does not cover (it would be loaded unquantized into an int8 parameter, or a layernorm left
    unsmoothed). `profile_problems` is the check, the one the engine build runs too; here the
    shapes come from the safetensors headers, plus the checkpoint's own weight_scale.
    """
    ckpt = SafetensorsCheckpoint(model_dir)

    def output_scale_of_this_checkpoint(name: str, entry: Mapping[str, Any]) -> Optional[str]:
        outs = entry.get("output_scale")
        if (entry.get("type") == torch.int8 and isinstance(outs, torch.Tensor)
                and name + "_scale" in ckpt and not any(e in name for e in EXTRA_OUTPUT)):
            # output_scale is 1 / weight_scale of the W8A8 checkpoint it was made from
            # (up_proj folds in beta): another model of the same shape differs here
            ws = ckpt.get(name + "_scale").float().view(-1, 1)
            problem = weight_scale_problem(ws, f"{ckpt.files[name + '_scale']}: {name}_scale")
            if problem:  # the checkpoint's fault, not the profile's
                return problem
            if ws.shape == outs.shape and not torch.allclose(outs.float() * ws, torch.ones_like(ws),
                                                              rtol=0, atol=1e-2):
                worst = float((outs.float() * ws - 1).abs().max())
                return (f"{name}: profile output_scale is not 1 / weight_scale of {model_dir} (off by "
                        f"up to {worst:.3g}): the profile was made from another W8A8 checkpoint")
        return None

    try:
        shapes = {n: ckpt.shape(n) for n in ckpt.names()}
        return profile_problems(profile, shapes, model_dir, limit=limit,
                                entry_check=output_scale_of_this_checkpoint)
    finally:
        ckpt.close()
