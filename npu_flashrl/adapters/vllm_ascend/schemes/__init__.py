"""The quantization schemes the in-place reload writes, one module each, registered by
(quant type, layer type) as vllm-ascend registers its own (`quantization/methods/`):

- `base`: what a scheme is (`Scheme`: target detection, staging layout, derived tensors, wire
  format) and what every staging is (`LayerStaging`);
- `registry`: `register_scheme`, `get_scheme`, `find_targets`;
- `linear`: what the W8A8 linear schemes share (`LinearTarget`, `LinearStaging`);
- `w8a8_dynamic` (linear), `w8a8_dynamic_moe` (fused MoE), `w8a8_static` (linear).

Importing this package registers them all. Adding a scheme: docs/architecture.md.
"""
from npu_flashrl.adapters.vllm_ascend.schemes import w8a8_dynamic, w8a8_dynamic_moe, w8a8_static  # noqa: F401
from npu_flashrl.adapters.vllm_ascend.schemes.base import (  # noqa: F401
    LINEAR, MOE, PER_CHANNEL_INT8, LayerStaging, Scheme, WireFormat, inner_method)
from npu_flashrl.adapters.vllm_ascend.schemes.linear import LinearStaging, LinearTarget  # noqa: F401
from npu_flashrl.adapters.vllm_ascend.schemes.registry import (  # noqa: F401
    find_targets, get_scheme, register_scheme, registered)
from npu_flashrl.adapters.vllm_ascend.schemes.w8a8_dynamic_moe import (  # noqa: F401
    ExpertStaging, ExpertTarget)
