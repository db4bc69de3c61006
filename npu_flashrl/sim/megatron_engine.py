"""server-mode verl's Megatron engine (`verl/workers/engine/megatron/transformer_impl.py`,
`MegatronEngineWithLMHead`) on a CPU: built, loaded and exporting weights in one process per
trainer rank, with gloo between the ranks.

What runs for real: verl's engine (`__init__` -> `_init_device_mesh` -> megatron-core's
`initialize_model_parallel`; `initialize()` -> `_build_tf_config` -> `make_megatron_module` ->
the bridge's `get_model` / `load_weights`; `get_per_tensor_param` -> the bridge's export, TP and
EP all-gathered over gloo), megatron-core's `GPTModel` with its tensor-parallel layers, mbridge's
name mapping and q/k/v, gate/up and TP merges, verl's `BucketedWeightSender`.

Stand-ins (`install()`; each for what needs a GPU/NPU or a package the CPU stack cannot have):
- verl's platform: a CPU `PlatformBase` given to verl's own `set_platform` (server-mode verl has no CPU
  platform; device "cpu", a device module with no-op cache/memory calls, gloo);
- megatron-core's CUDA RNG-states tracker (`tensor_parallel.random`): one that records the seeds
  and forks without switching generator state (the CPU has no CUDA generator; dropout is 0 in
  these models and every weight is loaded from the checkpoint);
- `torch.cuda.current_device()`: "cpu" (Megatron's layers allocate on it), and
  `nn.Module.cuda()`: a no-op (the bridge moves the built model to the GPU), `torch.cuda.Stream`
  an object with no-op methods (megatron-core's MoE alltoall dispatcher opens one); inside
  megatron-core's `pipeline_parallel.schedules` and `transformer.utils`, `torch` is a proxy whose
  tensor factories put `device="cuda"` tensors (a token counter, attention masks) on the CPU;
- TransformerEngine: megatron-core's local layer spec (`use_transformer_engine=False`) where
  mbridge asks for the TE spec, and the local spec's separate norms
  (`input_layernorm`, `pre_mlp_layernorm`) read as TE's fused names
  (`linear_qkv.layer_norm_weight`, `linear_fc1.layer_norm_weight`) in mbridge's name mapping
  where mbridge does not know them, and the local MoE spec's SequentialMLP experts
  (`experts.local_experts.<i>.linear_fcN.weight`) read as TE's grouped MLP
  (`experts.linear_fcN.weight<i>`, the names mbridge maps and keys its EP all-gather on).
  Local norms (torch, no Apex) refuse sequence parallel and `persist_layer_norm`, MoE layers run
  megatron-core's SequentialMLP (no grouped GEMM), and the local `DotProductAttention`
  takes no packed sequences: engines are built with sequence parallel off and
  `use_remove_padding=False` (verl's padded "bshd" forward instead of packed "thd"). verl's
  bshd padding mask ([batch, seq] bool, right padding) is read by the local attention as no
  mask, i.e. causal only, which is exact for every valid token of a right-padded row;
- `peft` and HF `datasets`, which verl imports at module level and the CPU stack lacks: empty
  modules while verl's engine is imported;
- the actor's optimizer and DDP wrapper (megatron-core's optimizer allocates on 'cuda'
  unconditionally): the engine is built `forward_only=True`. The weights it exports and the loss
  path (`forward_backward_batch(..., forward_only=False)`, what `train_batch` runs before
  `optimizer_step`) are the actor's.
- Megatron-Bridge (server-mode verl's default, `vanilla_mbridge=False`) needs Python >= 3.12 from
  0.4 on (verl's `megatron` extra pins 0.5.2): the CPU stack runs on 3.11, so the engine uses
  mbridge (`vanilla_mbridge=True`), the bridge server-mode verl's Ascend install script installs.

Rank process: `python -m npu_flashrl.sim.megatron_engine JSON` (JSON: rank, world, port, model,
tp, ep, pp, engine, handle) builds the engine, prints PREFIX+"ready", then reads one JSON command per line
on stdin: `{"load": DIR}` loads DIR's HF weights into the engine through the bridge (the
trainer's weights after a step), `{"send": true, "bucket_bytes": N}` runs `get_per_tensor_param`
and sends it with verl's sender (rank 0, to `handle`; other ranks take part in the export's
collectives and drop the tensors), `{"names": true}` prints the exported (name, shape, dtype),
`{"call": "module:function", "kwargs": {...}}` prints `result <json>` of `function(engine,
**kwargs)` (what a test runs on every rank: a log-prob pass, a loss step).
With `"patches": [names]` in JSON, those npu_flashrl patches are applied before the engine is
built (what activation does in a trainer worker).
"""
from __future__ import annotations

import contextlib
import importlib.util
import json
import os
import re
import sys
import types

PREFIX = "@npu_flashrl@ "
STAND_INS = ("verl platform (CPU)", "megatron-core CUDA RNG tracker (CPU)",
             "torch.cuda.current_device -> cpu, nn.Module.cuda no-op",
             "TransformerEngine -> megatron-core local layer spec (+ mbridge norm names)",
             "peft/datasets empty modules at verl import",
             "actor optimizer/DDP: engine built forward_only=True",
             "Megatron-Bridge (Python >= 3.12) -> mbridge (vanilla_mbridge=True)")


def cpu_platform():
    """A CPU `PlatformBase` for verl's `set_platform`."""
    import torch
    from verl.plugin.platform.platform_base import PlatformBase

    class CPUDevice(types.ModuleType):
        def __getattr__(self, name):
            return getattr(torch.cpu, name)

        def empty_cache(self): pass
        def memory_allocated(self, *a, **k): return 0
        def memory_reserved(self, *a, **k): return 0
        def max_memory_allocated(self, *a, **k): return 0
        def max_memory_reserved(self, *a, **k): return 0
        def mem_get_info(self, *a, **k): return (0, 0)
        def reset_peak_memory_stats(self, *a, **k): pass

    class CPUPlatform(PlatformBase):
        device_name = "cpu"
        vendor_name = "cpu"
        device_module = CPUDevice("npu_flashrl_cpu_device")

        def is_available(self): return True
        def current_device(self): return "cpu"
        def device_count(self): return 1
        def set_device(self, index): pass
        def synchronize(self, index=None): pass
        def manual_seed(self, seed): torch.manual_seed(seed)
        def manual_seed_all(self, seed): torch.manual_seed(seed)
        def communication_backend_name(self): return "gloo"
        def cudart(self): return None
        def empty_cache(self): pass
        def get_device_capability(self, index=0): return (None, None)
        def is_ipc_supported(self): return False
        def nvtx_range(self, msg): return contextlib.nullcontext()
        def profiler_start(self): pass
        def profiler_stop(self): pass
        def ray_noset_envvars(self): return []
        def ray_resource_name(self): return "CPU"
        def set_allocator_settings(self, settings): pass
        def visible_devices_envvar(self): return "CPU_VISIBLE_DEVICES"

    return CPUPlatform()


def stub_absent_modules(names):
    """Empty modules for `names` that are not installed (verl imports peft / datasets at module
    level); returns the names added, for the caller to remove after the import."""
    def missing(attr):
        if attr.startswith("__"):
            raise AttributeError(attr)
        return type(attr, (), {})

    added = []
    for name in names:
        root = name.split(".")[0]
        if name in sys.modules or (root not in sys.modules and importlib.util.find_spec(root)):
            continue
        mod = types.ModuleType(name)
        mod.__getattr__ = missing
        mod.__path__ = []
        sys.modules[name] = mod
        added.append(name)
    return added


class _NoStream:
    """`torch.cuda.Stream` on a CPU: nothing to order."""

    def __init__(self, *args, **kwargs): pass
    def wait_stream(self, *args, **kwargs): pass
    def synchronize(self): pass
    def record_event(self, *args, **kwargs): return None


class _CpuFactories(types.ModuleType):
    """`torch`, with `device="cuda"` in its tensor factories read as the CPU."""
    _FACTORIES = ("zeros", "ones", "empty", "full", "tensor", "arange", "zeros_like", "ones_like")

    def __getattr__(self, name):
        import torch

        fn = getattr(torch, name)
        if name not in self._FACTORIES:
            return fn

        def on_cpu(*args, **kwargs):
            if str(kwargs.get("device", "")).startswith("cuda"):
                kwargs["device"] = "cpu"
                kwargs.pop("pin_memory", None)
            return fn(*args, **kwargs)

        return on_cpu


_LOCAL_EXPERT = re.compile(r"^(.*)\.mlp\.experts\.local_experts\.(\d+)\.(linear_fc[12])\.weight$")

# the local spec's norm names -> TE's fused names, which mbridge's tables know
_LOCAL_NORMS = {".input_layernorm.weight": ".self_attention.linear_qkv.layer_norm_weight",
                ".pre_mlp_layernorm.weight": ".mlp.linear_fc1.layer_norm_weight"}


def install() -> None:
    """All stand-ins of the module doc; call before verl's engine module is imported."""
    import torch

    lora = ("peft", "peft.utils", "peft.utils.save_and_load")
    added = stub_absent_modules(lora + ("datasets",))
    from verl.plugin.platform import platform_manager

    platform_manager.set_platform(cpu_platform())
    import verl.workers.engine.megatron.transformer_impl  # noqa: F401  (with the stubs in place)

    for name in lora:  # transformers must not take peft for installed
        if name in added:
            sys.modules.pop(name)

    from megatron.core.tensor_parallel import random as mrandom

    class CPURNGStatesTracker(mrandom.CudaRNGStatesTracker):
        def add(self, name, seed):
            self._is_initialized = True
            if seed in self.seeds_:
                raise Exception(f"seed {seed} already exists")
            self.seeds_.add(seed)
            self.states_[name] = torch.tensor([seed])

        def fork(self, name="model-parallel-rng"):
            if name not in self.states_:
                raise Exception(f"cuda rng state {name} is not added")
            return contextlib.nullcontext()

    mrandom.CudaRNGStatesTracker = CPURNGStatesTracker
    from megatron.core.pipeline_parallel import schedules
    from megatron.core.transformer import utils as transformer_utils

    schedules.torch = transformer_utils.torch = _CpuFactories("torch")
    torch.cuda.current_device = lambda: "cpu"
    torch.nn.Module.cuda = lambda self, device=None: self
    torch.cuda.Stream = _NoStream  # the MoE alltoall dispatcher opens one for its D2H copies

    from megatron.core.transformer.dot_product_attention import DotProductAttention

    attention = DotProductAttention.forward

    def causal_for_padding(self, query, key, value, attention_mask, *args, **kwargs):
        if attention_mask is not None and attention_mask.dim() == 2:
            attention_mask = None
        return attention(self, query, key, value, attention_mask, *args, **kwargs)

    DotProductAttention.forward = causal_for_padding

    from mbridge.core.bridge import Bridge
    from mbridge.core.llm_bridge import LLMBridge
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_decoder_block_spec

    def local_spec(self, vp_stage=None):
        self.has_vp_stage = True
        return get_gpt_decoder_block_spec(self.config, use_transformer_engine=False,
                                          vp_stage=vp_stage)

    LLMBridge._get_transformer_layer_spec = local_spec
    to_hf = Bridge._weight_name_mapping_mcore_to_hf

    def local_norm_names(self, name):
        try:  # the MoE bridges know `pre_mlp_layernorm` (TE has no fused fc1 norm there)
            return to_hf(self, name)
        except NotImplementedError:
            for local, te in _LOCAL_NORMS.items():
                if name.endswith(local):
                    return to_hf(self, name[: -len(local)] + te)
            raise

    Bridge._weight_name_mapping_mcore_to_hf = local_norm_names
    local_to_global = Bridge._weight_name_mapping_mcore_local_to_global

    def grouped_expert_names(self, model, consider_ep=True):
        # local spec's SequentialMLP `experts.local_experts.<i>.linear_fcN.weight` read as TE's
        # grouped MLP `experts.linear_fcN.weight<i>`, global <i> with consider_ep (mbridge's rule)
        ret = local_to_global(self, model, consider_ep)
        per_rank = (self.config.num_moe_experts or 0) // max(self.mpu.ep_size, 1)
        offset = per_rank * self.mpu.ep_rank if consider_ep and self.mpu.ep_size > 1 else 0
        for k, v in ret.items():
            m = _LOCAL_EXPERT.match(v)
            if m:
                ret[k] = f"{m.group(1)}.mlp.experts.{m.group(3)}.weight{int(m.group(2)) + offset}"
        return ret

    Bridge._weight_name_mapping_mcore_local_to_global = grouped_expert_names


def build_engine(model_dir: str, tp: int = 1, ep: int = 1, engine: str = "megatron",
                 **engine_overrides):
    """verl's own MegatronEngineWithLMHead (engine="mindspeed": its NPU subclass
    MindspeedEngineWithLMHead, which runs MindSpeed's `repatch` first) for the HF checkpoint in
    `model_dir`, initialized (model built, weights loaded through the bridge). The process group
    must exist."""
    from verl.trainer.config import CheckpointConfig
    from verl.workers.config import HFModelConfig, McoreEngineConfig, McoreOptimizerConfig

    if engine == "mindspeed":
        from verl.workers.engine.mindspeed.transformer_impl import (
            MindspeedEngineWithLMHead as MegatronEngineWithLMHead)
    else:
        from verl.workers.engine.megatron.transformer_impl import MegatronEngineWithLMHead

    override = dict(engine_overrides.pop("override_transformer_config", {}) or {})
    override.setdefault("sequence_parallel", False)  # local (torch) norms refuse it ...
    override.setdefault("persist_layer_norm", False)  # ... and this (mbridge's MoE bridges set it)
    override.setdefault("moe_grouped_gemm", False)  # grouped GEMM needs TE / CUDA kernels
    cfg = dict(vanilla_mbridge=True, tensor_model_parallel_size=tp, expert_model_parallel_size=ep,
               forward_only=True, use_distributed_optimizer=False, sequence_parallel=False,
               use_remove_padding=False,
               override_transformer_config=override)
    cfg.update(engine_overrides)
    built = MegatronEngineWithLMHead(HFModelConfig(path=model_dir),
                                     McoreEngineConfig(**cfg), McoreOptimizerConfig(lr=1e-5),
                                     CheckpointConfig())
    built.initialize()
    return built


def init_process_group(rank: int, world: int, port: int) -> None:
    import torch.distributed as dist

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=world)


def _say(word: str) -> None:
    print(PREFIX + word, flush=True)


def _send(engine, handle, cmd, rank) -> None:
    import asyncio

    gen, _ = engine.get_per_tensor_param()
    if rank != 0 or not handle:
        for _ in gen:  # the export's all-gathers need every rank
            pass
        _say("sent")
        return
    from verl.workers.rollout.vllm_rollout.bucketed_weight_transfer import BucketedWeightSender

    sender = BucketedWeightSender(zmq_handle=handle, bucket_size_mb=1, use_shm=True)
    if cmd.get("bucket_bytes"):
        sender.bucket_size = int(cmd["bucket_bytes"])  # a tiny model's sync in several buckets
    asyncio.run(sender.async_send_weights(gen))
    _say("sent")


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if len(argv) != 1:
        print("usage: python -m npu_flashrl.sim.megatron_engine JSON", file=sys.stderr)
        return 2
    spec = json.loads(argv[0])
    os.environ.setdefault("VLLM_PLUGINS", "none")
    install()
    from npu_flashrl.sim import verl_transfer

    verl_transfer.use_cpu_device()
    rank = int(spec["rank"])
    if spec.get("patches"):
        from npu_flashrl import adapters, patches

        adapters.load_all()  # registers the patches, as activation does
        applied = patches.apply_patches(list(spec["patches"]))
        if not all(applied.values()):
            raise SystemExit(f"npu_flashrl patches not applied: {applied}")
    init_process_group(rank, int(spec["world"]), int(spec["port"]))
    engine = build_engine(spec["model"], tp=int(spec.get("tp", 1)), ep=int(spec.get("ep", 1)),
                          engine=spec.get("engine", "megatron"),
                          pipeline_model_parallel_size=int(spec.get("pp", 1)))
    _say("ready")
    for line in sys.stdin:
        if not line.strip():
            continue
        cmd = json.loads(line)
        if cmd.get("load"):
            engine.bridge.load_weights(engine.module, cmd["load"])
            _say("loaded")
        if cmd.get("names"):
            gen, _ = engine.get_per_tensor_param()
            _say("names " + json.dumps([[n, list(t.shape), str(t.dtype)] for n, t in gen]))
        if cmd.get("send"):
            _send(engine, spec.get("handle"), cmd, rank)
        if cmd.get("call"):
            import importlib

            mod, _, fn = cmd["call"].partition(":")
            try:
                result = getattr(importlib.import_module(mod), fn)(engine, **cmd.get("kwargs", {}))
            except Exception:  # noqa: BLE001 - reported to the test, which fails with it
                import traceback

                _say("error " + json.dumps(traceback.format_exc()))
                continue
            _say("result " + json.dumps(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
