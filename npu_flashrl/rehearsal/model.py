"""The rehearsal's model: the built-in tiny model (Qwen2, Llama or DeepSeek-V3; pre-trained once,
cached) or a local --model (a dense Qwen2/Llama-style decoder, or a Qwen3-MoE)."""
from __future__ import annotations

import hashlib
import json
import os
from typing import Any, Dict, Optional

from npu_flashrl.rehearsal.common import (MOE_ARCHITECTURES, MOE_CONFIG_KEYS, RECIPE_VERSION, SUPPORTED_ARCHITECTURES,
                                          TINY_TRAIN, RehearsalError, progress_bar)


def check_model_dir(path: str) -> Dict[str, Any]:
    """A usable local checkpoint for the rehearsal, or RehearsalError naming the dir and the problem."""
    if not os.path.isdir(path):
        raise RehearsalError(f"--model {path}: no such directory")
    cfg_path = os.path.join(path, "config.json")
    if not os.path.exists(cfg_path):
        raise RehearsalError(f"--model {path}: no config.json (expected a Hugging Face checkpoint dir)")
    try:
        with open(cfg_path) as f:
            cfg = json.load(f)
    except (OSError, json.JSONDecodeError) as exc:
        raise RehearsalError(f"--model {path}: config.json is not readable JSON ({exc})") from None
    if not any(n.endswith(".safetensors") for n in os.listdir(path)):
        raise RehearsalError(f"--model {path}: no *.safetensors files (a safetensors checkpoint is needed)")
    archs = cfg.get("architectures") or []
    moe = any(k in cfg for k in MOE_CONFIG_KEYS)
    if moe:
        if not any(a in MOE_ARCHITECTURES for a in archs):
            raise RehearsalError(f"--model {path}: a mixture-of-experts model ({archs or 'no architectures'}); "
                                 f"the MoE rehearsal supports {', '.join(MOE_ARCHITECTURES)}")
        if cfg.get("shared_expert_intermediate_size"):
            raise RehearsalError(f"--model {path}: shared experts (shared_expert_intermediate_size) are not "
                                 "covered by the rehearsal's MoE state check")
    elif not any(a in SUPPORTED_ARCHITECTURES for a in archs):
        raise RehearsalError(f"--model {path}: architectures {archs or '(none)'} is not a Qwen2-like dense "
                             f"decoder; supported: {', '.join(SUPPORTED_ARCHITECTURES)} (mixture of experts: "
                             f"{', '.join(MOE_ARCHITECTURES)})")
    if cfg.get("quantization_config") or cfg.get("compression_config"):
        raise RehearsalError(f"--model {path}: already quantized (quantization_config in config.json); "
                             "pass the bf16 checkpoint (and --w8a8 DIR for --mode profile)")
    # every shard's header, before anything is built from it (after config.json's refusals, which
    # name the more useful reason)
    from npu_flashrl.checkpoint import checkpoint_problem

    problem = checkpoint_problem(path)
    if problem:
        raise RehearsalError(f"--model {path}: {problem}")
    return cfg


def is_moe(cfg) -> bool:
    return bool(cfg) and any(k in cfg for k in MOE_CONFIG_KEYS)


def tiny_model_config(args) -> Optional[Dict[str, Any]]:
    """The built-in tiny model's config.json keys when the run's checks need them (a MoE tiny
    model: top-k, routing), else None (the dense tiny models need none)."""
    if getattr(args, "arch", "qwen2") != "deepseek_v3":
        return None
    from npu_flashrl.sim.tiny_models import TINY_DEEPSEEK_V3

    return dict(TINY_DEEPSEEK_V3, architectures=["DeepseekV3ForCausalLM"], model_type="deepseek_v3")


def tiny_settings(args, task) -> Dict[str, Any]:
    from npu_flashrl.sim.tiny_models import TINY_DEEPSEEK_V3, TINY_LLAMA, TINY_QWEN2

    arch = getattr(args, "arch", "qwen2")
    # llama: the 8B / 70B layout (untied). Tied embeddings (the 1B / 3B sizes) hold the shared
    # weight in fp32 under FLASHRL_LMHEAD_FP32 (patch vllm_lmhead_fp32_tied,
    # tests/adapters/test_lm_head_fp32_tied.py); the rehearsal's check names the tie
    model_cfg = {"llama": dict(TINY_LLAMA, tie_word_embeddings=False),
                 "deepseek_v3": dict(TINY_DEEPSEEK_V3)}.get(arch, dict(TINY_QWEN2))
    settings = {"recipe": RECIPE_VERSION, "model": model_cfg,
                "task": task.to_dict(), "train": dict(TINY_TRAIN, iters=args.train_iters, seed=args.seed)}
    if arch != "qwen2":  # the default's cache key stays what it was
        settings["arch"] = arch
    return settings


def settings_hash(settings: Dict[str, Any]) -> str:
    return hashlib.sha256(json.dumps(settings, sort_keys=True).encode()).hexdigest()[:16]


def cached_entry(entry_dir: str) -> Dict[str, Any]:
    """The meta.json of a complete rehearsal cache entry, its checkpoints' headers checked; a corrupt
    entry (a truncated shard, an unreadable meta.json: a run killed while copying, a full disk) is
    refused naming the cache entry and how to rebuild it, not as a bad model of the user's."""
    from npu_flashrl.checkpoint import checkpoint_problem

    fix = f"delete {entry_dir} (the next rehearse trains it again) or pass another --cache-dir"
    try:
        with open(os.path.join(entry_dir, "meta.json"), encoding="utf-8") as f:
            meta = json.load(f)
        if not isinstance(meta, dict):
            raise ValueError(f"expected a JSON object, got {type(meta).__name__}")
    except (OSError, UnicodeDecodeError, ValueError) as exc:
        raise RehearsalError(f"rehearsal cache entry {entry_dir}: meta.json unreadable ({exc}); {fix}") from None
    for sub in ("bf16", "master"):
        problem = checkpoint_problem(os.path.join(entry_dir, sub))
        if problem:
            raise RehearsalError(f"rehearsal cache entry {entry_dir} is corrupt: {problem}; {fix}")
    return meta


def ensure_tiny_model(cache_root: str, settings: Dict[str, Any], task, progress: bool) -> Dict[str, Any]:
    """The pre-trained tiny model in `cache_root/<hash>` ({bf16,master}/ + meta.json); trains on a miss."""
    import shutil

    import torch
    from transformers import Qwen2ForCausalLM

    from npu_flashrl.sim import synthetic_task
    from npu_flashrl.sim.tiny_models import save_tiny_tokenizer, tiny_qwen2_config

    key = settings_hash(settings)
    final = os.path.join(cache_root, key)
    meta_path = os.path.join(final, "meta.json")
    if os.path.exists(meta_path):
        meta = cached_entry(final)
        return {"dir": final, "bf16_dir": os.path.join(final, "bf16"), "master_dir": os.path.join(final, "master"),
                "cache_hit": True, "key": key, "train": meta.get("train_result"), "train_s": 0.0}

    os.makedirs(cache_root, exist_ok=True)
    tmp = os.path.join(cache_root, f".{key}.tmp-{os.getpid()}")
    shutil.rmtree(tmp, ignore_errors=True)
    train = settings["train"]
    torch.manual_seed(train["seed"])
    if settings.get("arch") == "llama":
        from transformers import LlamaForCausalLM

        from npu_flashrl.sim.tiny_models import tiny_llama_config

        model = LlamaForCausalLM(tiny_llama_config(**settings["model"])).float()
    elif settings.get("arch") == "deepseek_v3":
        from transformers import DeepseekV3ForCausalLM

        from npu_flashrl.sim.tiny_models import tiny_deepseek_v3_config

        model = DeepseekV3ForCausalLM(tiny_deepseek_v3_config(**settings["model"])).float()
    else:
        model = Qwen2ForCausalLM(tiny_qwen2_config(**settings["model"])).float()
    bar = progress_bar(train["iters"], f"pre-train tiny {type(model).__name__[:-len('ForCausalLM')]}", progress)

    def cb(i, loss):
        bar.update(1)
        if i % 10 == 0:
            bar.set_postfix_str(f"loss {loss:.3f} (entropy {task.entropy:.3f})")

    try:
        result = synthetic_task.train(model, task, iters=train["iters"], lr=train["lr"], batch=train["batch"],
                                      length=train["length"], seed=train["seed"], callback=cb)
    finally:
        bar.close()
    model.config.torch_dtype = torch.float32
    model.save_pretrained(os.path.join(tmp, "master"), safe_serialization=True)
    bf16 = model.to(torch.bfloat16)
    bf16.config.torch_dtype = torch.bfloat16
    bf16.save_pretrained(os.path.join(tmp, "bf16"), safe_serialization=True)
    save_tiny_tokenizer(os.path.join(tmp, "bf16"), bf16.config.vocab_size)
    from npu_flashrl.config import atomic_write

    atomic_write(os.path.join(tmp, "meta.json"),
                 lambda f: json.dump({"settings": settings, "train_result": result}, f, indent=2))
    try:
        os.rename(tmp, final)
    except OSError:  # another process finished first: use its copy
        shutil.rmtree(tmp, ignore_errors=True)
        if not os.path.exists(meta_path):
            raise
    return {"dir": final, "bf16_dir": os.path.join(final, "bf16"), "master_dir": os.path.join(final, "master"),
            "cache_hit": False, "key": key, "train": result, "train_s": result["seconds"]}
