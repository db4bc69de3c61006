"""The quantization schemes the in-place reload writes, one module each, registered by
(quant type, layer type) as vllm-ascend registers its own (`quantization/methods/`):

- `base`: what a scheme is (`Scheme`: target detection by key, its tensor contract (payload,
  checkpoint tensors, wire format), staging layout, derived tensors, run-once patch) and what
  every staging is (`LayerStaging`);
- `registry`: `register_scheme`, `get_scheme`, `supported` (the registry is the supported list),
  `once_patches`, `method_patches`, `find_targets`;
- `linear`: what the W8A8 linear schemes share (`LinearTarget`, `LinearStaging`);
- `w8a8_dynamic` (linear), `w8a8_dynamic_moe` (fused MoE), `w8a8_static` (linear),
  `w4a8_dynamic` (linear: int4 in groups, two scale levels), `w4a8_dynamic_moe` (fused MoE, per group).

Importing this package registers them all. Adding a scheme: docs/architecture.md.
"""
from npu_flashrl.adapters.vllm_ascend.schemes import w8a8_dynamic, w8a8_dynamic_moe, w8a8_static  # noqa: F401
from npu_flashrl.adapters.vllm_ascend.schemes import w4a8_dynamic, w4a8_dynamic_moe  # noqa: F401
from npu_flashrl.adapters.vllm_ascend.schemes.base import (  # noqa: F401
    LINEAR, MOE, PER_CHANNEL_INT8, Int8Payload, LayerStaging, Scheme, UnsupportedScheme, WireFormat,
    inner_method)
from npu_flashrl.adapters.vllm_ascend.schemes.linear import LinearStaging, LinearTarget  # noqa: F401
from npu_flashrl.adapters.vllm_ascend.schemes.registry import (  # noqa: F401
    find_targets, get_scheme, method_patches, once_patches, register_scheme, registered, supported)
from npu_flashrl.adapters.vllm_ascend.schemes.w8a8_dynamic import W8A8_DYNAMIC  # noqa: F401
from npu_flashrl.adapters.vllm_ascend.schemes.w8a8_static import W8A8  # noqa: F401
from npu_flashrl.adapters.vllm_ascend.schemes.w8a8_dynamic_moe import (  # noqa: F401
    ExpertStaging, ExpertTarget)
