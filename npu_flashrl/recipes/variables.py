"""Every tunable of the verl recipes (tests/verl_examples), declared once: its type, its range or
choices, the recipes that read it and the Hydra key it becomes. `check_variables` reads them from
an environment and returns the problems (one message style: the variable, the value as given, what
is expected) and the normalised values the recipe continues with (booleans as Hydra's True/False,
derived defaults such as PPO_MAX_TOKEN_LEN), so that the shell does no arithmetic on raw input.

Recipe features (`uses`): "all" (every launch script), "entry" (the flash_rl/ entry scripts, before
`npu-flashrl profile/setup`), "fsdp", "megatron", "moe", "async" (a separate rollout pool through
verl's experimental trainers), "current" / "pinned" (one stack line only), "any" (every feature:
the entry scripts check what their config script will read).
"""
from __future__ import annotations

import dataclasses
import re
from typing import Dict, FrozenSet, Iterable, List, Mapping, Optional, Tuple

from npu_flashrl.lines import verl as verl_lines

INT_MAX = 999_999_999  # large enough for any token count; keeps every product below 2**63
NPU_MAX = 65_536
_INT = re.compile(r"-?(0|[1-9][0-9]*)")
_FLOAT = re.compile(r"([0-9]+\.?[0-9]*|\.[0-9]+)([eE][-+]?[0-9]+)?")
BOOL_TRUE = ("1", "true", "yes", "on")
BOOL_FALSE = ("0", "false", "no", "off")
# verl's kl_penalty names (core_algos.kl_penalty_forward); a trailing '+' is its straight-through form
KL_TYPES = ("kl", "k1", "abs", "mse", "k2", "low_var_kl", "k3", "full")


@dataclasses.dataclass(frozen=True)
class Var:
    name: str
    kind: str  # int | float | bool | enum | str
    uses: FrozenSet[str] = frozenset({"all"})
    lo: Optional[float] = None  # int / float: inclusive bounds (float lo is exclusive when lo_open)
    hi: Optional[float] = None
    lo_open: bool = False
    choices: Tuple[str, ...] = ()
    key: str = ""  # the Hydra key the recipe writes it to (named in relation messages)
    spellings: str = "True or False (or 1/0)"  # what a bool accepts, as said in messages

    def expected(self) -> str:
        if self.kind == "int":
            return f"an integer >= {int(self.lo)} and <= {int(self.hi)}"
        if self.kind == "float":
            low = f"> {self.lo:g}" if self.lo_open else f">= {self.lo:g}"
            high = f" and <= {self.hi:g}" if self.hi is not None else ""
            return f"a number {low}{high} (e.g. 0.3 or 5e-8)"
        if self.kind == "bool":
            return self.spellings
        if self.kind == "enum":
            return "one of " + ", ".join(self.choices)
        return "a value"


def _v(name, kind, uses=("all",), **kw) -> Var:
    if kind == "int":
        kw.setdefault("lo", 1)
        kw.setdefault("hi", INT_MAX)
    return Var(name, kind, frozenset(uses), **kw)


RO = "actor_rollout_ref.rollout."
MEG = "actor_rollout_ref.actor.megatron."
VARIABLES: Tuple[Var, ...] = (
    # --- the launch scripts (configs/*.sh), every trainer
    _v("RECIPE_LINE", "enum", choices=("pinned", "current")),
    _v("ROLLOUT_PRECISION", "enum", choices=("int8", "bf16")),
    _v("DATASET", "enum", ("all", "entry"), choices=("gsm8k", "dapo", "geo3k")),
    _v("NNODES", "int", hi=NPU_MAX, key="trainer.nnodes"),
    _v("NPUS_PER_NODE", "int", hi=NPU_MAX, key="trainer.n_gpus_per_node"),
    _v("MAX_PROMPT_LENGTH", "int", key="data.max_prompt_length"),
    _v("MAX_RESPONSE_LENGTH", "int", key="data.max_response_length"),
    _v("TRAIN_BATCH_SIZE", "int", key="data.train_batch_size"),
    _v("PPO_MINI_BATCH_SIZE", "int", key="actor_rollout_ref.actor.ppo_mini_batch_size"),
    _v("ROLLOUT_N", "int", key=RO + "n"),
    _v("PPO_MAX_TOKEN_LEN", "int", key="actor_rollout_ref.actor.ppo_max_token_len_per_gpu"),
    _v("ROLLOUT_TP", "int", hi=NPU_MAX, key=RO + "tensor_model_parallel_size"),
    _v("MICRO_BATCH_PER_NPU", "int", key="actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu"),
    _v("TOTAL_EPOCHS", "int", key="trainer.total_epochs"),
    _v("SAVE_FREQ", "int", lo=-1, key="trainer.save_freq"),
    _v("TEST_FREQ", "int", lo=-1, key="trainer.test_freq"),
    _v("HCCL_CONNECT_TIMEOUT", "int"),
    _v("HCCL_EXEC_TIMEOUT", "int"),
    _v("LR", "float", lo=0, key="actor_rollout_ref.actor.optim.lr"),
    _v("KL_LOSS_COEF", "float", lo=0, key="actor_rollout_ref.actor.kl_loss_coef"),
    _v("KL_LOSS_TYPE", "enum", choices=KL_TYPES + tuple(k + "+" for k in KL_TYPES),
       key="actor_rollout_ref.actor.kl_loss_type"),
    _v("GPU_MEMORY_UTILIZATION", "float", lo=0, hi=1, lo_open=True, key=RO + "gpu_memory_utilization"),
    _v("TIS_LEVEL", "enum", choices=("null", "token", "sequence"), key="algorithm.rollout_correction.rollout_is"),
    _v("TIS_THRESHOLD", "float", lo=0, hi=1e300, lo_open=True,
       key="algorithm.rollout_correction.rollout_is_threshold"),
    _v("TIS_BATCH_NORMALIZE", "bool", key="algorithm.rollout_correction.rollout_is_batch_normalize"),
    _v("TIS_BYPASS_MODE", "bool", key="algorithm.rollout_correction.bypass_mode"),
    _v("TIS_USE_POLICY_GRADIENT", "bool", ("pinned",), key="algorithm.rollout_correction.use_policy_gradient"),
    _v("USE_DYNAMIC_BSZ", "bool", key="actor_rollout_ref.actor.use_dynamic_bsz"),
    _v("ENFORCE_EAGER", "bool", key=RO + "enforce_eager"),
    _v("REF_PARAM_OFFLOAD", "bool"),
    _v("UPDATE_WEIGHTS_BUCKET_MB", "int", ("current",), hi=1_048_576,
       key=RO + "checkpoint_engine.update_weights_bucket_megabytes"),
    _v("FLASHRL_LMHEAD_FP32", "bool", ("all", "entry"), spellings="1 or 0 (also true/false, yes/no, on/off)"),
    # --- the entry scripts (flash_rl/*.sh)
    _v("FLASHRL_FN", "enum", ("entry",), choices=("int8", "int8_profile_free", "bf16")),
    _v("BASELINE_NPU_FLASHRL", "bool", ("entry",)),
    # --- FSDP
    _v("ACTOR_PARAM_OFFLOAD", "bool", ("fsdp",)),
    _v("ACTOR_OPTIMIZER_OFFLOAD", "bool", ("fsdp",)),
    # --- Megatron
    _v("TRAIN_TP", "int", ("megatron",), hi=NPU_MAX, key=MEG + "tensor_model_parallel_size"),
    _v("TRAIN_PP", "int", ("megatron",), hi=NPU_MAX, key=MEG + "pipeline_model_parallel_size"),
    _v("TRAIN_CP", "int", ("megatron",), hi=NPU_MAX, key=MEG + "context_parallel_size"),
    _v("TRAIN_EP", "int", ("megatron",), hi=NPU_MAX, key=MEG + "expert_model_parallel_size"),
    _v("TRAIN_ETP", "int", ("megatron",), hi=NPU_MAX, key=MEG + "expert_tensor_parallel_size"),
    _v("ACTOR_OFFLOAD", "bool", ("megatron",)),
    _v("USE_DIST_CKPT", "bool", ("megatron",)),
    _v("USE_MBRIDGE", "bool", ("megatron",), key=MEG + "use_mbridge"),
    _v("VANILLA_MBRIDGE", "bool", ("megatron",), key=MEG + "vanilla_mbridge"),
    _v("USE_FLASH_ATTN", "bool", ("megatron",)),
    # megatron-core TransformerConfig: recompute_granularity full|selective, recompute_method uniform|block
    _v("RECOMPUTE_GRANULARITY", "enum", ("megatron",), choices=("full", "selective")),
    _v("RECOMPUTE_METHOD", "enum", ("megatron",), choices=("uniform", "block")),
    _v("RECOMPUTE_NUM_LAYERS", "int", ("megatron",)),
    # --- MoE rollouts
    _v("ROLLOUT_DP", "int", ("moe",), hi=NPU_MAX, key=RO + "data_parallel_size"),
    _v("ROLLOUT_EP", "int", ("moe",), hi=NPU_MAX, key=RO + "expert_parallel_size"),
    # --- separate rollout pool (one-step-off / fully-async)
    _v("ASYNC_MODE", "enum", ("async",), choices=("one_step_off", "fully_async")),
    _v("TRAINER_NPUS", "int", ("async",), hi=NPU_MAX, key="trainer.n_gpus_per_node"),
    _v("ROLLOUT_NPUS", "int", ("async",), hi=NPU_MAX, key="rollout.n_gpus_per_node"),
    _v("ROLLOUT_NNODES", "int", ("async",), hi=NPU_MAX, key="rollout.nnodes"),
    _v("CHECKPOINT_ENGINE", "enum", ("async",), choices=verl_lines.CHECKPOINT_ENGINES,
       key=RO + "checkpoint_engine.backend"),
    _v("TRIGGER_SYNC_STEPS", "int", ("async",), key="async_training.trigger_parameter_sync_step"),
    _v("STALENESS", "float", ("async",), lo=0, hi=1e6, key="async_training.staleness_threshold"),
    _v("TOTAL_ROLLOUT_STEPS", "int", ("async",), key="rollout.total_rollout_steps"),
)
BY_NAME: Dict[str, Var] = {v.name: v for v in VARIABLES}


def var_of_key(key: str, features: Iterable[str] = ()) -> Optional[Var]:
    """The recipe variable written to Hydra key `key` (the async pool's own when `features` has
    "async", since TRAINER_NPUS and NPUS_PER_NODE both become trainer.n_gpus_per_node)."""
    feats = set(features)
    found = [v for v in VARIABLES if v.key == key]
    for v in found:
        if v.uses & feats and "all" not in v.uses:
            return v
    return found[0] if found else None


def parse(var: Var, raw: str) -> Tuple[Optional[str], Optional[str]]:
    """(normalised value, None) or (None, problem) for `raw`, the value as the user set it."""
    shown = f"{var.name} must be {var.expected()}, got {raw!r}"
    if raw != raw.strip():
        return None, f"{shown} (no spaces around the value)"
    if var.kind == "int":
        # the digit count first: no comparison below ever sees a huge number
        if not _INT.fullmatch(raw) or len(raw.lstrip("-")) > len(str(int(var.hi))):
            return None, shown
        if not var.lo <= int(raw) <= var.hi:
            return None, shown
        return raw, None
    if var.kind == "float":
        if not _FLOAT.fullmatch(raw):
            return None, shown
        value = float(raw)
        if value != value or (var.lo_open and value <= var.lo) or value < var.lo or \
                (var.hi is not None and value > var.hi):
            return None, shown
        return raw, None
    if var.kind == "bool":
        low = raw.lower()
        if var.name == "FLASHRL_LMHEAD_FP32":  # npu_flashrl's own switch keeps its spelling
            return (raw, None) if low in BOOL_TRUE + BOOL_FALSE else (None, shown)
        if low in ("true", "1"):
            return "True", None
        if low in ("false", "0"):
            return "False", None
        return None, shown
    if var.kind == "enum":
        return (raw, None) if raw in var.choices else (None, shown)
    return raw, None


def bool_on(raw: str) -> bool:
    return raw.strip().lower() in BOOL_TRUE


def check_variables(environ: Mapping[str, str], features: Iterable[str]
                    ) -> Tuple[List[str], List[str], Dict[str, str]]:
    """(problems, notes, normalised values) for every declared variable set in `environ`. A
    variable the recipe does not read is a note (it would be ignored without a word)."""
    feats = set(features) | {"all"}
    if "any" in feats:  # the entry scripts: every variable their config script may read
        feats |= {u for v in VARIABLES for u in v.uses}
    problems: List[str] = []
    notes: List[str] = []
    values: Dict[str, str] = {}
    for var in VARIABLES:
        raw = environ.get(var.name)
        if raw is None or raw == "":
            continue
        if not var.uses & feats:
            used_by = ", ".join(sorted(var.uses))
            notes.append(f"{var.name}={raw!r} is set but this recipe does not read it (used by the "
                         f"{used_by} recipes)")
            continue
        if "\n" in raw:
            problems.append(f"{var.name} must be one line, got {raw!r}")
            continue
        value, problem = parse(var, raw)
        if problem:
            problems.append(problem)
        else:
            values[var.name] = value
    return problems, notes, values
