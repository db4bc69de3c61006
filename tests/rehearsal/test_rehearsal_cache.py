"""A corrupt entry of the rehearsal's tiny-model cache is refused naming the cache entry and how to
rebuild it (it was reported as a bad shard of the user's model, with no word of the cache).
No stand-ins: `ensure_tiny_model` on a cache directory written here (no training runs: a hit)."""
import json
import os

import pytest
import torch

from npu_flashrl.rehearsal.common import RehearsalError
from npu_flashrl.rehearsal.model import ensure_tiny_model, settings_hash

SETTINGS = {"model": {"hidden_size": 8}, "train": {"seed": 0}}


def _entry(root, meta="{}", truncate=None):
    from safetensors.torch import save_file

    entry = root / settings_hash(SETTINGS)
    for sub in ("bf16", "master"):
        (entry / sub).mkdir(parents=True)
        save_file({"w": torch.zeros(4, 4)}, str(entry / sub / "model.safetensors"))
    if truncate:
        path = entry / truncate / "model.safetensors"
        path.write_bytes(path.read_bytes()[:40])
    (entry / "meta.json").write_text(meta)
    return str(entry)


def test_a_sound_entry_is_a_hit(tmp_path):
    entry = _entry(tmp_path, meta=json.dumps({"train_result": {"loss": 1.0}}))
    hit = ensure_tiny_model(str(tmp_path), SETTINGS, task=None, progress=False)
    assert hit["cache_hit"] is True and hit["dir"] == entry and hit["train"] == {"loss": 1.0}


@pytest.mark.parametrize("meta,truncate,needle", [("{}", "bf16", "is corrupt"), ("{}", "master", "is corrupt"),
                                                  ("{\"train", None, "meta.json unreadable"),
                                                  ("[]", None, "meta.json unreadable")])
def test_a_corrupt_entry_names_the_cache(tmp_path, meta, truncate, needle):
    entry = _entry(tmp_path, meta=meta, truncate=truncate)
    with pytest.raises(RehearsalError) as info:
        ensure_tiny_model(str(tmp_path), SETTINGS, task=None, progress=False)
    text = str(info.value)
    assert f"rehearsal cache entry {entry}" in text and needle in text and f"delete {entry}" in text, text
    if truncate:
        assert os.path.join(entry, truncate) in text
