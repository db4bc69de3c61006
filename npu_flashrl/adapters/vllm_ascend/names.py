"""The trainer's (HF) weight names as the rollout model's own loader reads them: vLLM's
`hf_to_vllm_mapper` of multimodal models, honoured by the INT8 loader.

A vision-language model in vLLM keeps its language model under another prefix than the HF
checkpoint and the trainer's state dict: the current line's vLLM Qwen2.5-VL and Qwen3-VL hold
`language_model.model.layers.*`, `language_model.lm_head` and `visual.*`, while transformers 5
names them `model.language_model.layers.*`, `lm_head` and `model.visual.*` in memory (what an FSDP
trainer sends) and the checkpoints on disk use the pre-4.52 names `model.layers.*` / `visual.*`.
vLLM's own `load_weights` maps them with the model class's `hf_to_vllm_mapper` (a `WeightsMapper`);
the INT8 loader finds its quantized layers and float parameters by the model's names, so it maps
each incoming name the same way first (the cold load from disk and every sync), then hands the
mapped names on: the mappers of these models map a mapped name to itself (checked once per name
here, or the name is refused), so vLLM's loader reads them as they are.

Models without a mapper (the causal LMs) keep their names untouched.

The vision tower and its merger stay 16-bit (`VISION_TOWER_PREFIXES`, read by the in-memory quant
description): the published W8A8 Qwen2.5-VL checkpoints vLLM loads (compressed-tensors, e.g.
RedHatAI's) list every `model.visual.*` module under `ignore`, and ModelSlim's VLM table
(msmodelslim `example/multimodal_vlm/README.md`) names Qwen2.5-VL W8A8 (static) and Qwen3-VL W8A8
as deployable on vllm-ascend without saying the vision tower is quantized (not verified on
hardware). The vision tower is small next to the language model and
runs once per image, so 16-bit costs little there.
"""
from __future__ import annotations

from typing import Callable, Iterable, Optional, Tuple

import torch

from npu_flashrl.quant import WeightSyncError

Weights = Iterable[Tuple[str, torch.Tensor]]

# Module names of a VL model's vision tower (and merger / deepstack mergers), in the checkpoint's
# pre-4.52 names, the trainer's and vLLM's: kept 16-bit.
VISION_TOWER_PREFIXES = ("visual.", "model.visual.")


def in_vision_tower(module: str) -> bool:
    return module.startswith(VISION_TOWER_PREFIXES)


def name_mapper(model: torch.nn.Module) -> Optional[Callable[[str], Optional[str]]]:
    """`name -> the model's own name` (None: a name vLLM drops) from the model's
    `hf_to_vllm_mapper`, or None when the model has none."""
    mapper = getattr(type(model), "hf_to_vllm_mapper", None) or getattr(model, "hf_to_vllm_mapper", None)
    map_name = getattr(mapper, "_map_name", None)
    if map_name is None:
        return None

    def to_model(name: str) -> Optional[str]:
        if not isinstance(name, str):
            return name  # the validator refuses it, naming what it got
        out = map_name(name)
        if out is not None and out != name and map_name(out) != out:
            raise WeightSyncError(
                f"{name}: {type(model).__name__}'s hf_to_vllm_mapper maps it to {out}, and that "
                f"again to {map_name(out)}: the INT8 loader cannot hand vLLM's loader a name it "
                "reads as it is")
        return out

    return to_model


def to_model_names(model: torch.nn.Module, weights):
    """`weights` ((name, tensor) pairs: a list, tuple, dict or stream) with every name mapped to
    the model's own; names vLLM drops are dropped. A list / tuple / dict stays a list (checked whole
    by the loader before anything is written); a stream stays a stream."""
    to_model = name_mapper(model)
    if to_model is None:
        return weights
    if isinstance(weights, dict):
        weights = list(weights.items())
    if isinstance(weights, (list, tuple)):
        out = []
        for item in weights:
            if isinstance(item, (list, tuple)) and len(item) == 2:
                name = to_model(item[0])
                if name is not None:
                    out.append((name, item[1]))
            else:
                out.append(item)  # the validator refuses it, naming it
        return out
    return _stream(to_model, weights)


def _stream(to_model, weights):
    for item in weights:
        if isinstance(item, (list, tuple)) and len(item) == 2:
            name = to_model(item[0])
            if name is None:
                continue
            yield name, item[1]
        else:
            yield item
