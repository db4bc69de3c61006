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
import math
import os
import re
from typing import Dict, FrozenSet, Iterable, List, Mapping, Optional, Tuple

from npu_flashrl.lines import verl as verl_lines

INT_MAX = 999_999_999  # large enough for any token count; keeps every product below 2**63
NPU_MAX = 65_536
_INT = re.compile(r"-?(0|[1-9][0-9]*)")
_FLOAT = re.compile(r"([0-9]+\.?[0-9]*|\.[0-9]+)([eE][-+]?[0-9]+)?")
# ray.init(address=...): "auto", "host:port" of a running cluster's GCS, or a Ray Client "ray://host:port"
_RAY_ADDRESS = re.compile(r"auto|(ray://)?[A-Za-z0-9]([A-Za-z0-9.-]*[A-Za-z0-9])?:[0-9]{1,5}")
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
    # the recipe's default: a value, a template of other variables ("{HOME}/data/{DATASET}"), or a
    # function of a `Job` (line-dependent and derived defaults); None: no default (unset stays unset)
    default: object = None
    cite: str = ""  # where the range comes from, when it is not verl's schema

    def expected(self) -> str:
        if self.kind == "int":
            return f"an integer >= {int(self.lo)} and <= {int(self.hi)}" + (f" ({self.cite})" if self.cite else "")
        if self.kind == "float":
            low = f"> {self.lo:g}" if self.lo_open else f">= {self.lo:g}"
            high = f" and <= {self.hi:g}" if self.hi is not None else ""
            return f"a finite number {low}{high} (e.g. 0.3 or 5e-8)"
        if self.kind == "bool":
            return self.spellings
        if self.kind == "enum":
            return "one of " + ", ".join(self.choices)
        if self.kind == "address":
            return "a Ray cluster address: auto, host:port or ray://host:port (ray.init's `address`)"
        return "a value"


def _v(name, kind, uses=("all",), **kw) -> Var:
    if kind == "int":
        kw.setdefault("lo", 1)
        kw.setdefault("hi", INT_MAX)
    return Var(name, kind, frozenset(uses), **kw)


RO = "actor_rollout_ref.rollout."
MEG = "actor_rollout_ref.actor.megatron."
CANN_CONNECT = ("CANN's HCCL_CONNECT_TIMEOUT: an integer in [120, 7200] s, hiascend.com "
                "canncommercial/83RC1/maintenref/envvar/envref_07_0149.html")
CANN_EXEC = ("CANN's HCCL_EXEC_TIMEOUT on Atlas A2/A3: [0, 2147483647] s, 0 never times out, hiascend.com "
             "canncommercial/latest/maintenref/envvar/envref_07_0078.html")
ENTRY = ("all", "entry")  # read by the config scripts and, before them, by the entry scripts


# the rollout precision each FLASHRL_FN gives (the experiment name's word; the preflight holds
# FLASHRL_CONFIG to it)
PRECISION_OF_FN = {"int8": "int8", "int8_profile_free": "int8", "w4a8_profile_free": "w4a8", "bf16": "bf16"}


def _precision(job: "Job") -> str:
    return PRECISION_OF_FN[job.get("FLASHRL_FN")] if job.entry else "int8"


def _flashrl_config(job: "Job") -> str:  # the entry writes one (npu-flashrl setup); a config script needs one given
    if not job.entry:
        return ""
    model = os.path.basename(job.get("MODEL_PATH").rstrip("/"))
    return f"{job.get('RUN_DIR')}/configs/{model}.{job.get('FLASHRL_FN')}.yaml"


def _profile(job: "Job") -> str:
    model = os.path.basename(job.get("MODEL_PATH").rstrip("/"))
    return f"{job.get('RUN_DIR')}/profiles/{model}.int8_profile.pt"


def _experiment(job: "Job") -> str:
    suffix = "_verl09" if job.line == "current" else ""
    return f"{job.experiment}_{job.get('ROLLOUT_PRECISION')}_A2{suffix}" if job.experiment else ""


VARIABLES: Tuple[Var, ...] = (
    # --- the launch scripts (configs/*.sh), every trainer
    _v("RECIPE_LINE", "enum", ENTRY, choices=("pinned", "current")),
    _v("FLASHRL_FN", "enum", ("entry",), choices=tuple(PRECISION_OF_FN), default="int8"),
    _v("BASELINE_NPU_FLASHRL", "bool", ("entry",), default="True"),
    _v("ROLLOUT_PRECISION", "enum", ENTRY, choices=("int8", "w4a8", "bf16"), default=_precision),
    _v("MODEL_PATH", "str", ENTRY, default="{HOME}/models/Qwen2.5-7B-Instruct"),
    _v("DATASET", "enum", ENTRY, choices=("gsm8k", "dapo", "geo3k"), default="gsm8k"),
    _v("DATA_DIR", "str", ENTRY, default="{HOME}/data/{DATASET}"),
    _v("TRAIN_FILE", "str", ENTRY, default="{DATA_DIR}/train.parquet"),
    _v("VAL_FILE", "str", ENTRY, default="{DATA_DIR}/test.parquet"),
    # --- the entry scripts (flash_rl/*.sh): profile and setup before the config script
    _v("RUN_DIR", "str", ("entry",), default="{HOME}/npu_flashrl_runs"),
    _v("QUANT_MODEL_PATH", "str", ("entry",), default=lambda job: job.get("MODEL_PATH").rstrip("/") + "-W8A8"),
    _v("PROFILE_PATH", "str", ("entry",), default=_profile),
    _v("NPU_FLASHRL_CLI", "str", ("entry",), default="npu-flashrl"),
    _v("SETUP_EXTRA", "str", ("entry",), default=""),
    _v("FLASHRL_CONFIG", "str", ENTRY, default=_flashrl_config),
    _v("NNODES", "int", hi=NPU_MAX, key="trainer.nnodes", default="1"),
    _v("NPUS_PER_NODE", "int", hi=NPU_MAX, key="trainer.n_gpus_per_node", default="8"),
    _v("RAY_ADDRESS", "address", default=""),
    _v("MAX_PROMPT_LENGTH", "int", key="data.max_prompt_length", default="2048"),
    _v("MAX_RESPONSE_LENGTH", "int", key="data.max_response_length", default="10240"),
    _v("TRAIN_BATCH_SIZE", "int", key="data.train_batch_size", default="16"),
    _v("PPO_MINI_BATCH_SIZE", "int", key="actor_rollout_ref.actor.ppo_mini_batch_size", default="8"),
    _v("ROLLOUT_N", "int", key=RO + "n", default="4"),
    _v("USE_DYNAMIC_BSZ", "bool", key="actor_rollout_ref.actor.use_dynamic_bsz", default="True"),
    # a whole sequence fits one micro-batch: prompt + response
    _v("PPO_MAX_TOKEN_LEN", "int", key="actor_rollout_ref.actor.ppo_max_token_len_per_gpu",
       default=lambda job: str(int(job.get("MAX_PROMPT_LENGTH")) + int(job.get("MAX_RESPONSE_LENGTH")))),
    _v("LR", "float", lo=0, key="actor_rollout_ref.actor.optim.lr", default="5e-8"),
    _v("KL_LOSS_COEF", "float", lo=0, key="actor_rollout_ref.actor.kl_loss_coef", default="0.001"),
    _v("KL_LOSS_TYPE", "enum", choices=KL_TYPES + tuple(k + "+" for k in KL_TYPES),
       key="actor_rollout_ref.actor.kl_loss_type", default="low_var_kl"),
    _v("ROLLOUT_TP", "int", hi=NPU_MAX, key=RO + "tensor_model_parallel_size", default="4"),
    _v("GPU_MEMORY_UTILIZATION", "float", lo=0, hi=1, lo_open=True, key=RO + "gpu_memory_utilization",
       default="0.3"),
    _v("MICRO_BATCH_PER_NPU", "int", key="actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu", default="1"),
    _v("ENFORCE_EAGER", "bool", key=RO + "enforce_eager", default="False"),
    _v("REF_PARAM_OFFLOAD", "bool", default="True"),
    # pinned: sequence level as the published Ascend INT8 recipe; current: token level, the combination
    # tests/adapters/verl/test_verl_server_tis.py runs through the server-mode verl's own driver and loss code
    _v("TIS_LEVEL", "enum", choices=("null", "token", "sequence"), key="algorithm.rollout_correction.rollout_is",
       default=lambda job: "token" if job.line == "current" else "sequence"),
    _v("TIS_THRESHOLD", "float", lo=0, hi=1e300, lo_open=True,
       key="algorithm.rollout_correction.rollout_is_threshold", default="2.0"),
    _v("TIS_BATCH_NORMALIZE", "bool", key="algorithm.rollout_correction.rollout_is_batch_normalize", default="True"),
    # decoupled mode: on the sync (pinned) verl line the only combination whose truncated IS weights reach the loss
    _v("TIS_BYPASS_MODE", "bool", key="algorithm.rollout_correction.bypass_mode", default="False"),
    _v("TIS_USE_POLICY_GRADIENT", "bool", ("pinned",), key="algorithm.rollout_correction.use_policy_gradient",
       default="False"),
    # the trainer->rollout sync buffer (verl's default), one per trainer rank
    _v("UPDATE_WEIGHTS_BUCKET_MB", "int", ("current",), hi=1_048_576,
       key=RO + "checkpoint_engine.update_weights_bucket_megabytes", default="2048"),
    _v("TOTAL_EPOCHS", "int", key="trainer.total_epochs", default="5"),
    _v("SAVE_FREQ", "int", lo=-1, key="trainer.save_freq", default="-1"),
    _v("TEST_FREQ", "int", lo=-1, key="trainer.test_freq", default="5"),
    _v("LOGGER", "str", default="console"),
    _v("PROJECT_NAME", "str", default="npu_flashrl_grpo"),
    _v("EXPERIMENT_NAME", "str", default=_experiment),
    _v("CKPT_DIR", "str", default="{HOME}/npu_flashrl_runs/ckpts/{PROJECT_NAME}/{EXPERIMENT_NAME}"),
    _v("FLASHRL_LMHEAD_FP32", "bool", ENTRY, spellings="1 or 0 (also true/false, yes/no, on/off)", default="1"),
    _v("FLASHRL_LOGGING_LEVEL", "str", default="DEBUG"),
    _v("FLASHRL_LOGGING_FILE", "str", default=""),
    _v("VERL_LOGGING_LEVEL", "str", default="DEBUG"),
    _v("VLLM_LOGGING_LEVEL", "str", default="DEBUG"),
    _v("HCCL_CONNECT_TIMEOUT", "int", lo=120, hi=7200, cite=CANN_CONNECT, default="3000"),
    _v("HCCL_EXEC_TIMEOUT", "int", lo=0, hi=2_147_483_647, cite=CANN_EXEC, default="3000"),
    _v("HCCL_HOST_SOCKET_PORT_RANGE", "str", default="60000-60050"),
    _v("HCCL_NPU_SOCKET_PORT_RANGE", "str", default="61000-61050"),
    # --- FSDP
    _v("ACTOR_PARAM_OFFLOAD", "bool", ("fsdp",), default="False"),
    _v("ACTOR_OPTIMIZER_OFFLOAD", "bool", ("fsdp",), default="False"),
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
    # fully-async only: a one-step-off run does not read them
    _v("TRIGGER_SYNC_STEPS", "int", ("fully_async",), key="async_training.trigger_parameter_sync_step"),
    _v("STALENESS", "float", ("fully_async",), lo=0, hi=1e6, key="async_training.staleness_threshold"),
    _v("TOTAL_ROLLOUT_STEPS", "int", ("fully_async",), key="rollout.total_rollout_steps"),
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
        if not math.isfinite(value) or (var.lo_open and value <= var.lo) or value < var.lo or \
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
    if var.kind == "address":
        return (raw, None) if raw == "" or _RAY_ADDRESS.fullmatch(raw) else (None, shown)
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


@dataclasses.dataclass
class Job:
    """What a recipe's defaults are computed from: the values so far, the stack line, whether an
    entry script (flash_rl/) asks, and the config script's experiment-name prefix."""
    values: Dict[str, str]
    line: str = "pinned"
    entry: bool = False
    experiment: str = ""
    home: str = ""

    def get(self, name: str) -> str:
        if name == "HOME":
            return self.home
        return self.values[name]


SOURCES = ("environment", "default", "derived")


def default_of(var: Var, job: Job) -> Tuple[str, str]:
    """(value, source) of `var`'s default for `job`: "default" for a constant, "derived" for a
    value computed from other variables or the line."""
    if callable(var.default):
        return var.default(job), "derived"
    text = str(var.default)
    names = re.findall(r"{([A-Z_]+)}", text)
    if not names:
        return text, "default"
    for name in names:
        text = text.replace("{" + name + "}", job.get(name))
    return text, "derived"


def resolve_job(environ: Mapping[str, str], features: Iterable[str], line: str, experiment: str = ""
                ) -> Tuple[List[str], List[str], List[Tuple[str, str, str]]]:
    """(problems, notes, job): every variable the recipe reads with its value and where it came
    from (SOURCES), defaults filled in declaration order (derived ones after what they read)."""
    feats = set(features)
    entry = "entry" in feats
    problems, notes, values = check_variables(environ, feats)
    if problems:
        return problems, notes, []
    reads = {"entry"} if entry else feats | {"all"}
    job = Job(dict(values), line, entry, experiment, environ.get("HOME", ""))
    out: List[Tuple[str, str, str]] = []
    for var in VARIABLES:
        if not var.uses & reads:
            continue
        if var.name in values:
            out.append((var.name, values[var.name], "environment"))
        elif var.default is not None:
            value, source = default_of(var, job)
            job.values[var.name] = value
            out.append((var.name, value, source))
    return problems, notes, out
