"""verl server mode (the server-mode verl lines, `npu_flashrl.lines.verl`): INT8 rollouts behind verl's bucketed weight sync.

On these lines the rollout is a vLLM server (`vLLMHttpServer` Ray actor) whose vLLM workers
(`distributed_executor_backend="mp"`) receive every weight sync as buckets through
`vLLMColocateWorkerExtension.update_weights_from_ipc`. npu_flashrl reaches those processes
through its vLLM general plugin (see docs/verl_server_mode.md for the process map). This module:

- registers with the engine patch (`vllm_engine.register_server_engines`, on import) that an
  engine built with verl's worker extension gets its syncs through `update_weights_from_ipc`,
  which replica it is (`VERL_REPLICA_RANK`), and whether it serves the policy;
- refuses verl's own `rollout.quantization` together with FLASHRL_CONFIG;
- wraps `update_weights_from_ipc` (patch `verl_server_sync_end`): a sync reaching a model that
  should be INT8 but has no npu_flashrl loader is refused, and after the last bucket every INT8
  model's sync is ended (the rule shared with sync mode, :mod:`.sync_end`), so shards that never
  arrived are an error naming them;
- makes verl's receiver keep acknowledging buckets after a bucket failed (patch
  `verl_server_receiver_drains`): the trainer-side sender waits for the RPC only after its last
  bucket, so a receiver that stops mid-sync leaves the job hanging instead of failing.
"""
from __future__ import annotations

import os
import sys
import traceback
from typing import Any, List, Mapping, Optional

from npu_flashrl import patches
from npu_flashrl._logging import get_logger
from npu_flashrl.adapters import vllm_engine
from npu_flashrl.adapters.verl import sync_end
from npu_flashrl.lines import verl as verl_lines
from npu_flashrl.errors import NpuFlashrlError

logger = get_logger(__name__)

_UTILS = "verl.workers.rollout.vllm_rollout.utils"
_TRANSFER = "verl.workers.rollout.vllm_rollout.bucketed_weight_transfer"
EXTENSION_CLS = f"{_UTILS}.vLLMColocateWorkerExtension"
UPDATE_TARGET = f"{_UTILS}:vLLMColocateWorkerExtension.update_weights_from_ipc"
RECEIVE_TARGET = f"{_TRANSFER}:BucketedWeightReceiver.receive_weights"
PATCH_SYNC = "verl_server_sync_end"
PATCH_DRAIN = "verl_server_receiver_drains"
PATCHES = (PATCH_SYNC, PATCH_DRAIN)
VERSIONS = verl_lines.server_versions()
REPLICA_ENV = "VERL_REPLICA_RANK"
LOADER_ATTR = sync_end.LOADER_ATTR

# What `vLLMHttpServer._apply_quantization` can put into the engine's `quantization`:
# rollout.quantization (fp8, torchao, ascend = MXFP8 on 950) or rollout.qat (modelopt,
# compressed-tensors).
_VERL_QUANT = {"fp8": "actor_rollout_ref.rollout.quantization=fp8",
               "torchao": "actor_rollout_ref.rollout.quantization=torchao",
               "ascend": "actor_rollout_ref.rollout.quantization=ascend (MXFP8, Ascend 950)",
               "modelopt": "actor_rollout_ref.rollout.qat.enable=true (modelopt)",
               "compressed-tensors": "actor_rollout_ref.rollout.qat.enable=true (compressed-tensors)"}


class ServerModeError(NpuFlashrlError, RuntimeError):
    """verl's server-mode rollout cannot run the FlashRL config as set up; the message says why
    and what to change."""


# ------------------------------------------------------------------------------- engine build

def is_server_engine(engine_args: Any) -> bool:
    """True for an engine verl's `vLLMHttpServer` builds: its syncs arrive through the
    `update_weights_from_ipc` this module wraps."""
    return getattr(engine_args, "worker_extension_cls", None) == EXTENSION_CLS


_NOT_POLICY = ("server_reward_", "server_teacher_")


def serves_the_policy() -> bool:
    """False in a `vLLMHttpServer` verl starts for a reward or teacher model (its Ray actor is
    named `<prefix>server_reward_<r>_<n>` / `server_teacher_...`, `vllm_async_server.py:1365`):
    the FlashRL config describes the policy's rollout, and those engines never get weight syncs.

    Decided from what is there, never by starting anything: a verl actor has imported Ray and is
    connected to it. Ray's own API calls `ray.init()` when the process is not connected (its
    auto-init hook), which would start a local Ray instance in, e.g., a vLLM engine built with
    verl's worker extension outside Ray; so Ray is asked only when it is already imported and
    initialised, and otherwise this is not a reward/teacher actor."""
    ray = sys.modules.get("ray")
    try:
        if ray is None or not ray.is_initialized():
            return True  # not a Ray actor: the policy rollout (or a test)
        name = ray.get_runtime_context().get_actor_name()
    except Exception:  # noqa: BLE001 - a partial or stand-in Ray: the policy rollout
        return True
    return not (isinstance(name, str) and any(tag in name for tag in _NOT_POLICY))


def replica_rank(environ: Optional[Mapping[str, str]] = None) -> int:
    """verl's replica number, exported by `vLLMHttpServer.__init__` before the engine is built."""
    env = os.environ if environ is None else environ
    raw = env.get(REPLICA_ENV)
    if raw is None:
        raise ServerModeError(
            f"{REPLICA_ENV} is not set in the process building verl's vLLM engine: a hybrid "
            "FlashRL config (several entries) picks its entry per verl replica "
            f"({REPLICA_ENV} % len(configs)). server-mode verl's vLLMHttpServer sets it; a single-"
            "entry FLASHRL_CONFIG does not need it")
    try:
        return int(raw)
    except ValueError:
        raise ServerModeError(f"{REPLICA_ENV}={raw!r} is not an integer") from None


def check_engine_quantization(engine_args: Any) -> None:
    """Refuse an engine that verl (or engine_kwargs) already asked to quantize: FLASHRL_CONFIG
    decides the rollout's quantization, and two quantizers on one model cannot both apply."""
    quant = getattr(engine_args, "quantization", None)
    if quant is None:
        return
    source = _VERL_QUANT.get(quant, f"actor_rollout_ref.rollout.engine_kwargs.vllm.quantization={quant}")
    raise ServerModeError(
        f"npu_flashrl: FLASHRL_CONFIG={os.environ.get('FLASHRL_CONFIG')!r} is set and verl's "
        f"vLLM engine already has quantization={quant!r} (from {source}). Drop one: remove "
        f"{source.split(' ')[0]} to run npu_flashrl's INT8 W8A8_DYNAMIC rollout, or unset "
        "FLASHRL_CONFIG to use verl's own quantized rollout")


class _VerlServerEngines:
    """Server-mode verl's `vLLMHttpServer` engines, as the engine patch asks about them."""

    is_server_engine = staticmethod(is_server_engine)
    serves_the_policy = staticmethod(serves_the_policy)
    check_engine_quantization = staticmethod(check_engine_quantization)

    @staticmethod
    def replica_rank() -> int:
        return replica_rank()


vllm_engine.register_server_engines(_VerlServerEngines())


def check_verl_config(select, environ: Optional[Mapping[str, str]] = None) -> None:
    """Driver-side check of a server-mode verl config with FLASHRL_CONFIG set (`select(dotted_key)` reads
    it); the rules are the server-mode line's (`verl_lines.Server09.rollout_mode_problem`).
    Raises ServerModeError naming the key to change."""
    problem = verl_lines.for_line(verl_lines.SERVER).rollout_mode_problem(select, os.environ if environ is None
                                                           else environ)
    if problem is not None:
        raise ServerModeError(problem)


# ------------------------------------------------------------------------------------ the sync

def _vllm_config(worker: Any):
    runner = getattr(worker, "model_runner", None)
    return getattr(runner, "vllm_config", None) or getattr(worker, "vllm_config", None)


def _models(worker: Any) -> List[Any]:
    return list(worker._iter_all_models())


def sync_problem(worker: Any, environ: Optional[Mapping[str, str]] = None) -> Optional[str]:
    """Why this worker's model cannot take an npu_flashrl sync, or None if it can (or when
    npu_flashrl has nothing to do here)."""
    env = os.environ if environ is None else environ
    choice = vllm_engine.engine_choice(_vllm_config(worker))
    if choice is None:
        if (env.get("FLASHRL_CONFIG") or "").strip():
            return (f"FLASHRL_CONFIG={env.get('FLASHRL_CONFIG')!r} is set in the vLLM worker, but "
                    "the engine was built without npu_flashrl (no additional_config['npu_flashrl']): "
                    "npu_flashrl was not active where verl built the engine config (the "
                    "vLLMHttpServer actor). Make FLASHRL_CONFIG reach every Ray process "
                    "(+ray_kwargs.ray_init.runtime_env.env_vars.FLASHRL_CONFIG=...) and keep "
                    "VLLM_PLUGINS unset or listing npu_flashrl")
        return None
    if not choice.quantized:
        return None  # this replica's entry is 16-bit: verl's own load path is the right one
    model = _models(worker)[0]
    if getattr(model, LOADER_ATTR, None) is None:
        return (f"the engine was built for npu_flashrl's {choice.fn} entry but "
                f"{type(model).__name__} has no npu_flashrl INT8 loader: bf16 tensors would be "
                "written into int8 parameters. The model must be built on vllm-ascend's "
                "W8A8_DYNAMIC layers while npu_flashrl is active in the vLLM worker (vLLM "
                "general plugin loaded, FLASHRL_CONFIG set there)")
    return None


def _drain(worker: Any, use_shm: bool) -> None:
    """Acknowledge every bucket of this sync without loading any, so the sender finishes and the
    RPC's error reaches the trainer instead of a hang."""
    from verl.workers.rollout.vllm_rollout.bucketed_weight_transfer import BucketedWeightReceiver

    receiver = BucketedWeightReceiver(zmq_handle=worker._get_zmq_handle(), device=_device(worker),
                                      use_shm=use_shm)
    receiver.receive_weights(on_bucket_received=lambda weights, is_last: None)


def _device(worker: Any):
    import torch

    device = getattr(worker, "device", None)
    if device is None:
        from verl.utils.device import get_device_name

        device = torch.device(f"{get_device_name()}:{worker.local_rank}")
    return device


def _wrap_update(original):
    def update_weights_from_ipc(self, peft_config: dict = None, base_sync_done=False,
                                use_shm: bool = False, **kwargs):
        def update():
            return original(self, peft_config=peft_config, base_sync_done=base_sync_done,
                            use_shm=use_shm, **kwargs)

        if sync_end.lora_adapter_sync({"peft_config": peft_config, "base_sync_done": base_sync_done}):
            return update()
        problem = sync_problem(self)
        if problem is not None:
            _drain(self, use_shm)
            raise ServerModeError(f"npu_flashrl: weight sync refused: {problem}")
        # verl's post-bucket process_weights_after_loading runs inside (a no-op on processed
        # W8A8 layers); then a fused layer still missing shards is an error naming them.
        return sync_end.run_and_end(update, sync_end.int8_models(_models(self)))

    update_weights_from_ipc.__doc__ = original.__doc__
    update_weights_from_ipc.__wrapped__ = original
    return update_weights_from_ipc


def _without_frames(exc: BaseException) -> BaseException:
    seen = set()
    e = exc
    while e is not None and id(e) not in seen:
        seen.add(id(e))
        e.__traceback__ = None
        e = e.__cause__ or e.__context__
    return exc


def _wrap_receive(original):
    def receive_weights(self, on_bucket_received):
        failure = []

        def guarded(weights, is_last):
            if failure:
                return  # acknowledged, not loaded: nothing after a failed bucket is written
            try:
                on_bucket_received(weights, is_last)
            except Exception as exc:  # noqa: BLE001 - re-raised after the last bucket
                # Formatted here, never kept: the traceback's frames hold the bucket's tensors,
                # views of the shared buffer, and a kept view makes verl's receiver fail to close
                # it (BufferError). A log record with exc_info could be kept by a handler.
                logger.error("npu_flashrl: bucket failed; draining the rest of the sync so the "
                             "trainer sees the error:\n%s", "".join(traceback.format_exception(exc)))
                failure.append(_without_frames(exc))

        original(self, guarded)
        if failure:
            raise failure[0]

    receive_weights.__doc__ = original.__doc__
    receive_weights.__wrapped__ = original
    return receive_weights


@patches.register(PATCH_SYNC, UPDATE_TARGET, VERSIONS,
                  "refuse syncs into a model without the INT8 loader; end every sync after the "
                  "last bucket (missing shards named)", required=True)
def _apply_sync() -> None:
    patches.replace(UPDATE_TARGET, _wrap_update)


@patches.register(PATCH_DRAIN, RECEIVE_TARGET, VERSIONS,
                  "a failed bucket fails the sync after the last bucket instead of hanging the sender")
def _apply_drain() -> None:
    patches.replace(RECEIVE_TARGET, _wrap_receive)


def install() -> dict:
    """Apply this module's patches (idempotent). The vLLM plugin does it in every vLLM process."""
    return patches.apply_patches(list(PATCHES))
