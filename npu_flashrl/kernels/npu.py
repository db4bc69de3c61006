"""NPU implementations of the INT8 kernels: the same semantics as `reference`, on torch_npu ops.

Only imported when a tensor lives on an NPU. Not verified on hardware here (no NPU in CI); run
`pytest tests/kernels/test_kernels.py --npu` on an Atlas node to compare against the reference.
"""
from __future__ import annotations

from typing import Optional, Tuple

import torch

from npu_flashrl.kernels import op_rules, reference


def quantize_weight_per_channel(weight: torch.Tensor, compute_dtype: Optional[torch.dtype] = None,
                                transposed: bool = False, finite: Optional[list] = None
                                ) -> Tuple[torch.Tensor, torch.Tensor]:
    """The device's kernel mix (what `sim.device_costs` counts): one `npu_dynamic_quant` over the
    weight, with the NaN / Inf refusal read off its scales when this device's op carries a NaN
    or Inf row into its scale (`device_facts`), else one all-finite pass before it; rows longer
    than this device's `npu_dynamic_quant` takes, one aminmax pass and `npu_quantize`.

    `transposed` asks for [in, out] memory where that costs nothing more: the long-row path
    produces it; npu_dynamic_quant's [out, in] result is returned as it is (a transposing copy
    here would read and write every int8 byte once more, and the copy that takes it into the
    processed layout, the staging's weight_loader, transposes at a plain copy's traffic).
    Callers rely on the values, not on the memory layout. `finite` (a list): the NaN / Inf
    refusal is appended to it as a device-side bool instead of read back here (`kernels`)."""
    import torch_npu  # noqa: F401  (real torch_npu on an NPU node)

    if compute_dtype is not None and weight.dtype != compute_dtype:
        weight = weight.to(compute_dtype)
    if weight.dtype == torch.float32:
        weight = weight.to(torch.bfloat16)
    facts = device_facts(weight.device)
    if weight.shape[-1] > op_rules.DYNAMIC_QUANT_MAX_ROW_A2_6_0_RC3 and not facts["long_rows"]:
        # npu_dynamic_quant's page limits a row to 11264 values on Atlas A2 up to Ascend
        # Extension for PyTorch 6.0.RC3 (Qwen2.5-7B's down_proj rows have 18944); the release
        # cannot be told reliably from torch_npu.__version__, so the probe tried one such row
        return _per_channel_by_quantize(weight, transposed, finite)
    if not facts["nonfinite_in_scale"]:
        # The reference's refusal, in one reduction pass: a NaN/Inf row would otherwise give a
        # non-finite scale (or, on hardware, a saturated int8 row) and poison the rollout silently.
        lo, hi = torch.aminmax(weight)
        _refuse_nonfinite(torch.isfinite(lo) & torch.isfinite(hi), finite)
    # Per-row symmetric int8 with scale = rowmax/127 is exactly npu_dynamic_quant on the rows.
    q, scale = torch_npu.npu_dynamic_quant(weight)
    if facts["nonfinite_in_scale"]:
        _refuse_nonfinite(torch.isfinite(scale).all(), finite)
    # An all-zero row: the reference defines scale 1.0 (q is 0 either way).
    scale = torch.where(scale > 0, scale, 1.0)
    return q, scale


def _refuse_nonfinite(ok: torch.Tensor, finite: Optional[list]) -> None:
    """Raise on a False device flag now (one host synchronisation), or hand it to the caller."""
    if finite is not None:
        finite.append(ok)
    elif not bool(ok):
        raise ValueError("quantize_weight_per_channel: weight contains NaN or Inf")


def _per_channel_by_quantize(weight: torch.Tensor, transposed: bool, finite: Optional[list] = None
                             ) -> Tuple[torch.Tensor, torch.Tensor]:
    """scale = rowmax|w| / 127 in fp32 (1.0 for an all-zero row), q = npu_quantize(w / scale):
    div_mode True takes a float32 scales tensor along the LAST axis (the only elementwise axis
    older releases document), so it quantizes w^T [in, out] with one scale per column; the
    result is already the processed [in, out] layout. The row extremes come from one aminmax
    pass, which also refuses NaN / Inf (they reach a row's min or max as they reach the all-finite
    pass's, `reference.all_finite`)."""
    import torch_npu  # noqa: F401

    lo, hi = torch.aminmax(weight, dim=1)
    _refuse_nonfinite(torch.isfinite(lo).all() & torch.isfinite(hi).all(), finite)
    absmax = torch.maximum(hi, lo.neg()).float()
    scale = torch.where(absmax > 0, absmax / reference.INT8_MAX, 1.0)
    q_t = torch_npu.npu_quantize(weight.t(), scale, None, torch.qint8, -1, True).contiguous()  # [in, out]
    q = q_t.t()
    return (q if transposed else q.contiguous()), scale


_facts: dict = {}


def device_facts(device: torch.device) -> dict:
    """What this device's torch_npu does where its pages are silent, asked once per process (two
    tiny probes, keyed by the op objects so a test's stand-in op is probed afresh):

    - `nonfinite_in_scale`: npu_dynamic_quant's scale of a row holding NaN, +Inf or -Inf is not
      finite. The page (op_rules.DOC["npu_dynamic_quant"]) gives the formula rowmax|x|/127 and
      says nothing of NaN; a max instruction that returns the non-NaN operand would give a finite
      scale and a silently wrong int8 row. When the probe says so, the separate all-finite pass
      is dropped and the scales are checked instead; otherwise the pass stays.
    - `long_rows`: npu_dynamic_quant takes a row longer than the 11264 values Atlas A2 releases up
      to 6.0.RC3 allowed (refused there, not listed from 6.0.0).

    Not verified on hardware here; on an Atlas node:
    `python -c "import torch, torch_npu; from npu_flashrl.kernels import npu;
    print(npu.device_facts(torch.device('npu')))"`."""
    import torch_npu  # noqa: F401

    op = torch_npu.npu_dynamic_quant
    key = (device.type, getattr(op, "__wrapped__", op))  # the op itself (an id could be reused)
    if key not in _facts:
        nan = float("nan")
        x = torch.tensor([[1.0, nan, 2.0], [float("inf"), 0.0, 1.0], [-float("inf"), 0.0, 1.0],
                          [1.0, 2.0, 3.0]], dtype=torch.bfloat16, device=device)
        _, scale = torch_npu.npu_dynamic_quant(x)
        finite = torch.isfinite(scale).tolist()
        try:
            long = torch.zeros(1, op_rules.DYNAMIC_QUANT_MAX_ROW_A2_6_0_RC3 + 1,
                               dtype=torch.bfloat16, device=device)
            torch_npu.npu_dynamic_quant(long)
            long_rows = True
        except (RuntimeError, ValueError):
            long_rows = False
        _facts[key] = {"nonfinite_in_scale": finite == [False, False, False, True],
                       "long_rows": long_rows}
    return _facts[key]


def storage_format(t: torch.Tensor) -> int:
    import torch_npu  # noqa: F401

    return int(torch_npu.get_npu_format(t))


def to_host_nd(t: torch.Tensor) -> torch.Tensor:
    """NZ (FRACTAL_NZ, vllm-ascend's processed W8A8 weights) -> ND on the device, then to the host:
    npu_format_cast returns a new ND tensor, the live NZ storage is not touched."""
    import torch_npu  # noqa: F401

    from npu_flashrl.kernels.reference import ACL_FORMAT_ND

    t = t.detach()
    if int(torch_npu.get_npu_format(t)) != ACL_FORMAT_ND:
        t = torch_npu.npu_format_cast(t, ACL_FORMAT_ND)
    return t.cpu()
