"""An image prompt through a vision-language rollout model on the CPU harness (Qwen2.5-VL /
Qwen3-VL in vLLM): the model's own vision tower, multimodal embedding merge, M-RoPE positions and
language model, as vLLM's model runner calls them for one prefill.

Stand-ins: the image processor's output (random pixel patches of the shape vLLM's model takes:
`[t*h*w, channels * temporal_patch * patch * patch]` and `image_grid_thw`), the request's
multimodal feature record (`PlaceholderRange` at the image tokens, the grid), vLLM's attention
(`cpu_vllm.use_plain_attention`; the vision tower's own attention runs as vLLM picks it on the CPU).
"""
from __future__ import annotations

import types
from typing import Dict, Tuple

import torch


def image_inputs(hf_config, grid: Tuple[int, int, int] = (1, 4, 4), seed: int = 0) -> Dict[str, torch.Tensor]:
    """One image's processor output for `hf_config` (a VL model's config): pixel patches and
    their grid (t, h, w in patches; h and w multiples of the spatial merge size)."""
    vc = hf_config.vision_config
    t, h, w = grid
    width = vc.in_channels * vc.temporal_patch_size * vc.patch_size * vc.patch_size
    g = torch.Generator().manual_seed(seed)
    return {"pixel_values": torch.randn(t * h * w, width, generator=g),
            "image_grid_thw": torch.tensor([[t, h, w]])}


def image_tokens(hf_config, image: Dict[str, torch.Tensor]) -> int:
    """How many image placeholder tokens the image takes in the prompt."""
    merge = hf_config.vision_config.spatial_merge_size
    return int(image["image_grid_thw"].prod().item()) // (merge * merge)


def prompt(hf_config, image, text_before: int = 3, text_after: int = 4, seed: int = 0) -> torch.Tensor:
    """Token ids: some text, the vision start token, the image's placeholders, the end token,
    more text (text ids below the special tokens)."""
    g = torch.Generator().manual_seed(seed)
    low = min(hf_config.image_token_id, hf_config.vision_start_token_id, hf_config.vision_end_token_id)
    text = lambda n: torch.randint(0, low, (n,), generator=g)  # noqa: E731
    n = image_tokens(hf_config, image)
    return torch.cat([text(text_before), torch.tensor([hf_config.vision_start_token_id]),
                      torch.full((n,), hf_config.image_token_id), torch.tensor([hf_config.vision_end_token_id]),
                      text(text_after)])


def _feature(ids: torch.Tensor, hf_config, image):
    from vllm.multimodal.inputs import PlaceholderRange

    where = (ids == hf_config.image_token_id).nonzero().flatten()
    grid = types.SimpleNamespace(data=image["image_grid_thw"][0])
    return types.SimpleNamespace(modality="image", mm_position=PlaceholderRange(int(where[0]), len(where)),
                                 data={"image_grid_thw": grid}, identifier="image0")


@torch.no_grad()
def logits(cv, ids: torch.Tensor, image: Dict[str, torch.Tensor]) -> torch.Tensor:
    """Logits [T, V] of one prefill of `ids` (with `image`'s placeholders) on `cv`'s model."""
    from npu_flashrl.sim import ascend_harness

    model = cv.model
    hf_config = model.config
    embeds = model.embed_multimodal(pixel_values=image["pixel_values"].to(model.visual.dtype),
                                    image_grid_thw=image["image_grid_thw"])
    is_mm = ids == hf_config.image_token_id
    assert sum(e.shape[0] for e in embeds) == int(is_mm.sum()), "image tokens != image embeddings"
    inputs_embeds = model.embed_input_ids(ids, embeds, is_multimodal=is_mm)
    positions, _ = model.get_mrope_input_positions(ids.tolist(), [_feature(ids, hf_config, image)])
    positions = torch.as_tensor(positions)
    with cv.forward_context(ids.shape[0]):
        hidden = model(input_ids=None, positions=positions, inputs_embeds=inputs_embeds)
    return ascend_harness.compute_logits(model, hidden).float()


def greedy(cv, ids: torch.Tensor, image, steps: int = 4) -> torch.Tensor:
    """A greedy rollout of `steps` tokens after the image prompt (a full prefill per token)."""
    out = ids
    for _ in range(steps):
        nxt = logits(cv, out, image)[-1].argmax()
        out = torch.cat([out, nxt.view(1)])
    return out[ids.shape[0]:]
