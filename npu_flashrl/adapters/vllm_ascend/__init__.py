"""vllm-ascend adapter: INT8 rollout models and in-place, bucket-safe weight reload.

- `description`: which layers run vllm-ascend's W8A8 methods (bf16 / compressed-tensors
  checkpoints get an in-memory quant description).
- `reload`: `WeightSync`, the model's quantizing `load_weights` and a weight sync's one lifecycle
  (begin / load / end), `attach`, `end_weight_sync`. Its rooms, after vLLM's
  `model_loader/reload/`: `targets` (every quantized layer, one map for every layer type),
  `cold_load` (before post-processing), `sync_load` (one load call: `validate` checks each tensor,
  `wire` is the INT8 wire's receiver, `staging` holds each layer until it is complete),
  `completeness` (the end of a sync and its messages), `sync` (the state, `SyncState`, and the
  model's consistency across syncs, `Consistency`); `schemes/`: one module per vllm-ascend scheme,
  registered by (quant type, layer type); `experts`: what every fused-MoE layer shares.
- `hooks`: the bodies of the patches every line shares (redirect, override, attach-on-init).
- `layout`: the installed line (`npu_flashrl.lines`): what differs per vllm-ascend release (patch
  targets, method classes, the run-once rule, the tensors W8A8 post-processing derives).
The quantizers themselves are `npu_flashrl.quant`. Names used by other modules and tests are
re-exported here (`from npu_flashrl.adapters import vllm_ascend; vllm_ascend.end_weight_sync`).
"""
from npu_flashrl.adapters.vllm_ascend.description import (  # noqa: F401
    DESCRIPTION_FILE, FLOAT, PROJECTIONS, W8A8, W8A8_DYNAMIC, QuantDescription, UnsupportedScheme,
    compressed_tensors_description, describe_checkpoint, profile_free_description,
    read_hf_quant_config)
from npu_flashrl.quant import (  # noqa: F401
    QUANTIZERS, OnlineQuantizer, PerChannelQuantizer, ProfileQuantizer, WeightSyncError,
    make_quantizer)
from npu_flashrl.adapters.vllm_ascend.reload import (  # noqa: F401
    Int8WeightLoader, WeightSync, attach, end_weight_sync, find_targets)
from npu_flashrl.lines.derived import static_quant_bias  # noqa: F401


def _declare_line_patches() -> None:
    """Declare the installed line's patches (`npu-flashrl verify` lists them; other lines' are
    not declared), with this adapter's bodies, without importing vllm_ascend itself. Where
    vllm-ascend is missing or an unsupported release nothing is declared, and `PATCHES` raises
    saying so."""
    from npu_flashrl import lines, patches
    from npu_flashrl.adapters.vllm_ascend import hooks, schemes

    try:
        line = lines.current()
    except lines.UnsupportedVersion:
        return
    patches.declare(schemes.once_patches(line))  # one run-once patch per registered scheme
    patches.declare(schemes.method_patches(line))  # a scheme's fixes of its method class
    patches.declare(line.patches(hooks))


_declare_line_patches()


def __getattr__(name: str):
    # The schemes' run-once patches and the line's patches, by name; UnsupportedVersion (naming
    # the supported lines) when there is no supported line.
    if name == "PATCHES":
        from npu_flashrl import lines
        from npu_flashrl.adapters.vllm_ascend import schemes

        line = lines.current()
        return (tuple(p.name for p in schemes.once_patches(line) + schemes.method_patches(line))
                + line.PATCHES)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
