"""What vllm-ascend's NPU worker and model runner set up around a model, done for an NPU-free
process (the CPU harness, the rehearsal) and for tests that switch it: device and NZ flags,
vllm-ascend's per-engine config, its MoE layers and forward context, the HCCL stand-ins'
targets, eager compilation, logits outside the engine.

This writes vllm-ascend's private globals on purpose: it is the harness standing in for the
worker, never called by runtime code. What differs per line is data on the installed line
(`npu_flashrl.lines`, each line's `sim` facts: `nz`, `moe_layers`, `moe_comm_selection`, `device_neutral_ops`, ...).
"""
from __future__ import annotations

import contextlib
import importlib
import inspect
import os
from typing import Optional, Tuple

from npu_flashrl.lines import current, resolve


def _utils():
    return importlib.import_module("vllm_ascend.utils")


def set_vllm_ascend_flags(is_310p: bool = False, enable_nz: bool = True) -> None:
    """Flags vllm-ascend normally reads from its build info / env, for an NPU-free process.

    Lines with `nz == "always"` NZ-cast W8A8 weights unconditionally; "utils_flag" gates it by
    `utils._ENABLE_NZ`; "weight_nz_mode" reads VLLM_ASCEND_ENABLE_NZ into
    `AscendConfig.weight_nz_mode` when its config is initialised (`init_vllm_ascend_config`) and
    the device type from `_build_info`."""
    utils = _utils()
    nz = current().sim.nz
    if nz == "weight_nz_mode":
        utils._ascend_device_type = utils.AscendDeviceType._310P if is_310p else utils.AscendDeviceType.A2
        os.environ["VLLM_ASCEND_ENABLE_NZ"] = "1" if enable_nz else "0"
        cfg = _ascend_config_or_none()
        if cfg is not None:
            cfg.weight_nz_mode = 1 if enable_nz else 0
        return
    utils._IS_310P = is_310p
    # these lines read the SoC generation from torch_npu at worker start
    # (`init_ascend_soc_version`); the MoE dispatchers ask for it when they are built. An
    # NPU-free process is an Atlas A2 (what "weight_nz_mode" lines are told through
    # `_ascend_device_type` above).
    utils._ascend_soc_version = utils.AscendSocVersion.A2
    if nz == "utils_flag":
        utils._ENABLE_NZ = enable_nz


def _ascend_config_or_none():
    ascend_config = importlib.import_module("vllm_ascend.ascend_config")
    return getattr(ascend_config, "_ASCEND_CONFIG", None)


def init_vllm_ascend_config(vllm_config) -> None:
    """Initialise vllm-ascend's per-engine config, as its worker does before building a model.

    W8A8 `apply` reads it where it exists; on "weight_nz_mode" lines it also holds the NZ mode,
    and the static W8A8 method needs the weight-prefetch helper the model runner sets up from it
    (`current().sim.weight_prefetch`)."""
    try:
        ascend_config = importlib.import_module("vllm_ascend.ascend_config")
    except ImportError:
        return
    init = getattr(ascend_config, "init_ascend_config", None)
    if init is None:  # a line without a per-engine config the W8A8 path reads
        return
    cfg = init(vllm_config)
    if current().sim.weight_prefetch:
        _utils().set_weight_prefetch_method(cfg.weight_prefetch_config)


def ascend_quant_method_map():
    """The table vllm-ascend picks W8A8 scheme classes from (`current().quant_method_map`; torchair
    graph mode rewrites it via `vllm_ascend.torchair.utils.torchair_quant_method_register`).
    For tests that must restore it."""
    ln = current()
    ln.import_quantization()
    return resolve(ln.quant_method_map)


def nz_flag_target():
    """(object, attribute) that switches the NZ cast of W8A8 weights, for tests to monkeypatch
    with a bool: `utils._ENABLE_NZ` or the initialised `AscendConfig.weight_nz_mode`. None on a
    line that casts unconditionally."""
    nz = current().sim.nz
    if nz == "utils_flag":
        return _utils(), "_ENABLE_NZ"
    if nz == "weight_nz_mode":
        cfg = _ascend_config_or_none()
        if cfg is None:
            raise RuntimeError("vllm-ascend's config is not initialised yet "
                               "(ascend_harness.init_vllm_ascend_config); NZ is read from it")
        return cfg, "weight_nz_mode"
    return None


def nz_enabled() -> bool:
    """Whether vllm-ascend NZ-casts int8 W8A8 weights in this process."""
    nz = current().sim.nz
    if nz == "always":
        return True
    utils = _utils()
    if nz == "utils_flag":
        try:
            return bool(utils.is_enable_nz())
        except ValueError:  # not initialised yet
            return bool(getattr(utils, "_ENABLE_NZ", False))
    cfg = _ascend_config_or_none()
    if cfg is not None:
        return bool(cfg.weight_nz_mode)
    return bool(int(os.environ.get("VLLM_ASCEND_ENABLE_NZ", "1")))


def compute_logits(model, hidden_states):
    """Logits from a vLLM model's final hidden states, outside the engine (no sampler).

    Older vLLM's `compute_logits(hidden_states, sampling_metadata)` requires the metadata
    argument (None skips pruning and logits processors); newer vLLM dropped it."""
    params = inspect.signature(model.compute_logits).parameters
    if "sampling_metadata" in params:
        return model.compute_logits(hidden_states, None)
    return model.compute_logits(hidden_states)


def vllm_attention_class():
    """vLLM's Attention layer (where the installed line's vLLM keeps it)."""
    return resolve(current().sim.attention)


def eager_compilation_config(native_ops: bool = True):
    """vLLM's CompilationConfig for eager PyTorch (no torch.compile): `mode=CompilationMode.NONE`
    where vLLM takes `mode` (`current().sim.compile_mode`), else `level=0`. `native_ops`: plain torch
    instead of the platform's custom ops (the CPU harness, where the compiled kernels are absent);
    False keeps the NPU's own ops (the rehearsal on hardware)."""
    from vllm import config as vcfg

    ops = {"custom_ops": ["none"]} if native_ops else {}
    if current().sim.compile_mode:
        return vcfg.CompilationConfig(mode=vcfg.CompilationMode.NONE, **ops)
    return vcfg.CompilationConfig(level=0, **ops)


# --------------------------------------------------------------------------- MoE layers and forward
# vllm-ascend replaces vLLM's FusedMoE layer by its own (a PluggableLayer / CustomOp out-of-tree
# registration in `utils.register_ascend_customop`), and its model runner runs every forward inside
# `ascend_forward_context.set_ascend_forward_context`, which carries the MoE communication method
# the fused-MoE layers dispatch through. Where each line keeps them: `current().sim.moe_layers`.

def ascend_moe_layer_classes() -> dict:
    """{vLLM layer name: vllm-ascend class} of the MoE layers the NPU platform swaps in."""
    return {name: resolve(path) for name, path in current().sim.moe_layers.items()}


def register_ascend_moe_layers() -> list:
    """Register vllm-ascend's MoE layers for vLLM's MoE layer names the way vllm-ascend's
    `register_ascend_customop` does on the NPU (`CustomOp.register_oot`), and only those: its
    other custom ops are torch_npu kernels for norms, rotary embedding, linear layers and the
    like that hold no weights of their own. Idempotent; returns the names registered now.
    Refuses a name another class was registered for."""
    from vllm.model_executor import custom_op

    # newer vLLM keeps the registry at module level (shared with PluggableLayer, which FusedMoE
    # is now); older as a CustomOp class attribute
    registry = getattr(custom_op, "op_registry_oot", None)
    if registry is None:
        registry = custom_op.CustomOp.op_registry_oot
    done = []
    for name, cls in ascend_moe_layer_classes().items():
        have = registry.get(name)
        if have is cls:
            continue
        if have is not None:
            raise RuntimeError(f"vLLM's out-of-tree layer {name!r} is already registered as "
                               f"{have.__module__}.{have.__qualname__}, not vllm-ascend's "
                               f"{cls.__module__}.{cls.__qualname__}")
        custom_op.CustomOp.register_oot(_decorated_op_cls=cls, name=name)
        done.append(name)
    return done


def moe_comm_type(vllm_config, num_tokens: int):
    """The MoE communication method vllm-ascend's model runner picks for a batch of
    `num_tokens` tokens (a `MoECommType` member; None for a dense model).

    `moe_comm_selection == "forward_context"`: vllm-ascend's own
    `ascend_forward_context.select_moe_comm_method` (which `set_ascend_forward_context` also
    calls). "model_runner": `NPUModelRunner._select_moe_comm_method` (worker/model_runner_v1.py),
    a runner method whose module does not import on a CPU test stack (it needs numba); its first
    rule is the one an NPU-free process can meet: no expert parallelism -> ALLGATHER (MC2 /
    all-to-all are expert-parallel dispatches over HCCL). Expert parallelism is refused here."""
    fc = importlib.import_module("vllm_ascend.ascend_forward_context")
    if current().sim.moe_comm_selection == "forward_context":
        return fc.select_moe_comm_method(num_tokens, vllm_config)
    unsupported = cpu_moe_forward_unsupported()
    if unsupported:
        raise NotImplementedError(unsupported)
    if not _is_moe(vllm_config):
        return None
    if vllm_config.parallel_config.enable_expert_parallel:
        raise NotImplementedError("expert parallelism: vllm-ascend's MC2 / all-to-all MoE dispatch "
                                  "needs HCCL; the CPU harness runs the all-gather dispatch only")
    return fc.MoECommType.ALLGATHER


def cpu_moe_forward_unsupported() -> Optional[str]:
    """Why the CPU harness cannot run a MoE forward on this line, or None when it can."""
    return current().sim.cpu_moe_forward_unsupported


def _is_moe(vllm_config) -> bool:
    return bool(_utils().is_moe_model(vllm_config))


def _config_is_moe(vllm_config) -> bool:
    # for lines without `utils.is_moe_model`: the expert-count keys of the MoE configs they serve
    cfg = vllm_config.model_config.hf_config
    return any(getattr(cfg, k, 0) for k in ("num_experts", "n_routed_experts", "num_local_experts"))


def ascend_forward_context(vllm_config, num_tokens: int, model=None):
    """vllm-ascend's forward context for one eager forward of `num_tokens` tokens with no
    attention metadata, as its model runner enters it around `model(...)`: where the context
    selects the MoE comm method itself it does so inside `set_ascend_forward_context`; else it
    takes the runner's pick as `moe_comm_type=` (`moe_comm_type` above; refused on a line whose
    MoE forward the harness cannot run)."""
    fc = importlib.import_module("vllm_ascend.ascend_forward_context")
    ln = current()
    if ln.sim.moe_comm_selection == "forward_context":
        return fc.set_ascend_forward_context(None, vllm_config, num_tokens=num_tokens,
                                             model_instance=model)
    if ln.sim.cpu_moe_forward_unsupported is not None and not _config_is_moe(vllm_config):
        # a dense model's layers read nothing from it on such a line; its MoE models are refused
        return contextlib.nullcontext()
    comm = moe_comm_type(vllm_config, num_tokens)
    return fc.set_ascend_forward_context(None, vllm_config, num_tokens=num_tokens,
                                         with_prefill=True, moe_comm_type=comm,
                                         model_instance=model)


def device_neutral_ascend_ops() -> dict:
    """{qualified op name: upstream body} of vllm-ascend's NPU-only custom ops whose bodies are
    device-neutral torch code (`current().sim.device_neutral_ops`); importing the bodies' modules is
    what registers the ops."""
    return {name: resolve(path) for name, path in current().sim.device_neutral_ops.items()}


def forget_served_model() -> None:
    """Clear vllm-ascend's per-process facts about THE model its worker serves (module globals in
    vllm_ascend.utils, filled on first use: `current().sim.per_model_caches`) before another model is
    built in the same process (the CPU harness builds several; on an NPU a worker serves one).
    Without this a MoE model built after a dense one is taken for dense: no MoE comm method in
    its forward context."""
    utils = _utils()
    for name in current().sim.per_model_caches:
        if hasattr(utils, name):
            setattr(utils, name, None)


def hccl_token_dispatchers() -> Tuple[Tuple[str, str], ...]:
    """(module, name) of each token dispatcher class vllm-ascend's fused-MoE layers construct
    whose constructor asks `torch.device("npu")`'s HCCL backend for a communicator name, as the
    comm-method module sees it (`setup_moe_comm_method` builds the comm methods with every MoE
    layer): `current().sim.hccl_token_dispatchers`."""
    return tuple(tuple(path.split(":")) for path in current().sim.hccl_token_dispatchers)


def moe_gmm_swiglu_fusion_flag():
    """(object, attribute) that makes vllm-ascend's all-gather MoE path use the fused
    gate_up-matmul + swiglu + quant kernel (True) or npu_grouped_matmul, npu_swiglu and
    npu_dynamic_quant (False), for tests to monkeypatch (`current().sim.moe_fusion_flag`: the comm
    method's switch, read from additional_config when the comm methods are built). None on a
    line whose W8A8 MoE always fuses."""
    flag = current().sim.moe_fusion_flag
    if flag is None:
        return None
    module, _, attr = flag.partition(":")
    mcm = importlib.import_module(module)
    fc = importlib.import_module("vllm_ascend.ascend_forward_context")
    return mcm.get_moe_comm_method(fc.MoECommType.ALLGATHER), attr
