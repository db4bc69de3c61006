"""The preflight's reading of the FlashRL config a launch names (`FLASHRL_CONFIG`, in the shell or
in Ray's runtime env), through npu_flashrl's own reader (`config.load_config`): a config that every
rollout process would refuse at activation (after Ray, the trainer and the model load are up) is
refused before launch, with the reader's message (it names the file, the entry and the key); a key
the rollout would ignore is a note, as `npu-flashrl verify` reports it.

Only a config file that exists is read (the entry recipes write theirs with `npu-flashrl setup`,
which refuses the same inputs); reading it imports torch (the quantizer registry), so a launch
without a config file costs nothing here.
"""
from __future__ import annotations

import os
from typing import List, Tuple


def problems(checker) -> Tuple[List[str], List[str]]:
    """([the reader's refusal], [one note per ignored key]) of the launch's FlashRL config."""
    path = checker.flashrl_config()
    if not path or not os.path.isfile(path):
        return [], []
    from npu_flashrl.config import ConfigError, load_config, unknown_key_problems

    try:
        cfg = load_config(path)
    except ConfigError as exc:
        return [f"FLASHRL_CONFIG: {exc} (every rollout process would refuse it at activation, after "
                "launch; fix the file, or write it with npu-flashrl setup)"], []
    notes = [f"FLASHRL_CONFIG: {note}" for i, entry in enumerate(cfg.entries)
             for note in unknown_key_problems(entry, f"{path}: configs[{i}]")]
    return [], notes
