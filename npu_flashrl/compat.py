"""Every upstream version difference npu_flashrl knows about, in one place.

The installed vllm-ascend decides the *stack line* once per process (`line()`, cached): a frozen
`StackLine` naming the vllm-ascend release, the adapter layout module that knows its code, where
its quantization classes live and how it switches the NZ weight format. Supported lines:

- v0.10.1rc1 (with vllm 0.10.1): the pinned production stack; no wheel, a source tree;
- 0.11.0 (with vllm 0.11.0);
- 0.23.0 (with vllm 0.23.x): what verl 0.9 installs; quantization split into
  `modelslim_config` / `method_adapters` / `methods/` (a scheme registry).

Anything else is refused with a message naming what is supported. Code outside this module and
the adapters' `layout_*` modules names no version.
"""
from __future__ import annotations

import contextlib
import dataclasses
import functools
import importlib
import importlib.util
import os
from typing import Optional, Tuple

SUPPORTED_VLLM_ASCEND = ("0.10.1rc1", "0.11.0", "0.23.0")


class UnsupportedVersion(RuntimeError):
    pass


@dataclasses.dataclass(frozen=True)
class StackLine:
    """What one vllm-ascend line looks like to npu_flashrl."""
    vllm_ascend: str      # the release, e.g. "0.23.0"
    layout: str           # adapters.vllm_ascend layout module suffix: "011" or "023"
    vllm: str             # the vLLM release it is built against
    quant_config: str     # "module:Class" of the "ascend" QuantizationConfig
    linear_method: str    # "module:Class" wrapping a scheme for vLLM's LinearBase
    static_method: str    # W8A8 (static activations) linear scheme
    dynamic_method: str   # W8A8_DYNAMIC linear scheme
    nz: str               # how the NZ cast of int8 weights is switched: "always" (v0.10.1rc1),
    #                       "utils_flag" (0.11.0: utils._ENABLE_NZ), "weight_nz_mode" (0.23:
    #                       get_ascend_config().weight_nz_mode, env VLLM_ASCEND_ENABLE_NZ)
    verl_mode: str        # how verl drives the rollout on this line: "sync" or "server"
    attention: str        # "module:Class" of vLLM's Attention layer
    compile_mode: bool    # vLLM's CompilationConfig takes `mode=` (0.23), not `level=`
    source: str = ""      # how the line was recognised (for `verify` / error messages)

    @property
    def name(self) -> str:
        return self.vllm_ascend

    @property
    def moe_method(self) -> str:
        """W8A8_DYNAMIC fused-MoE scheme: next to the linear one on every supported line."""
        return self.dynamic_method.partition(":")[0] + ":AscendW8A8DynamicFusedMoEMethod"


_Q = "vllm_ascend.quantization"
_LINES = {
    "0.10.1rc1": StackLine("0.10.1rc1", "011", "0.10.1", f"{_Q}.quant_config:AscendQuantConfig",
                           f"{_Q}.quant_config:AscendLinearMethod", f"{_Q}.w8a8:AscendW8A8LinearMethod",
                           f"{_Q}.w8a8_dynamic:AscendW8A8DynamicLinearMethod", "always", "sync",
                           "vllm.attention.layer:Attention", False),
    "0.11.0": StackLine("0.11.0", "011", "0.11.0", f"{_Q}.quant_config:AscendQuantConfig",
                        f"{_Q}.quant_config:AscendLinearMethod", f"{_Q}.w8a8:AscendW8A8LinearMethod",
                        f"{_Q}.w8a8_dynamic:AscendW8A8DynamicLinearMethod", "utils_flag", "sync",
                        "vllm.attention.layer:Attention", False),
    "0.23.0": StackLine("0.23.0", "023", "0.23.0", f"{_Q}.modelslim_config:AscendModelSlimConfig",
                        f"{_Q}.method_adapters:AscendLinearMethod",
                        f"{_Q}.methods.w8a8_static:AscendW8A8LinearMethod",
                        f"{_Q}.methods.w8a8_dynamic:AscendW8A8DynamicLinearMethod",
                        "weight_nz_mode", "server",
                        "vllm.model_executor.layers.attention.attention:Attention", True),
}

# Files only one quantization layout has, used for a source tree (no dist metadata). Each layout
# is recognised by all of its `has` files being present and all of its `lacks` files absent, so
# no single file decides (0.23 still has `quantization/utils.py`, like 0.11.0).
_LAYOUT_FILES = (
    ("0.23.0", ("methods/registry.py", "modelslim_config.py", "method_adapters.py"),
     ("quant_config.py", "quantizer.py")),
    ("0.10.1rc1", ("quantizer.py", "quant_config.py", "w8a8_dynamic.py"),
     ("utils.py", "methods/registry.py")),
    # 0.13.0 keeps 0.11's files and adds compressed_tensors/: not taken for 0.11.0
    ("0.11.0", ("quant_config.py", "utils.py", "w8a8_dynamic.py"),
     ("quantizer.py", "methods/registry.py", "compressed_tensors/compressed_tensors.py")),
)


def _supported() -> str:
    return ", ".join(SUPPORTED_VLLM_ASCEND)


def _dist_version(name: str) -> Optional[str]:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version(name)
    except PackageNotFoundError:
        return None


def line_for_version(version: str) -> StackLine:
    """The line of a vllm-ascend release string; UnsupportedVersion names the supported ones."""
    base = version.split("+")[0]
    if base.startswith("0.10.1"):
        base = "0.10.1rc1"
    try:
        return _LINES[base]
    except KeyError:
        raise UnsupportedVersion(f"vllm-ascend {version} is not supported; npu_flashrl supports "
                                 f"vllm-ascend {_supported()} (see npu_flashrl/pins.yaml)") from None


def line_for_tree(package_dir: str) -> StackLine:
    """The line of a vllm_ascend package directory, from the files only its layout has."""
    quant = os.path.join(package_dir, "quantization")
    for name, has, lacks in _LAYOUT_FILES:
        if all(os.path.exists(os.path.join(quant, f)) for f in has) and \
                not any(os.path.exists(os.path.join(quant, f)) for f in lacks):
            return _LINES[name]
    raise UnsupportedVersion(f"cannot tell the vllm-ascend version of the tree at {package_dir} "
                             f"(its quantization/ matches no known layout); npu_flashrl supports "
                             f"vllm-ascend {_supported()}")


@functools.lru_cache(maxsize=None)
def line() -> StackLine:
    """The installed vllm-ascend's line, decided once per process.

    The distribution's version decides when vllm_ascend is imported from where the distribution
    was installed; a source tree on PYTHONPATH (no metadata, or metadata of another copy) is
    recognised by its quantization layout."""
    spec = importlib.util.find_spec("vllm_ascend")
    if spec is None:
        raise UnsupportedVersion(f"vllm_ascend is not installed; npu_flashrl supports vllm-ascend "
                                 f"{_supported()}")
    package_dir = list(spec.submodule_search_locations or [])[0]
    version = _dist_version("vllm_ascend") or _dist_version("vllm-ascend")
    if version is not None and "site-packages" in package_dir:
        return dataclasses.replace(line_for_version(version), source=f"distribution {version}")
    return dataclasses.replace(line_for_tree(package_dir), source=f"source tree {package_dir}")


def vllm_ascend_line() -> str:
    """The installed vllm-ascend's line name ('0.10.1rc1', '0.11.0' or '0.23.0')."""
    return line().name


def check_vllm_ascend() -> str:
    """Raise UnsupportedVersion unless the installed vllm-ascend is a supported line."""
    return line().name


def _resolve(path: str):
    module, _, attr = path.partition(":")
    return getattr(importlib.import_module(module), attr)


def import_quantization():
    """Import vllm-ascend's quantization config module (it registers the "ascend" method with
    vLLM), the way vllm-ascend itself starts: the config module first (importing the W8A8 methods
    first hits a circular import through vllm_ascend.ops on 0.11)."""
    return importlib.import_module(line().quant_config.partition(":")[0])


def quant_config_class():
    import_quantization()
    return _resolve(line().quant_config)


def quant_method_classes() -> Tuple[type, type, type]:
    """(AscendLinearMethod, W8A8 static scheme, W8A8_DYNAMIC scheme) of the installed line."""
    import_quantization()
    ln = line()
    return _resolve(ln.linear_method), _resolve(ln.static_method), _resolve(ln.dynamic_method)


def moe_method_class() -> type:
    """vllm-ascend's W8A8_DYNAMIC fused-MoE scheme of the installed line."""
    import_quantization()
    return _resolve(line().moe_method)


def set_vllm_ascend_flags(is_310p: bool = False, enable_nz: bool = True) -> None:
    """Flags vllm-ascend normally reads from its build info / env, for an NPU-free process.

    v0.10.1rc1 NZ-casts W8A8 weights unconditionally; 0.11.0 gates it by `utils._ENABLE_NZ`;
    0.23 reads VLLM_ASCEND_ENABLE_NZ into `AscendConfig.weight_nz_mode` when its config is
    initialised (`init_vllm_ascend_config`) and the device type from `_build_info`."""
    utils = importlib.import_module("vllm_ascend.utils")
    nz = line().nz
    if nz == "weight_nz_mode":
        utils._ascend_device_type = utils.AscendDeviceType._310P if is_310p else utils.AscendDeviceType.A2
        os.environ["VLLM_ASCEND_ENABLE_NZ"] = "1" if enable_nz else "0"
        cfg = _ascend_config_or_none()
        if cfg is not None:
            cfg.weight_nz_mode = 1 if enable_nz else 0
        return
    utils._IS_310P = is_310p
    # v0.10.1rc1 / 0.11 read the SoC generation from torch_npu at worker start
    # (`init_ascend_soc_version`); the MoE dispatchers ask for it when they are built. An
    # NPU-free process is an Atlas A2 (what 0.23 is told through `_ascend_device_type` above).
    utils._ascend_soc_version = utils.AscendSocVersion.A2
    if nz == "utils_flag":
        utils._ENABLE_NZ = enable_nz


def _ascend_config_or_none():
    ascend_config = importlib.import_module("vllm_ascend.ascend_config")
    return getattr(ascend_config, "_ASCEND_CONFIG", None)


def init_vllm_ascend_config(vllm_config) -> None:
    """Initialise vllm-ascend's per-engine config, as its worker does before building a model.

    0.11.0's W8A8 `apply` reads it; on 0.23 it also holds the NZ mode, and the static W8A8
    method needs the weight-prefetch helper the model runner sets up from it."""
    try:
        ascend_config = importlib.import_module("vllm_ascend.ascend_config")
    except ImportError:
        return
    init = getattr(ascend_config, "init_ascend_config", None)
    if init is None:  # v0.10.1rc1 has no per-engine config the W8A8 path reads
        return
    cfg = init(vllm_config)
    if line().nz == "weight_nz_mode":
        importlib.import_module("vllm_ascend.utils").set_weight_prefetch_method(
            cfg.weight_prefetch_config)


def ascend_quant_method_map():
    """The table vllm-ascend picks W8A8 scheme classes from (torchair graph mode rewrites it via
    `vllm_ascend.torchair.utils.torchair_quant_method_register`): v0.10.1rc1 keeps quantizer
    classes in `quantizer.SUPPORT_ASCEND_QUANTIZER_TYPE`, 0.11.0 method classes in
    `utils.ASCEND_QUANTIZATION_METHOD_MAP`, 0.23 the scheme registry
    `methods.registry._SCHEME_REGISTRY` ((quant_type, layer_type) -> class; 0.23 has no torchair
    mode). For tests that must restore it."""
    import_quantization()
    ln = line()
    if ln.name == "0.10.1rc1":
        return importlib.import_module("vllm_ascend.quantization.quantizer").SUPPORT_ASCEND_QUANTIZER_TYPE
    if ln.layout == "023":
        return importlib.import_module("vllm_ascend.quantization.methods.registry")._SCHEME_REGISTRY
    return importlib.import_module("vllm_ascend.quantization.utils").ASCEND_QUANTIZATION_METHOD_MAP


def nz_flag_target():
    """(object, attribute) that switches the NZ cast of W8A8 weights, for tests to monkeypatch
    with a bool: 0.11.0's `utils._ENABLE_NZ`, 0.23's initialised `AscendConfig.weight_nz_mode`.
    None on v0.10.1rc1, which casts unconditionally."""
    nz = line().nz
    if nz == "utils_flag":
        return importlib.import_module("vllm_ascend.utils"), "_ENABLE_NZ"
    if nz == "weight_nz_mode":
        cfg = _ascend_config_or_none()
        if cfg is None:
            raise RuntimeError("vllm-ascend's config is not initialised yet "
                               "(compat.init_vllm_ascend_config); NZ is read from it")
        return cfg, "weight_nz_mode"
    return None


def nz_enabled() -> bool:
    """Whether vllm-ascend NZ-casts int8 W8A8 weights in this process."""
    nz = line().nz
    if nz == "always":
        return True
    utils = importlib.import_module("vllm_ascend.utils")
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

    vLLM 0.10.1's `compute_logits(hidden_states, sampling_metadata)` requires the metadata
    argument (None skips pruning and logits processors); 0.11.0 dropped it."""
    import inspect

    params = inspect.signature(model.compute_logits).parameters
    if "sampling_metadata" in params:
        return model.compute_logits(hidden_states, None)
    return model.compute_logits(hidden_states)


def vllm_attention_class():
    """vLLM's Attention layer (moved out of `vllm.attention.layer` by 0.23)."""
    return _resolve(line().attention)


def eager_compilation_config(native_ops: bool = True):
    """vLLM's CompilationConfig for eager PyTorch (no torch.compile): 0.23 takes
    `mode=CompilationMode.NONE` (`level` is gone), older lines `level=0`. `native_ops`: plain torch
    instead of the platform's custom ops (the CPU harness, where the compiled kernels are absent);
    False keeps the NPU's own ops (the rehearsal on hardware)."""
    from vllm import config as vcfg

    ops = {"custom_ops": ["none"]} if native_ops else {}
    if line().compile_mode:
        return vcfg.CompilationConfig(mode=vcfg.CompilationMode.NONE, **ops)
    return vcfg.CompilationConfig(level=0, **ops)


def compress_int8(qcfg, state: dict, names_to_scheme: dict) -> dict:
    """compressed-tensors' int-quantized compressor on `state` (module.weight / weight_scale /
    weight_zero_point by full name): 0.11 has an instance API over the whole state dict, 0.17 a
    per-module classmethod on local names. Returns the compressed tensors by full name."""
    import inspect

    from compressed_tensors.compressors import IntQuantizationCompressor

    if "names_to_scheme" in inspect.signature(IntQuantizationCompressor.compress).parameters:
        return IntQuantizationCompressor(config=qcfg).compress(state, names_to_scheme=names_to_scheme)
    out = {}
    for module, scheme in names_to_scheme.items():
        local = {k[len(module) + 1:]: v for k, v in state.items() if k.startswith(module + ".")}
        out.update({f"{module}.{k}": v
                    for k, v in IntQuantizationCompressor.compress(local, scheme).items()})
    return out


# Where vLLM's model loader looks things up (patched by adapters.vllm_ascend); the same names on
# every supported vLLM line.
GET_QUANT_CONFIG_TARGET = "vllm.model_executor.model_loader.weight_utils:get_quant_config"
INITIALIZE_MODEL_TARGET = "vllm.model_executor.model_loader.base_loader:initialize_model"


def verl_server_mode() -> bool:
    """Does the installed verl run its rollout as a vLLM server fed by bucketed IPC syncs
    (verl 0.7.1 .. 0.9.x), rather than in-process (sync mode, verl <= 51d2104)? Decided by
    the file verl's server-mode sync lives in, without importing verl (its rollout package
    imports Ray and vLLM)."""
    spec = importlib.util.find_spec("verl")
    if spec is None or not spec.submodule_search_locations:
        return False
    return any(os.path.isfile(os.path.join(d, "workers", "rollout", "vllm_rollout",
                                           "bucketed_weight_transfer.py"))
               for d in spec.submodule_search_locations)


# verl config lines, named by the release whose `algorithm.rollout_correction` schema they have:
# "51d2104" (the pin; verl 0.6.x has the same schema: sync-mode rollout, `use_policy_gradient`)
# and "0.9" (verl 0.7.1 .. 0.9.x: server-mode rollout, `use_policy_gradient` replaced by
# `loss_type`, `rollout_rs_threshold_lower` / `rollout_token_veto_threshold` gone).
VERL_LINES = ("51d2104", "0.9")
_VERL_ALIASES = {"51d2104": "51d2104", "pinned": "51d2104", "0.6": "51d2104", "0.6.1": "51d2104",
                 "0.11": "51d2104", "0.9": "0.9", "0.9.1": "0.9", "current": "0.9"}


def verl_line(name: Optional[str] = None) -> str:
    """The verl config line: `name` normalised ("0.9.1", "current" -> "0.9"; "0.6.1", "pinned"
    -> "51d2104"), or when None the installed verl's line (the pin's when verl is absent, e.g. a
    recipe generated on a machine without verl). ValueError names the accepted values."""
    if name is None:
        return "0.9" if verl_server_mode() else "51d2104"
    try:
        return _VERL_ALIASES[str(name).strip().lower()]
    except KeyError:
        raise ValueError(f"verl line {name!r} is not known; use one of {', '.join(VERL_LINES)} "
                         f"(aliases: {', '.join(sorted(_VERL_ALIASES))})") from None


# --------------------------------------------------------------------------- MoE layers and forward
# vllm-ascend replaces vLLM's FusedMoE layer by its own (a PluggableLayer / CustomOp out-of-tree
# registration in `utils.register_ascend_customop`), and its model runner runs every forward inside
# `ascend_forward_context.set_ascend_forward_context`, which carries the MoE communication method
# the fused-MoE layers dispatch through. Where each line keeps them:
_MOE_LAYERS = {
    # v0.10.1rc1 `utils.register_ascend_customop`: FusedMoE only. Its constructor allocates the
    # comm methods' buffers on the NPU (distributed/moe_comm_method.py): the CPU harness does not
    # register it (`cpu_moe_forward_unsupported`), vLLM's FusedMoE holds the same parameters.
    "0.10.1rc1": {"FusedMoE": "vllm_ascend.ops.common_fused_moe:AscendFusedMoE"},
    # 0.11.0: FusedMoE and SharedFusedMoE (`utils.register_ascend_customop`, REGISTERED_ASCEND_OPS)
    "0.11.0": {"FusedMoE": "vllm_ascend.ops.common_fused_moe:AscendFusedMoE",
               "SharedFusedMoE": "vllm_ascend.ops.common_fused_moe:AscendSharedFusedMoE"},
    # 0.23.0: REGISTERED_ASCEND_OPS["FusedMoE"] when vLLM is 0.23.0 (SharedFusedMoE is gone)
    "0.23.0": {"FusedMoE": "vllm_ascend.ops.fused_moe.fused_moe:AscendFusedMoE"},
}


def ascend_moe_layer_classes() -> dict:
    """{vLLM layer name: vllm-ascend class} of the MoE layers the NPU platform swaps in."""
    return {name: _resolve(path) for name, path in _MOE_LAYERS[line().name].items()}


def register_ascend_moe_layers() -> list:
    """Register vllm-ascend's MoE layers for vLLM's FusedMoE (and 0.11's SharedFusedMoE) the way
    vllm-ascend's `register_ascend_customop` does on the NPU (`CustomOp.register_oot`), and only
    those: its other custom ops are torch_npu kernels for norms, rotary embedding, linear
    layers and the like that hold no weights of their own. Idempotent; returns the names
    registered now. Refuses a name another class was registered for."""
    from vllm.model_executor import custom_op

    # vLLM 0.23 keeps the registry at module level (shared with PluggableLayer, which FusedMoE is
    # now); 0.10 / 0.11 as a CustomOp class attribute
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

    0.23: vllm-ascend's own `ascend_forward_context.select_moe_comm_method` (which
    `set_ascend_forward_context` also calls). 0.11 / v0.10.1rc1 pick it in
    `NPUModelRunner._select_moe_comm_method` (worker/model_runner_v1.py), a runner method whose
    module does not import on a CPU test stack (it needs numba); its first rule is the one an
    NPU-free process can meet: no expert parallelism -> ALLGATHER (MC2 / all-to-all are
    expert-parallel dispatches over HCCL). Expert parallelism is refused here."""
    fc = importlib.import_module("vllm_ascend.ascend_forward_context")
    if line().layout == "023":
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
    if line().name == "0.10.1rc1":
        return ("vllm-ascend v0.10.1rc1's model runner dispatches every MoE batch within the MC2 "
                "token capacity with MC2 (HCCL collectives), expert parallelism or not; the CPU "
                "harness runs the all-gather dispatch of 0.11 / 0.23 only (seen besides: its "
                "built experts are not in the processed [E, H, 2I] layout; not investigated)")
    return None


def _is_moe(vllm_config) -> bool:
    return bool(importlib.import_module("vllm_ascend.utils").is_moe_model(vllm_config))


def _config_is_moe(vllm_config) -> bool:
    # v0.10.1rc1 has no `is_moe_model`; the expert-count keys of the MoE configs it serves
    cfg = vllm_config.model_config.hf_config
    return any(getattr(cfg, k, 0) for k in ("num_experts", "n_routed_experts", "num_local_experts"))


def ascend_forward_context(vllm_config, num_tokens: int, model=None):
    """vllm-ascend's forward context for one eager forward of `num_tokens` tokens with no
    attention metadata, as its model runner enters it around `model(...)`: 0.23 picks the MoE
    comm method inside `set_ascend_forward_context`; 0.11 takes the runner's pick as
    `moe_comm_type=` (`moe_comm_type` above; v0.10.1rc1 is refused there)."""
    fc = importlib.import_module("vllm_ascend.ascend_forward_context")
    if line().layout == "023":
        return fc.set_ascend_forward_context(None, vllm_config, num_tokens=num_tokens,
                                             model_instance=model)
    if line().name == "0.10.1rc1" and not _config_is_moe(vllm_config):
        # a dense model's layers read nothing from it on this line; its MoE models are refused
        return contextlib.nullcontext()
    comm = moe_comm_type(vllm_config, num_tokens)
    return fc.set_ascend_forward_context(None, vllm_config, num_tokens=num_tokens,
                                         with_prefill=True, moe_comm_type=comm,
                                         model_instance=model)


# vllm-ascend custom ops (torch.ops.vllm.*) registered for the NPU dispatch key only whose bodies
# are plain torch / torch.distributed code: on a CPU they run the same upstream body. By line:
# "module:function" of the body, per qualified op name.
_DEVICE_NEUTRAL_OPS = {
    "023": {
        # ops/linear.py: F.linear; AscendUnquantizedLinearMethod.apply (e.g. MoE router gates)
        "vllm::unquantized_gemm": "vllm_ascend.ops.linear:unquantized_gemm",
        # ops/register_custom_ops.py: TP all-reduce unless the comm method already reduced
        "vllm::maybe_all_reduce_tensor_model_parallel":
            "vllm_ascend.ops.register_custom_ops:_maybe_all_reduce_tensor_model_parallel_impl",
    },
    "011": {},
}


def device_neutral_ascend_ops() -> dict:
    """{qualified op name: upstream body} of vllm-ascend's NPU-only custom ops whose bodies are
    device-neutral torch code (see `_DEVICE_NEUTRAL_OPS`); importing the bodies' modules is what
    registers the ops."""
    return {name: _resolve(path) for name, path in _DEVICE_NEUTRAL_OPS[line().layout].items()}


# Facts vllm-ascend caches per process about THE model its worker serves (module globals in
# vllm_ascend.utils, filled on first use): 0.11 and 0.23 `_IS_MOE_MODEL`, 0.23 also
# `_IS_DRAFTER_MOE_MODEL`; v0.10.1rc1 has neither.
_PER_MODEL_CACHES = ("_IS_MOE_MODEL", "_IS_DRAFTER_MOE_MODEL")


def forget_served_model() -> None:
    """Clear vllm-ascend's per-process model facts before another model is built in the same
    process (the CPU harness builds several; on an NPU a worker serves one). Without this a MoE
    model built after a dense one is taken for dense: no MoE comm method in its forward context."""
    utils = importlib.import_module("vllm_ascend.utils")
    for name in _PER_MODEL_CACHES:
        if hasattr(utils, name):
            setattr(utils, name, None)


def hccl_token_dispatchers() -> Tuple[Tuple[str, str], ...]:
    """(module, name) of each token dispatcher class vllm-ascend's fused-MoE layers construct
    whose constructor asks `torch.device("npu")`'s HCCL backend for a communicator name, as
    the comm-method module sees it (`setup_moe_comm_method` builds the comm methods with every
    MoE layer):
    - 0.11 `ops/moe/moe_comm_method.py`: TokenDispatcherWithMC2, built for every layer (its
      all-to-all dispatcher needs no HCCL name);
    - 0.23 `ops/fused_moe/moe_comm_method.py`: TokenDispatcherWithMC2 and
      TokenDispatcherWithAll2AllV, built only with expert parallelism (`ep_size > 1`);
    - v0.10.1rc1: none (its fused-MoE layer builds no comm methods)."""
    if line().name == "0.11.0":
        return (("vllm_ascend.ops.moe.moe_comm_method", "TokenDispatcherWithMC2"),)
    if line().layout == "023":
        return (("vllm_ascend.ops.fused_moe.moe_comm_method", "TokenDispatcherWithMC2"),
                ("vllm_ascend.ops.fused_moe.moe_comm_method", "TokenDispatcherWithAll2AllV"))
    return ()


def moe_gmm_swiglu_fusion_flag():
    """(object, attribute) that makes vllm-ascend's all-gather MoE path use the fused
    gate_up-matmul + swiglu + quant kernel (True) or npu_grouped_matmul, npu_swiglu and
    npu_dynamic_quant (False), for tests to monkeypatch. 0.23: the comm method's
    `use_fusion_ops`, read from additional_config `ascend_fusion_config.fusion_ops_gmmswigluquant`
    (default True) when the comm methods are built. None on 0.11 (W8A8 MoE always fuses)."""
    if line().layout != "023":
        return None
    mcm = importlib.import_module("vllm_ascend.ops.fused_moe.moe_comm_method")
    fc = importlib.import_module("vllm_ascend.ascend_forward_context")
    return mcm.get_moe_comm_method(fc.MoECommType.ALLGATHER), "use_fusion_ops"
