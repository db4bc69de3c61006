"""INT8 quantization kernels behind one small dispatch.

`reference` defines the semantics in pure torch and runs anywhere; `npu` uses torch_npu ops for
tensors that live on an Ascend NPU. Callers use the functions exported here.
"""
from __future__ import annotations

from typing import Optional, Tuple, Union

import torch

from npu_flashrl.kernels import reference
from npu_flashrl.kernels.reference import (  # noqa: F401  (re-exported semantics)
    ACL_FORMAT_FRACTAL_NZ,
    ACL_FORMAT_ND,
    INT8_MAX,
    INT8_MIN,
    MAX_MATMUL_DIM,
    all_finite,
    dequantize_weight,
    require_same_device,
)


def backend_for(t: torch.Tensor) -> str:
    return "npu" if t.device.type == "npu" else "reference"


def quantize_weight_per_channel(weight: torch.Tensor, compute_dtype: Optional[torch.dtype] = None,
                                transposed: bool = False, finite: Optional[list] = None
                                ) -> Tuple[torch.Tensor, torch.Tensor]:
    """Symmetric per-output-channel INT8 (see `reference.quantize_weight_per_channel`).
    `finite`: instead of reading the NaN / Inf refusal back to the host (a host synchronisation
    per weight), append it to this list as a device-side bool tensor (True: finite); the caller
    must then read it before the result is used anywhere (on False the result is garbage)."""
    if backend_for(weight) == "npu":
        from npu_flashrl.kernels import npu

        return npu.quantize_weight_per_channel(weight, compute_dtype, transposed, finite)
    return reference.quantize_weight_per_channel(weight, compute_dtype, transposed, finite)


def quantize_weight_with_scales(weight: torch.Tensor, output_scale: Union[torch.Tensor, float],
                                input_scale: Union[torch.Tensor, float] = 1.0,
                                transposed: bool = False) -> torch.Tensor:
    """FlashRL's fixed-scale INT8 (see `reference.quantize_weight_with_scales`). Pure torch ops,
    so the reference runs on the NPU too; operands on different devices are refused first."""
    require_same_device("quantize_weight_with_scales", weight=weight, output_scale=output_scale,
                        input_scale=input_scale)
    return reference.quantize_weight_with_scales(weight, output_scale, input_scale, transposed)


def storage_format(t: torch.Tensor) -> int:
    """The acl storage format of `t` (ACL_FORMAT_ND for any CPU tensor not NZ-cast by the emulation)."""
    if backend_for(t) == "npu":
        from npu_flashrl.kernels import npu

        return npu.storage_format(t)
    return reference.get_npu_format(t)


def to_host_nd(t: torch.Tensor) -> torch.Tensor:
    """A CPU copy of `t` with its logical (ND) values, whatever its device storage format: an NZ
    weight on the NPU is cast to ND on the device first. On the CPU the emulated NZ cast never
    changed the bytes, so this is a plain copy."""
    if backend_for(t) == "npu":
        from npu_flashrl.kernels import npu

        return npu.to_host_nd(t)
    return t.detach().clone()
