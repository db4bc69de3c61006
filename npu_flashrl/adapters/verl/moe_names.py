"""The names an FSDP trainer sends for an HF MoE model's experts: per expert, as in the checkpoint.

transformers 5 holds Qwen-style MoE experts fused (`mlp.experts.gate_up_proj` [E, 2I, H],
`mlp.experts.down_proj` [E, H, I]); verl 0.9's FSDP engine expands them before every sync with
its own `verl.workers.engine.fsdp.utils.unfuse_moe_params` (`get_per_tensor_param`), so the rollout
receives `mlp.experts.E.{gate,up,down}_proj.weight`. transformers 4.x (the 0.11 line, verl 0.6)
already has one tensor per expert projection: sent as they are. `sync_names` does what the
trainer does, with verl's own function, for the rehearsal and the tests.
"""
from __future__ import annotations

import importlib
import importlib.util
import os
from typing import Iterable, List, Optional, Tuple

import torch


def has_fused_experts(weights: Iterable[Tuple[str, torch.Tensor]]) -> bool:
    return any(".mlp.experts." in n and t.dim() == 3 for n, t in weights)


def sync_names(weights: Iterable[Tuple[str, torch.Tensor]], model_type: Optional[str] = None
               ) -> List[Tuple[str, torch.Tensor]]:
    """`weights` (HF parameter names, in order) as verl's trainer sends them: fused expert
    tensors expanded per expert by verl's `unfuse_moe_params`; anything else unchanged."""
    weights = list(weights)
    if not has_fused_experts(weights):
        return weights
    return list(unfuse_moe_params()(weights, model_type))


def unfuse_moe_params():
    """verl 0.9's `unfuse_moe_params`. Its package (`verl.workers.engine.fsdp`) imports peft and
    the FSDP engines at module level, which the CPU stack may lack; the function's own file needs
    only torch and verl.utils, so it is then loaded alone, from the installed verl."""
    return _verl_function("verl.workers.engine.fsdp.utils", "unfuse_moe_params",
                          "this model holds fused MoE experts (transformers 5): verl >= 0.9 is needed "
                          "to unfuse them as the trainer does",
                          "verl >= 0.9 unfuses transformers 5's packed MoE experts there")


def moe_weight_loader_patch():
    """verl's `verl.utils.vllm.patch.patch_vllm_moe_model_weight_loader`, which verl runs on a
    MoE rollout model before loading synced weights (sync-mode sharding managers and
    `vllm_rollout_spmd`; server mode's `update_weights_from_ipc` for unquantized models). Its
    package's `__init__` imports vLLM's entrypoints through `verl.third_party.vllm` (on the 0.11
    CPU stack: `partial_json_parser`, absent); the file itself needs only vLLM's model classes."""
    return _verl_function("verl.utils.vllm.patch", "patch_vllm_moe_model_weight_loader",
                          "a MoE rollout model: verl is needed for its MoE weight-loader patch",
                          "verl's MoE weight-loader patch lives there")


def _verl_function(module_name: str, attr: str, need: str, where: str):
    try:
        module = importlib.import_module(module_name)
    except ImportError as exc:
        first = exc
    else:
        return _attr(module, module_name, attr, where)
    try:
        import verl
    except ImportError:
        raise RuntimeError(f"{need} ({first})") from None
    path = os.path.join(os.path.dirname(verl.__file__), *module_name.split(".")[1:]) + ".py"
    if not os.path.exists(path):
        raise RuntimeError(f"{path}: not in the installed verl {getattr(verl, '__version__', '?')} ({where})")
    spec = importlib.util.spec_from_file_location("npu_flashrl_" + module_name.replace(".", "_"), path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return _attr(module, path, attr, where)


def _attr(module, where_found: str, attr: str, where: str):
    fn = getattr(module, attr, None)
    if fn is None:
        import verl

        raise RuntimeError(f"{where_found} of the installed verl {getattr(verl, '__version__', '?')} has no "
                           f"{attr} ({where})")
    return fn
