"""Setup as a user does it: `npu-flashrl profile` / `setup` (their library functions,
`npu_flashrl.commands`), `npu_flashrl.activate`, then the engine adapter on real EngineArgs."""
from __future__ import annotations

import os
import shutil
import time
from typing import Any, Dict

from npu_flashrl.rehearsal.common import RehearsalError


def _user_step(command: str, fn, *args, **kwargs):
    """`fn(*args, **kwargs)`, its refusal reported as the rehearsal's error naming the user's command."""
    from npu_flashrl.config import ConfigError
    from npu_flashrl.errors import CliError
    from npu_flashrl.profile import ProfileError

    try:
        return fn(*args, **kwargs)
    except (CliError, ConfigError, ProfileError) as exc:
        raise RehearsalError(f"`npu-flashrl {command}` failed: {exc}") from None


def prepare_config(args, bf16_dir: str, work: str, progress: bool) -> Dict[str, Any]:
    """profile (profile mode) and setup, as a user runs them; returns paths and timings."""
    from npu_flashrl import commands

    out: Dict[str, Any] = {"mode": args.mode}
    config_path = os.path.join(work, "flashrl_config.yaml")
    t0 = time.perf_counter()
    if args.mode == "profile":
        w8a8 = args.w8a8
        if w8a8 is None:
            from npu_flashrl.sim.checkpoints import write_w8a8_compressed_tensors

            w8a8 = os.path.join(work, "w8a8")
            shutil.rmtree(w8a8, ignore_errors=True)
            write_w8a8_compressed_tensors(bf16_dir, w8a8)
            out["w8a8_written"] = True
        profile = os.path.join(work, "profile.pt")
        _user_step(f"profile -m {bf16_dir} -q {w8a8} -o {profile}", commands.write_profile, bf16_dir, w8a8,
                   profile, progress=progress)
        _user_step(f"setup -m {w8a8} -p {profile} --fn int8 -o {config_path}", commands.setup, "int8", w8a8,
                   profile, config_path)
        out.update(w8a8_dir=w8a8, profile=profile, fn="int8")
    else:
        _user_step(f"setup -m {bf16_dir} --fn int8_profile_free -o {config_path}", commands.setup,
                   "int8_profile_free", bf16_dir, None, config_path)
        out["fn"] = "int8_profile_free"
    out["config"] = config_path
    out["setup_s"] = time.perf_counter() - t0
    return out


def check_w4a8(args, model_cfg) -> None:
    """--w4a8 with a model the W4A8 rollout cannot serve: refused before anything starts. A
    mixture-of-experts model: Qwen3-MoE-style softmax routing (the W4A8 expert state check's,
    `state_w4a8_moe.py`), and the experts' input sizes (hidden_size for gate/up,
    moe_intermediate_size for down) multiples of the A8W4 grouped matmul's quantGroupSize, which
    is then the group size (`kernels.op_rules_int4`, aclnnGroupedMatmulV4)."""
    from npu_flashrl.kernels.op_rules_int4 import A8W4_QUANT_GROUP
    from npu_flashrl.rehearsal.model import is_moe

    if not getattr(args, "w4a8", False) or not is_moe(model_cfg):
        return
    what = f"--model {args.model}" if getattr(args, "model", None) is not None else f"--arch {args.arch}"
    if model_cfg.get("scoring_func") == "sigmoid" or model_cfg.get("kv_lora_rank") \
            or not model_cfg.get("moe_intermediate_size"):
        raise RehearsalError(f"--w4a8 with {what}: a mixture-of-experts model the W4A8 MoE rehearsal does not "
                             "cover (it covers Qwen3-MoE-style experts: softmax routing, no MLA); drop --w4a8 "
                             "(the INT8 rehearsal covers this model)")
    # every projection: fn w4a8_profile_free types them all W4A8_DYNAMIC with one group size
    bad = {k: v for k, v in w4a8_input_sizes(model_cfg).items() if v % A8W4_QUANT_GROUP}
    if bad:
        raise RehearsalError(
            f"--w4a8 with {what}: vllm-ascend's W4A8_DYNAMIC fused-MoE layers run the A8W4 grouped matmul, "
            f"whose K must be a multiple of quantGroupSize {A8W4_QUANT_GROUP} (aclnnGroupedMatmulV4), and the "
            f"W4A8 rollout quantizes every projection with that group size; "
            + ", ".join(f"{k} {v}" for k, v in bad.items()) + " is not a multiple. Drop --w4a8")
    g = getattr(args, "group_size", None)
    if g is not None and g != A8W4_QUANT_GROUP:
        raise RehearsalError(f"--group-size {g} with a mixture-of-experts model: the A8W4 grouped matmul of "
                             f"its W4A8 experts takes quantGroupSize {A8W4_QUANT_GROUP} only; drop --group-size "
                             f"or set it to {A8W4_QUANT_GROUP}")


def check_w4a8_line(model_cfg=None) -> None:
    """--w4a8 on a line whose vllm-ascend has no W4A8_DYNAMIC linear method, or (a MoE model) whose
    W4A8_DYNAMIC fused-MoE layers npu_flashrl does not reload (the line's `w4a8_moe_cast`); asked
    once the torch_npu emulation is in place: the line's table imports vllm-ascend's quantization."""
    from npu_flashrl import lines
    from npu_flashrl.rehearsal.model import is_moe

    line = lines.current()
    if line.method_class("W4A8_DYNAMIC", "linear") is None:
        raise RehearsalError(f"--w4a8: vllm-ascend {line.vllm_ascend} has no W4A8_DYNAMIC linear method")
    if is_moe(model_cfg) and (line.method_class("W4A8_DYNAMIC", "moe") is None or line.w4a8_moe_cast is None):
        raise RehearsalError(f"--w4a8 with a mixture-of-experts model: vllm-ascend {line.vllm_ascend}'s "
                             "W4A8_DYNAMIC fused-MoE layers are not reloaded by npu_flashrl on this line "
                             "(docs/w4a8.md, Fused MoE); drop --w4a8, or use a line that reloads them")


W4A8_MAX_GROUP = 256  # vllm-ascend's default group_size (when the description has none)


def w4a8_input_sizes(model_cfg) -> Dict[str, int]:
    """The input sizes of the projections a W4A8 rollout quantizes, from config.json's keys."""
    cfg = dict(model_cfg.get("text_config") or model_cfg) if isinstance(model_cfg.get("text_config"), dict) \
        else model_cfg
    hidden, heads = int(cfg["hidden_size"]), int(cfg["num_attention_heads"])
    head_dim = int(cfg.get("head_dim") or hidden // heads)
    sizes = {"q/k/v_proj, gate/up_proj (hidden_size)": hidden, "o_proj (num_attention_heads x head_dim)":
             heads * head_dim}
    if cfg.get("moe_intermediate_size"):  # Qwen3-MoE: the experts' down_proj
        sizes["experts' down_proj (moe_intermediate_size)"] = int(cfg["moe_intermediate_size"])
    if _has_dense_mlp(cfg):
        sizes["down_proj (intermediate_size)"] = int(cfg["intermediate_size"])
    return sizes


def _has_dense_mlp(cfg) -> bool:
    """A dense MLP in some decoder layer: every layer of a dense model; a Qwen3-MoE's layers in
    `mlp_only_layers` or off its `decoder_sparse_step` (vLLM's Qwen3MoeDecoderLayer's rule)."""
    if not cfg.get("moe_intermediate_size"):
        return True
    step = int(cfg.get("decoder_sparse_step") or 1)
    only = set(cfg.get("mlp_only_layers") or ())
    return any(i in only or (i + 1) % step != 0 for i in range(int(cfg["num_hidden_layers"])))


def w4a8_group_size(model_cfg, requested=None) -> int:
    """--group-size, checked against every projection's input size; default the largest power of two
    <= 256 (vllm-ascend's default) that divides them all."""
    sizes = w4a8_input_sizes(model_cfg)
    if requested is not None:
        bad = {k: v for k, v in sizes.items() if v % requested}
        if bad:
            raise RehearsalError(f"--group-size {requested}: must divide every W4A8 projection's input size; "
                                 + ", ".join(f"{k} {v}" for k, v in bad.items()) + " does not")
        return requested
    g = W4A8_MAX_GROUP
    while g > 1 and any(v % g for v in sizes.values()):
        g //= 2
    return g


def prepare_w4a8(bf16_dir: str, work: str, group_size: int) -> Dict[str, Any]:
    """The W4A8 rollout's config, as a user sets it up: `npu-flashrl setup --fn w4a8_profile_free
    -m <the bf16 checkpoint> group_size=N`. The engine then gets an in-memory ModelSlim-format
    description typing the projections W4A8_DYNAMIC with that group size, and the cold load
    quantizes them (`W4A8DynamicLinear.checkpoint_items`). Returns the model dir, the config path,
    the fn and the group size."""
    from npu_flashrl import commands
    from npu_flashrl.rehearsal.precisions import FN_W4A8

    config_path = os.path.join(work, "flashrl_config_w4a8.yaml")
    _user_step(f"setup -m {bf16_dir} --fn {FN_W4A8} -o {config_path} group_size={group_size}", commands.setup,
               FN_W4A8, bf16_dir, None, config_path, force=True, columns=[f"group_size={group_size}"])
    return {"model": bf16_dir, "config": config_path, "fn": FN_W4A8, "group_size": group_size}


def activate_entry(config_path: str, bf16_dir: str):
    """npu_flashrl.activate(config) + the engine adapter applying the entry to real EngineArgs."""
    from vllm.engine.arg_utils import EngineArgs

    import npu_flashrl
    from npu_flashrl.adapters import vllm_engine
    from npu_flashrl.config import EXTERNAL_LAUNCHER, load_config

    applied = npu_flashrl.activate(config_path)
    failed = [n for n, ok in (applied or {}).items() if not ok]
    engine_args = EngineArgs(model=bf16_dir, distributed_executor_backend=EXTERNAL_LAUNCHER)
    entry = vllm_engine.apply_entry(engine_args, load_config(config_path))
    return engine_args, entry, applied, failed
