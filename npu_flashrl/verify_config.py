"""`npu-flashrl verify`'s rows for the FlashRL config: each entry against its model, its profile
and its checkpoint (the quant description per layer, the W4A8 checkpoint, the architecture's
coverage on the installed line, the tied lm head)."""
from __future__ import annotations

import json
import os
from typing import Dict, List, Optional

from npu_flashrl.verify_table import FAIL, OK, WARN, _row

W8A8_FIX = ("-m must be the compressed-tensors W8A8 checkpoint the profile was made from (e.g. RedHatAI's); "
            "a ModelSlim checkpoint or a bf16 one runs without a profile: --fn int8_profile_free")


def config_rows(config_path: Optional[str]) -> List[Dict[str, str]]:
    from npu_flashrl.config import (ENV_CONFIG, ConfigError, load_config, needs_profile,
                                    unknown_key_problems)
    from npu_flashrl.checkpoint import architecture_mismatch, checkpoint_problem
    from npu_flashrl.profile import ProfileError, check_profile_against_model, load_profile

    source = config_path if config_path else os.environ.get(ENV_CONFIG)
    label = f"config {source}" if source else "config"
    if not source:
        return [_row("config", WARN, f"no --config and {ENV_CONFIG} is not set: npu_flashrl stays inactive",
                     f"npu-flashrl setup ... -o CONFIG; export {ENV_CONFIG}=CONFIG")]
    try:
        cfg = load_config(source)
    except ConfigError as exc:
        return [_row(label, FAIL, str(exc), "fix the file, or rewrite it: npu-flashrl setup ... -o CONFIG")]
    rows = [_row(label, OK, f"{len(cfg.entries)} entr{'y' if len(cfg.entries) == 1 else 'ies'}: "
                 + ", ".join(e.fn for e in cfg.entries))]
    mismatch = architecture_mismatch([(f"configs[{i}]", e.model) for i, e in enumerate(cfg.entries)
                                      if e.model and os.path.isdir(e.model)])
    if mismatch:
        rows.append(_row(label, FAIL, mismatch, "point every entry's `model` at a checkpoint of the same model"))
    rows += architecture_rows(cfg.entries)
    rows += tied_head_rows(cfg.entries)
    for i, entry in enumerate(cfg.entries):
        check = f"configs[{i}] ({entry.fn})"
        for problem in unknown_key_problems(entry, f"configs[{i}]"):
            rows.append(_row(check, FAIL, problem, "fix the key's spelling, or remove it"))
        if entry.model:
            if not os.path.isdir(entry.model):
                rows.append(_row(check, FAIL, f"model {entry.model}: no such dir",
                                 "point `model` at the local checkpoint dir"))
                continue
            try:
                names = os.listdir(entry.model)
            except OSError as exc:
                rows.append(_row(check, FAIL, f"model {entry.model}: cannot list the dir: {exc.strerror or exc}",
                                 "check the permissions of the model dir"))
                continue
            if not any(f.endswith(".safetensors") for f in names):
                rows.append(_row(check, FAIL, f"model {entry.model}: no *.safetensors files",
                                 "use a safetensors HF checkpoint"))
                continue
            problem = checkpoint_problem(entry.model)  # every shard's header, for every fn
            if problem:
                rows.append(_row(check, FAIL, f"model {entry.model}: {problem}",
                                 "re-download or re-convert the checkpoint"))
                continue
            described = description_rows(entry, check)
            rows += described
            if any(r["status"] == FAIL for r in described):
                continue
        if not needs_profile(entry):
            if entry.profile and not os.path.isfile(entry.profile.strip()):  # a missing file named here
                rows.append(_row(check, FAIL, f"profile {entry.profile}: no such file (and fn {entry.fn} "
                                 "uses no profile)", "remove `profile` from the entry"))
                continue
            w4a8 = w4a8_rows(check, entry)
            if w4a8:
                rows += w4a8
                continue
            rows.append(_row(check, OK, f"model {entry.model or '(the rollout model)'}"))
            continue
        fmt = str(entry.load_format).lower() if entry.load_format else None
        if fmt == "dummy":
            rows.append(_row(check, FAIL, f"load_format: {entry.load_format} with fn int8: random "
                             "weight_scale tensors that no weight sync replaces", "load_format: auto"))
            continue
        if fmt is None:
            rows.append(_row(check, WARN, "no load_format: the engine's own is used, and verl's sync "
                             "rollout passes dummy, which is refused at engine build for fn int8",
                             "load_format: auto"))
        if entry.model:
            from npu_flashrl.profile import (MOE_FIX, check_w8a8_checkpoint, corrupt_scale_problems,
                                             moe_profile_problem)

            moe = moe_profile_problem(entry.model)
            if moe:
                rows.append(_row(check, FAIL, moe, MOE_FIX.replace("--fn ", "fn: ", 1)))
                continue
            problems = check_w8a8_checkpoint(entry.model)
            if problems:
                rows.append(_row(check, FAIL, "; ".join(problems), W8A8_FIX.replace("-m", "`model`", 1)))
                continue
            problems = corrupt_scale_problems(entry.model)
            if problems:
                rows.append(_row(check, FAIL, "; ".join(problems), "re-download or re-quantize the W8A8 checkpoint"))
                continue
        path = entry.profile_path()
        if path is None:
            rows.append(_row(check, WARN, "no `profile` and no `model`: profile resolved at run time "
                             "as <rollout model>/profile.pt, not checked", "set `profile` and `model`"))
            continue
        try:
            prof = load_profile(path)
        except ProfileError as exc:
            rows.append(_row(check, FAIL, str(exc), "npu-flashrl profile -m BF16 -q W8A8 -o PROFILE"))
            continue
        if not entry.model:
            rows.append(_row(check, WARN, f"profile {path} readable ({len(prof)} entries); no `model` "
                             "to check it against", "set `model` in the entry"))
            continue
        try:
            offenders = check_profile_against_model(prof, entry.model)
        except ProfileError as exc:
            rows.append(_row(check, FAIL, str(exc), "re-download or re-convert the checkpoint"))
            continue
        if offenders:
            rows.append(_row(check, FAIL, f"profile {path} does not match model {entry.model}: "
                             + "; ".join(offenders),
                             f"make the profile for this model: npu-flashrl profile -m BF16 -q {entry.model} -o {path}"))
        else:
            rows.append(_row(check, OK, f"profile {path} ({len(prof)} entries) matches model {entry.model}"))
    return rows


def description_rows(entry, check: str) -> List[Dict[str, str]]:
    """An INT8 entry's checkpoint quant description per layer / group against the scheme registry
    and its own tensors (`description_check`): FAIL per problem (each names the layer or group),
    WARN for what could not be checked here."""
    from npu_flashrl.adapters.vllm_ascend.description_check import description_problems
    from npu_flashrl.config import FN_BF16

    if entry.fn == FN_BF16:
        return []
    problems, notes = description_problems(entry.model)
    fix = ("re-export the checkpoint with a scheme the INT8 rollout writes, or fix its quant description; "
           "for a fn that takes no profile, a bf16 checkpoint works too")
    rows = [_row(check, FAIL, f"model {entry.model}: {p}", fix) for p in problems]
    # notes under a row of their own (as `architecture of ...`): the entry's own row still says ok
    rows += [_row(f"quant description of {entry.model}", WARN, n,
                  "npu-flashrl verify on a host where vllm-ascend imports" if "scheme table" in n
                  else "add the weight to the description with its quant type") for n in notes]
    return rows


def w4a8_rows(check: str, entry) -> List[Dict[str, str]]:
    """A W4A8 entry's checkpoint (its layers, its group size), as `setup` checks it; [] when the
    entry is not W4A8 or its checkpoint is sound (an OK row saying what a sound mixed ModelSlim
    checkpoint's syncs rewrite with which quantizer)."""
    from npu_flashrl.w4a8_checkpoint import applies, mixed_layout, w4a8_checkpoint_problems

    if not applies(entry) or not entry.model:
        return []
    problems = w4a8_checkpoint_problems(entry.model, entry.group_size)
    if not problems:
        mixed = mixed_layout(entry.model)
        return [_row(check, OK, f"model {entry.model}: {mixed}")] if mixed else []
    more = f" (+{len(problems) - 1} more)" if len(problems) > 1 else ""
    return [_row(check, FAIL, f"model {entry.model}: {problems[0]}{more}",
                 "a bf16 checkpoint with a group_size that divides every projection's input dim, or "
                 "a ModelSlim W4A8_DYNAMIC checkpoint (original layout) exported with that group size")]


def architecture_rows(entries, line=None) -> List[Dict[str, str]]:
    """FAIL for a model whose architecture the stack line (`line`, default the installed one)
    refuses for INT8 rollouts (`StackLine.refused_architectures`); WARN for one the INT8 rollout's
    tests do not (fully) cover (`npu_flashrl.architectures`), saying what was verified instead."""
    from npu_flashrl.architectures import coverage_problem, line_refusal, model_architecture
    from npu_flashrl.config import FN_BF16

    rows = []
    int8 = [e for e in entries if getattr(e, "fn", None) != FN_BF16]
    for model in dict.fromkeys(e.model for e in int8 if e.model and os.path.isdir(e.model)):
        arch = model_architecture(model)  # None: no readable config.json (other rows say so)
        refusal = line_refusal(arch, line) if arch else None
        if refusal:
            rows.append(_row(f"architecture of {model}", FAIL, refusal,
                             "install the current line (scripts/install_pinned.sh --line current), "
                             "or drop the INT8 entry for this model"))
            continue
        problem = coverage_problem(arch) if arch else None
        if problem:
            rows.append(_row(f"architecture of {model}", WARN, problem,
                             "run `npu-flashrl rehearse` on a tiny model of a covered family first"))
    return rows


def tied_head_rows(entries, environ=None) -> List[Dict[str, str]]:
    """With FLASHRL_LMHEAD_FP32=1, what a tied-embedding model's fp32 head costs: the one shared
    embedding / lm-head weight is held in fp32 on the rollout (`adapters.vllm_lm_head`)."""

    from npu_flashrl.config import ConfigError, lmhead_fp32_requested

    try:
        if not lmhead_fp32_requested(environ):
            return []
    except ConfigError:
        return []  # activation_rows says so
    rows = []
    for model in dict.fromkeys(e.model for e in entries if e.model and os.path.isdir(e.model)):
        try:
            with open(os.path.join(model, "config.json")) as f:
                cfg = json.load(f)
        except (OSError, ValueError):
            continue  # the entry's rows say so
        text = cfg.get("text_config") or {}
        if not cfg.get("tie_word_embeddings", text.get("tie_word_embeddings", False)):
            continue
        from npu_flashrl.adapters.vllm_lm_head import tied_head_extra_bytes

        try:
            extra = tied_head_extra_bytes(cfg)
        except (TypeError, ValueError) as exc:
            rows.append(_row(f"FLASHRL_LMHEAD_FP32 ({model})", FAIL,
                             f"config.json: vocab_size / hidden_size unreadable ({exc})",
                             "use the model's own config.json"))
            continue
        rows.append(_row(f"FLASHRL_LMHEAD_FP32 ({model})", OK,
                         f"tied embeddings: the shared embedding / lm-head weight is held in fp32 on the "
                         f"rollout, +{extra / 2 ** 20:.1f} MiB per rank at TP 1 (2 x vocab x hidden bytes, "
                         "divided by the rollout's TP)"))
    return rows
