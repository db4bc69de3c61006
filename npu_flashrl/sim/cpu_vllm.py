"""Run the REAL vLLM / vllm-ascend model code on a CPU (tests, rehearsal, users' NPU-free CI).

What it does, following ../shared/docs/cpu-test-stack.md:
- installs the torch_npu emulation (reference kernels) so vllm_ascend imports, and gives
  vllm-ascend's NPU-only custom ops (e.g. `vllm::quantize`) a CPU kernel;
- makes vLLM's current platform a CPU platform that, like the NPU platform, supports the
  "ascend" quantization method;
- builds a VllmConfig for a local checkpoint, enters it, initialises a gloo process group and
  vLLM's model-parallel groups, and initialises vllm-ascend's own config;
- builds the model with vLLM's own loader (`get_model`), so the load path is the one users run;
- replaces attention by plain causal attention (the vLLM attention backends need a GPU/NPU);
- MoE models: builds vLLM's FusedMoE layers as vllm-ascend's AscendFusedMoE (registered as the
  NPU platform registers it; `ascend_harness.register_ascend_moe_layers`) and runs every forward inside
  vllm-ascend's own forward context (`ascend_harness.ascend_forward_context`: its
  `set_ascend_forward_context`, with the MoE communication method its model runner picks; on one
  device without expert parallelism that is ALLGATHER). The torch_npu / vllm-ascend kernels the
  fused-MoE path calls are the emulation's reference kernels (`kernels.moe_reference`).
"""
from __future__ import annotations

import contextlib
import os
from typing import Optional

import torch

from npu_flashrl.kernels import emulation
from npu_flashrl.lines import current
from npu_flashrl.sim import ascend_harness
from npu_flashrl.sim.ports import free_port  # noqa: F401 - the rigs' port, here for their imports

_dist_state = {"initialized": False, "world_size": None}


def prepare_process(enable_nz: bool = True) -> None:
    """Process-wide set-up; idempotent. Must run before vLLM picks a platform."""
    os.environ.setdefault("TORCH_DEVICE_BACKEND_AUTOLOAD", "0")
    emulation.install(current().emulated_packages)
    import vllm.platforms as platforms

    cls = _platform_cls()
    if not isinstance(platforms._current_platform, cls):
        platforms._current_platform = cls()
    # registers "ascend" with vLLM and vllm-ascend's custom ops; imports the scheme classes
    current().method_class("W8A8_DYNAMIC", "linear")
    cls.supported_quantization = _npu_supported_quantization()
    _register_ascend_compressed_tensors()
    emulation.register_cpu_ops()
    _device_neutral_ops_on_cpu()
    ascend_harness.set_vllm_ascend_flags(is_310p=False, enable_nz=enable_nz)
    _mc2_without_hccl()
    _hccl_dispatchers_unavailable()



def _npu_supported_quantization() -> list:
    """The methods vllm-ascend's NPU platform accepts (on the current line: "ascend", "compressed-tensors", ...),
    read from it where it imports on the CPU; else "ascend" alone (the pinned line's list)."""
    try:
        import importlib

        methods = importlib.import_module("vllm_ascend.platform").NPUPlatform.supported_quantization
    except Exception:  # noqa: BLE001 - a line whose platform module needs the device
        return ["ascend"]
    return list(methods) if "ascend" in methods else ["ascend", *methods]


def _register_ascend_compressed_tensors() -> None:
    """Stand-in for `NPUPlatform.pre_register_and_update` importing vllm-ascend's quantization
    configs (where it has one, its `AscendCompressedTensorsConfig` replaces vLLM's "compressed-tensors"
    method on import); lines whose vllm-ascend has none have nothing to register."""
    import importlib

    try:
        importlib.import_module("vllm_ascend.quantization.compressed_tensors_config")
    except ModuleNotFoundError as exc:
        if not (exc.name or "").startswith("vllm_ascend.quantization"):
            raise


def prepare_int8_worker():
    """Set-up of a spawned worker process that builds INT8 models (the `va` test fixture's work
    in the test process): no device-backend autoload, no vLLM plugins, `prepare_process`,
    vllm-ascend's patches applied. Returns the vllm-ascend adapter module; the INT8 function is
    the engine's own (`CpuVllm(choice=...)`)."""
    os.environ["TORCH_DEVICE_BACKEND_AUTOLOAD"] = "0"
    os.environ["VLLM_PLUGINS"] = "none"
    prepare_process()
    from npu_flashrl import patches
    from npu_flashrl.adapters import vllm_ascend

    patches.apply_patches(list(vllm_ascend.PATCHES))
    return vllm_ascend


def int8(fn: str = "int8_profile_free", profile=None):
    """The `EngineChoice` the engine patch writes for an INT8 policy engine of entry `fn`.
    `profile`: the fn-int8 profile file, or a profile in memory (saved to a temporary file: the
    engine's config carries a path, as the entry does)."""
    from npu_flashrl.adapters.engine_choice import EngineChoice

    if profile is not None and not isinstance(profile, str):
        import tempfile

        from npu_flashrl.profile import save_profile

        profile = save_profile(profile, os.path.join(tempfile.mkdtemp(prefix="npu_flashrl_profile_"),
                                                     "profile.pt"))
    return EngineChoice(fn=fn, profile=profile)

_cpu_libs: dict = {}


def _device_neutral_ops_on_cpu() -> None:
    """Stand-in for the NPU dispatch key (idempotent): vllm-ascend registers some custom ops whose
    bodies are plain torch code (F.linear, a TP all-reduce) for the NPU only; the CPU gets the
    same upstream body (`ascend_harness.device_neutral_ascend_ops`). Ops with an NPU kernel body
    get reference kernels instead (`emulation.register_cpu_ops`)."""
    for qual, fn in ascend_harness.device_neutral_ascend_ops().items():
        ns, name = qual.split("::")
        if qual in _cpu_libs or not hasattr(getattr(torch.ops, ns), name):
            continue
        lib = torch.library.Library(ns, "IMPL")
        lib.impl(name, fn, "CPU")
        _cpu_libs[qual] = lib  # the registration lives as long as the Library object


# the quantized fused-MoE schemes whose constructors ask the mc2 group for an HCCL name
_HCCL_ASKING_MOE_SCHEMES = ("W8A8_DYNAMIC", "W4A8_DYNAMIC")


def _mc2_without_hccl() -> None:
    """Stand-in for the HCCL side of vllm-ascend's mc2 group (idempotent): its W8A8_DYNAMIC and
    W4A8_DYNAMIC fused-MoE schemes ask the group's NPU backend for an HCCL communicator name when
    they are built; on gloo there is none, so each scheme's module sees a group without a device
    group and upstream takes its own fallback (an empty name, as for a group without MC2
    metadata). The group itself, used by the dispatchers, is untouched. Same attribute on every
    line; a line without one of the schemes has nothing to stand in for."""
    import importlib

    for quant_type in _HCCL_ASKING_MOE_SCHEMES:
        cls = current().method_class(quant_type, "moe")
        if cls is not None:
            _module_without_hccl(importlib.import_module(cls.__module__))


def _module_without_hccl(module) -> None:
    original = getattr(module, "get_mc2_group", None)
    if original is None or getattr(original, "__npu_flashrl_stand_in__", False):
        return

    class _NoHccl:
        def __init__(self, group):
            self._group = group

        def __getattr__(self, item):
            if item == "device_group":
                raise AttributeError("device_group: no HCCL on the CPU harness")
            return getattr(self._group, item)

    def get_mc2_group():
        return _NoHccl(original())

    get_mc2_group.__npu_flashrl_stand_in__ = True
    module.get_mc2_group = get_mc2_group


class _HcclDispatcherUnavailable:
    """Stand-in for vllm-ascend's MC2 / all-to-all token dispatchers on the CPU harness: they
    dispatch over HCCL, which a gloo process does not have, and their constructors ask the NPU
    backend for an HCCL communicator name. vllm-ascend builds them with the MoE layers (which,
    and when: `StackLine.sim.hccl_token_dispatchers`) and selects them only where all-gather
    would not be picked (A2: MC2 from 16 EP ranks on); using one here fails loudly."""

    def __init__(self, *args, **kwargs):
        pass

    def __getattr__(self, item):
        raise NotImplementedError(f"HCCL token dispatcher .{item}: MC2 / all-to-all dispatch needs "
                                  "HCCL; the CPU harness runs vllm-ascend's all-gather MoE dispatch")


def _hccl_dispatchers_unavailable() -> None:
    """Where vllm-ascend's comm methods construct an HCCL token dispatcher
    (`ascend_harness.hccl_token_dispatchers`), construct `_HcclDispatcherUnavailable` instead
    (idempotent; the comm-method module's name only, the dispatcher module is untouched)."""
    import importlib

    for module_name, name in ascend_harness.hccl_token_dispatchers():
        setattr(importlib.import_module(module_name), name, _HcclDispatcherUnavailable)


def _make_platform_cls():
    from vllm.platforms.cpu import CpuPlatform

    class CpuAscendPlatform(CpuPlatform):
        """vLLM's CPU platform that accepts vllm-ascend's quantization method, as the NPU does."""
        supported_quantization = ["ascend"]

    return CpuAscendPlatform


_CpuAscendPlatform = None  # created on first use (needs vLLM importable)


def _platform_cls():
    global _CpuAscendPlatform
    if _CpuAscendPlatform is None:
        _CpuAscendPlatform = _make_platform_cls()
    return _CpuAscendPlatform


def make_vllm_config(model_dir: str, dtype: torch.dtype = torch.bfloat16,
                     quantization: Optional[str] = None, tp_size: int = 1,
                     load_format: str = "auto", use_tqdm_on_load: bool = True,
                     additional_config: Optional[dict] = None):
    """vLLM's config for a CPU engine, built as `EngineArgs.create_engine_config` builds one under
    npu_flashrl's engine patch: `additional_config` (e.g. `with_choice({}, int8(...))`) goes into
    the config, and the hooks that run inside the build see the engine's choice."""
    from vllm.config import DeviceConfig, LoadConfig, ModelConfig, ParallelConfig, VllmConfig

    from npu_flashrl.adapters import engine_choice

    with engine_choice.building(engine_choice.choice_in(additional_config)):
        model_config = ModelConfig(model=model_dir, dtype=dtype, skip_tokenizer_init=True,
                                   quantization=quantization, enforce_eager=True)
        return VllmConfig(model_config=model_config,
                          device_config=DeviceConfig(device="cpu"),
                          load_config=LoadConfig(load_format=load_format,
                                                 use_tqdm_on_load=use_tqdm_on_load),
                          parallel_config=ParallelConfig(tensor_parallel_size=tp_size),
                          compilation_config=ascend_harness.eager_compilation_config(),
                          additional_config=dict(additional_config or {}))


def ensure_distributed(tp_size: int = 1, rank: int = 0, init_method: Optional[str] = None,
                       backend: str = "gloo") -> None:
    """vLLM's process group and model-parallel groups, once per process (gloo on the CPU; the
    rehearsal's NPU path passes hccl)."""
    from vllm.distributed import parallel_state as ps

    if _dist_state["initialized"]:
        if _dist_state["world_size"] != tp_size:
            raise RuntimeError(f"process group already initialised with world size "
                               f"{_dist_state['world_size']}, asked for {tp_size}")
        return
    ps.init_distributed_environment(
        world_size=tp_size, rank=rank, local_rank=rank,
        distributed_init_method=init_method or f"tcp://127.0.0.1:{free_port()}", backend=backend)
    ps.initialize_model_parallel(tp_size, 1)
    _dist_state.update(initialized=True, world_size=tp_size, backend=backend)


def ensure_expert_parallel_group() -> None:
    """vLLM's expert-parallel group for a MoE model, when this process's groups were made for a
    dense one (idempotent). Newer vLLM creates it only if the model of the config current at
    `initialize_model_parallel` is MoE: right for a worker that serves one model, not for a
    process that builds several (tests). Same ranks as vLLM's (one pipeline stage, no DP / PCP:
    the TP ranks). vLLM lines that always create it are left alone."""
    from vllm.distributed import parallel_state as ps

    if getattr(ps, "_EP", "always created") is not None:
        return
    ps._EP = ps.init_model_parallel_group(
        [list(range(_dist_state["world_size"]))], ps.get_world_group().local_rank,
        _dist_state.get("backend", "gloo"), group_name="ep")


# vLLM's layer instances kept per process and handed to every model that asks for the same key:
# "module:dict attribute". `get_rope` keeps one RotaryEmbedding per rope key (head size, rotary dim,
# max positions, base / scaling, dtype), and a CustomOp fixes its forward (plain torch or the
# platform's kernel) when it is built, under the compilation config current then.
SHARED_LAYER_CACHES = ("vllm.model_executor.layers.rotary_embedding:_ROPE_DICT",)


def forget_shared_layers() -> None:
    """Empty vLLM's per-process layer caches (`SHARED_LAYER_CACHES`) before another model is built
    in this process (the CPU harness builds several; a vLLM worker builds one). Without this a
    model reuses the rotary embedding of an earlier model of the same shape, built under that
    model's config: after one built under verl's engine config (custom ops on) it calls vLLM's
    compiled `_C.rotary_embedding`, which a CPU test stack does not have; after one loaded with
    load_format="dummy" (vLLM's dummy loader randomizes its layers' tensors, that shared
    cos_sin_cache included) its rotary embedding is noise. Models already built keep their own
    instances."""
    import importlib

    for path in SHARED_LAYER_CACHES:
        module, _, attr = path.partition(":")
        cache = getattr(importlib.import_module(module), attr, None)
        if cache is None:
            raise RuntimeError(f"{path}: not found in the installed vLLM (SHARED_LAYER_CACHES "
                               "names a cache this vLLM does not have)")
        cache.clear()


class CpuVllm:
    """A vLLM model built on the CPU from a local checkpoint, with its config kept current.

    Use as a context manager; `model` is the loaded (and post-processed) vLLM model.
    `choice`: the engine's `EngineChoice` (`int8(fn, profile)`), as the engine patch records it
    for the policy rollout (None: an engine npu_flashrl leaves alone).
    `ascend_moe_layers=False` (a fresh process only: the registration is process-wide) keeps
    vLLM's own FusedMoE: same parameters and the same `weight_loader` (vllm-ascend's AscendFusedMoE
    inherits them), none of vllm-ascend's MoE layer logic. For a weight-loading test of a setting
    AscendFusedMoE itself refuses first (dynamic EPLB without expert parallelism); such a model
    cannot run its MoE forward.
    """

    def __init__(self, model_dir: str, dtype: torch.dtype = torch.bfloat16,
                 quantization: Optional[str] = None, tp_size: int = 1, rank: int = 0,
                 load_format: str = "auto", init_method: Optional[str] = None,
                 enable_nz: bool = True, use_tqdm_on_load: bool = True, vllm_config=None,
                 ascend_moe_layers: bool = True, choice=None):
        self.ascend_moe_layers = ascend_moe_layers
        self.choice = choice
        self.model_dir = model_dir
        self.dtype = dtype
        self.quantization = quantization
        self.tp_size, self.rank = tp_size, rank
        self.load_format = load_format
        self.init_method = init_method
        self.enable_nz = enable_nz
        self.use_tqdm_on_load = use_tqdm_on_load
        self._stack = contextlib.ExitStack()
        self.vllm_config = vllm_config  # given: one vLLM built itself (e.g. verl's engine args)
        self.model = None

    def __enter__(self) -> "CpuVllm":
        prepare_process(enable_nz=self.enable_nz)
        from vllm.config import set_current_vllm_config

        if self.vllm_config is None:
            from npu_flashrl.adapters.engine_choice import with_choice

            extra = with_choice({}, self.choice) if self.choice is not None else None
            self.vllm_config = make_vllm_config(self.model_dir, self.dtype, self.quantization,
                                                self.tp_size, self.load_format,
                                                self.use_tqdm_on_load, extra)
        given_tp = getattr(self.vllm_config.parallel_config, "tensor_parallel_size", 1)
        if given_tp != self.tp_size:  # else the build depends on groups an earlier model left
            raise ValueError(
                f"CpuVllm({self.model_dir!r}): the given vllm_config has tensor_parallel_size="
                f"{given_tp} but this harness runs {self.tp_size} rank(s) (tp_size={self.tp_size}): "
                "pass tp_size, or build the config for the ranks this process stands for")
        # Keep the context manager referenced for the model's lifetime (cpu-test-stack.md).
        self._stack.enter_context(set_current_vllm_config(self.vllm_config))
        ensure_distributed(self.tp_size, self.rank, self.init_method)
        if getattr(self.vllm_config.model_config, "is_moe", False):
            ensure_expert_parallel_group()
        ascend_harness.init_vllm_ascend_config(self.vllm_config)
        ascend_harness.forget_served_model()  # vllm-ascend caches "is MoE" per process: one model each
        forget_shared_layers()
        # vllm-ascend's own groups (mc2, ...), as its NPU worker creates them after vLLM's and
        # its config: the fused-MoE schemes look them up when the model is built
        from vllm_ascend.distributed.parallel_state import init_ascend_model_parallel

        init_ascend_model_parallel(self.vllm_config.parallel_config)
        use_plain_attention()
        # a line whose AscendFusedMoE builds its MC2 dispatch (HCCL) at init cannot run a MoE
        # forward here anyway (ascend_harness.cpu_moe_forward_unsupported): vLLM's FusedMoE holds
        # the same parameters and weight_loader for the load / reload tests
        if self.ascend_moe_layers and ascend_harness.cpu_moe_forward_unsupported() is None:
            ascend_harness.register_ascend_moe_layers()
        from vllm.model_executor.model_loader import get_model

        default_dtype = torch.get_default_dtype()
        try:
            with torch.device("cpu"):
                self.model = get_model(vllm_config=self.vllm_config)
        except BaseException:
            # A refused build must not leak into the next test: vLLM's set_default_torch_dtype
            # restores the default dtype only on success, and our config context is still open.
            torch.set_default_dtype(default_dtype)
            self._stack.close()
            raise
        return self

    def __exit__(self, *exc) -> None:
        self._stack.close()

    # ------------------------------------------------------------------ forward helpers
    def forward_context(self, num_tokens: int):
        """vllm-ascend's forward context for one forward of `num_tokens` tokens, as its model
        runner sets it (vLLM's FusedMoE layers need one; see
        `ascend_harness.ascend_forward_context`). Enter it around any direct call of the model's
        layers."""
        return ascend_harness.ascend_forward_context(self.vllm_config, num_tokens, self.model)

    @torch.no_grad()
    def logits(self, input_ids: torch.Tensor) -> torch.Tensor:
        """Logits [B, T, V] for a batch of equal-length sequences, via the vLLM model's layers,
        one sequence per forward (each inside vllm-ascend's forward context)."""
        out = []
        for seq in input_ids:
            positions = torch.arange(seq.shape[0])
            with self.forward_context(seq.shape[0]):
                hidden = self.model.model(seq, positions, None)  # Llama / DeepSeek: intermediate_tensors has no default
            out.append(ascend_harness.compute_logits(self.model, hidden).float())
        return torch.stack(out)


def _plain_attention_forward(self, query, key, value, *args, **kwargs):
    """Causal scaled-dot-product attention over one sequence ([T, H*D] flattened inputs)."""
    t = query.shape[0]
    q = query.view(t, self.num_heads, self.head_size).transpose(0, 1)
    k = key.view(t, self.num_kv_heads, self.head_size).transpose(0, 1)
    v = value.view(t, self.num_kv_heads, self.head_size).transpose(0, 1)
    rep = self.num_heads // self.num_kv_heads
    if rep > 1:
        k = k.repeat_interleave(rep, dim=0)
        v = v.repeat_interleave(rep, dim=0)
    o = torch.nn.functional.scaled_dot_product_attention(
        q.float(), k.float(), v.float(), is_causal=True, scale=self.impl.scale
        if hasattr(self, "impl") and hasattr(self.impl, "scale") else None)
    return o.transpose(0, 1).reshape(t, self.num_heads * self.head_size).to(query.dtype)


def use_plain_attention() -> None:
    """Test-harness substitution (not a product patch): vLLM's attention backends need a device."""
    Attention = ascend_harness.vllm_attention_class()
    if getattr(Attention.forward, "__npu_flashrl_plain__", False):
        return
    _plain_attention_forward.__npu_flashrl_plain__ = True
    Attention.forward = _plain_attention_forward
