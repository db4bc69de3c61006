"""`npu-flashrl preflight`: the one home of the verl recipes' rules (tests/verl_examples).

Every recipe calls it twice, before anything expensive starts:

* ``preflight vars --features ...``: the recipe variables set in the environment, each against its
  declared type and range (`variables.VARIABLES`); prints the normalised values (``NAME=value``
  lines, booleans as Hydra's True/False) for the shell to continue with;
* ``preflight launch --features ... -- COMMAND...``: the verl command the recipe assembled, read as
  `npu-flashrl verify --verl-overrides` reads one (`command.read_words`): the layout (rollout TP
  against the NPUs of its pool, the trainer's model parallelism against its NPUs, the pools of a
  one-step-off / fully-async run), the rules of the recipe's verl line (TIS, server mode,
  checkpoint engines, MoE), the override schema of the installed verl when it is the recipe's line,
  and on a real run (no --dry-run) that the installed verl is the recipe's line.

Messages name the variable (and the Hydra key it became), the value and what is expected; they go
to stderr as ``[recipe] ERROR: ...``; the exit status is `REFUSED` (3) when anything is refused,
so that the shell tells a refusal from an interpreter that cannot run npu_flashrl at all.

Torch-free on purpose (it runs on every --dry-run): nothing here imports npu_flashrl.config or the
adapters at module level; only an existing FlashRL config file (`config_check`, read by npu_flashrl's
own reader) or a quantized checkpoint (`quant_check`) imports them, when the launch names one.
"""
from __future__ import annotations

import argparse
import importlib.util
import os
import sys
from typing import Any, Dict, List, Mapping, Optional, Sequence, Tuple

from npu_flashrl.lines import verl as verl_lines
from npu_flashrl.recipes import config_check, quant_check, w4a8_groups
from npu_flashrl.recipes import variables as V
from npu_flashrl.recipes.command import Command, read_words
from npu_flashrl.values import is_null, is_true

REFUSED = 3
HELP = "check a verl recipe's variables and command before anything starts (used by tests/verl_examples)"
RC = "algorithm.rollout_correction."
RO = "actor_rollout_ref.rollout."
MEG = "actor_rollout_ref.actor.megatron."
RAY_ENV = "ray_kwargs.ray_init.runtime_env.env_vars."
# MoE engine options npu_flashrl's INT8 expert reload does not follow, with the reason
EPLB = {"dynamic_eplb": "dynamic EPLB moves experts between ranks and slots at run time",
        "enable_eplb": "dynamic EPLB moves experts between ranks and slots at run time",
        "expert_map_path": "an expert map turns vllm-ascend's dynamic EPLB on",
        "num_redundant_experts": "redundant experts give a logical expert several physical copies"}
# the `fn` names that quantize with FlashRL's int8 profile (npu_flashrl.config: FN_INT8 and its
# FlashRL aliases; tests/recipes/test_recipe_preflight.py holds the two together); the profile has no MoE experts
PROFILE_FNS = ("int8", "int8_wo_prune", "int8_fast")
# what to set in the recipe for the combination that works, per verl line
TIS_RECIPE_FIX = {verl_lines.SYNC: "TIS_BYPASS_MODE=False TIS_USE_POLICY_GRADIENT=False",
                  verl_lines.SERVER: "TIS_BYPASS_MODE=False"}


def _nonzero(text: str) -> bool:
    """A count written as a number (0, 0.0, 00) is off only when it is zero."""
    try:
        return float(text) != 0
    except ValueError:
        return not is_null(text)


class Checker:
    """The rules applied to one verl command (recipe or `verify --verl-overrides`)."""

    def __init__(self, cmd: Command, line: str, environ: Mapping[str, str],
                 features: Sequence[str] = (), node_npus: Optional[int] = None):
        self.cmd = cmd
        self.line = line
        self.rules = verl_lines.for_line(line)
        self.features = set(features)
        self.recipe = bool(self.features)
        self.cfg = verl_lines.overrides_to_config(cmd.overrides)
        self.environ = dict(environ)
        self.environ.update(cmd.env)
        self.node_npus = node_npus
        self.problems: List[str] = []
        self.notes: List[str] = []

    # ------------------------------------------------------------------ reading
    def get(self, key: str, default: Any = None) -> Any:
        return verl_lines.select(self.cfg, key, default)

    def name(self, key: str, value: Any = None) -> str:
        """`VAR=value (key)` in a recipe, `key=value` otherwise."""
        value = self.get(key) if value is None else value
        var = V.var_of_key(key, self.features) if self.recipe else None
        return f"{var.name}={value} ({key})" if var else f"{key}={value}"

    def flashrl_config(self) -> str:
        return str(self.environ.get("FLASHRL_CONFIG") or self.get(RAY_ENV + "FLASHRL_CONFIG") or "").strip()

    def flashrl_fns(self) -> Optional[List[str]]:
        """The `fn` values of the FlashRL config in play (None: none, or not readable here)."""
        path = self.flashrl_config()
        if not path or not os.path.isfile(path):
            return None
        import yaml

        try:
            with open(path, encoding="utf-8") as fh:
                data = yaml.safe_load(fh)
        except (OSError, UnicodeDecodeError, yaml.YAMLError, RecursionError):
            return None  # npu-flashrl setup / verify report a broken config
        entries = data.get("configs") if isinstance(data, dict) else None
        if isinstance(data, dict) and "fn" in data:
            entries = [data]
        # FlashRL's reader: an entry without `fn` is int8; the value is read stripped
        return [str(e.get("fn", "int8")).strip() for e in entries or [] if isinstance(e, dict)]

    def int8_rollout(self) -> bool:
        fns = self.flashrl_fns()
        if fns:
            return any(fn != "bf16" for fn in fns)
        if self.recipe:
            return self.environ.get("ROLLOUT_PRECISION", "int8") != "bf16" and bool(self.flashrl_config())
        return bool(self.flashrl_config())

    def integer(self, key: str, default: Optional[int] = None) -> Optional[int]:
        value = self.get(key)
        if value is None:
            return default
        if isinstance(value, str) and "${" in value:
            return None  # an interpolation: resolved and checked by verl's own checks (verl_check)
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            self.problems.append(f"{self.name(key)}: expected a positive integer")
            return None
        return value

    # ------------------------------------------------------------------ rules
    def check(self) -> "Checker":
        self.rollout_dtype()
        self.precision()
        self.grpo_group()
        self.tis()
        self.rollout_mode()
        if verl_lines.is_server_line(self.line):
            self.server_mode()
        self.checkpoint_engine()
        self.moe()
        self.layout()
        return self

    def rollout_dtype(self) -> None:
        dtype = self.get(RO + "dtype")
        if dtype is not None and str(dtype).strip().lower() not in verl_lines.ROLLOUT_DTYPES:
            self.problems.append(
                f"{RO}dtype={dtype}: vLLM takes a float model dtype ({', '.join(verl_lines.ROLLOUT_DTYPES)}); "
                "the INT8 rollout comes from FLASHRL_CONFIG (npu-flashrl setup --fn int8...), with the "
                "rollout dtype left at bfloat16")

    def precision(self) -> None:
        """An INT8 recipe run whose FLASHRL_CONFIG quantizes nothing would launch an "int8" experiment
        with a bf16 rollout; a W4A8 one whose config quantizes to INT8 (or the other way round) would
        launch under the other precision's name."""
        fns = self.flashrl_fns()
        precision = self.environ.get("ROLLOUT_PRECISION")
        if self.recipe and fns and precision == "int8" and all(fn == "bf16" for fn in fns):
            self.problems.append(
                f"ROLLOUT_PRECISION=int8 but FLASHRL_CONFIG {self.flashrl_config()} has only fn: bf16 (no INT8 "
                "rollout): run the bf16 recipe for a bf16 baseline, or write an INT8 config (npu-flashrl setup "
                "--fn int8_profile_free, or set FLASHRL_CONFIG to another file)")
            return
        of = dict(V.PRECISION_OF_FN, **{alias: "int8" for alias in PROFILE_FNS})
        quantized = [fn for fn in fns or [] if fn != "bf16"]
        if self.recipe and precision == "bf16" and quantized:  # the bf16 twin, handed a quantized config
            self.problems.append(
                f"ROLLOUT_PRECISION=bf16 but FLASHRL_CONFIG {self.flashrl_config()} has fn: {quantized[0]} (a "
                f"{of.get(quantized[0], quantized[0])} rollout under the bf16 name): run the recipe of that "
                "precision, or give the bf16 recipe a bf16 config (npu-flashrl setup --fn bf16)")
            return
        if not (self.recipe and fns and precision in ("int8", "w4a8")):
            return
        other = [fn for fn in fns if fn != "bf16" and of.get(fn, precision) != precision]
        if other or all(fn == "bf16" for fn in fns):
            got = other[0] if other else "bf16"
            fix = {"w4a8": "w4a8_profile_free", "int8": "int8_profile_free"}[precision]
            self.problems.append(
                f"ROLLOUT_PRECISION={precision} but FLASHRL_CONFIG {self.flashrl_config()} has fn: {got} (a "
                f"{of.get(got, got)} rollout): run the recipe of that precision, or write a {precision} config "
                f"(npu-flashrl setup --fn {fix}, or set FLASHRL_CONFIG to another file)")

    def grpo_group(self) -> None:
        """GRPO's baseline is the mean of a prompt's group of responses; verl's
        compute_grpo_outcome_advantage takes mean 0 and std 1 for a group of one, so with
        rollout.n=1 the advantage is the raw reward (no baseline): not the GRPO asked for."""
        estimator = str(self.get("algorithm.adv_estimator", "")).strip()
        n = self.get(RO + "n")
        if estimator.startswith("grpo") and isinstance(n, int) and not isinstance(n, bool) and n == 1:
            self.problems.append(
                f"{self.name(RO + 'n', n)} with algorithm.adv_estimator={estimator}: GRPO compares each response "
                "with the other responses to its prompt, and with one response per prompt verl's "
                "compute_grpo_outcome_advantage uses mean 0 / std 1 (the advantage is the raw reward, no "
                "baseline); set it to 2 or more (the recipes use 4)")

    def tis(self) -> None:
        problems = self.rules.tis_problems(lambda key, default: self.get(key, default), verl_lines.MISSING)
        if problems:
            fix = self.rules.FIX + (f"; in the recipe: {TIS_RECIPE_FIX[self.line]}" if self.recipe else "")
            self.problems.append("; ".join(problems) + f". Fix: {fix}")

    def lmhead_fp32(self) -> bool:
        raw = str(self.environ.get("FLASHRL_LMHEAD_FP32", "0"))
        var = V.BY_NAME["FLASHRL_LMHEAD_FP32"]
        _, problem = V.parse(var, raw)
        if problem:
            self.problems.append(problem)
            return False
        return V.bool_on(raw)

    def rollout_mode(self) -> None:
        if not self.flashrl_config():
            return
        problem = self.rules.rollout_mode_problem(lambda key: self.get(key), self.environ,
                                                  lmhead_fp32=self.lmhead_fp32())
        if problem:
            self.problems.append(problem)

    def server_mode(self) -> None:
        """What the server-mode verl would only report after Ray and the vLLM servers started,
        or never (docs/troubleshooting.md)."""
        release = verl_lines.RELEASES[verl_lines.SERVER]
        mode = self.get(RO + "mode")
        if mode is not None and str(mode).strip().lower() == "sync":
            self.problems.append(
                f"{RO}mode=sync: {release} removed the sync rollout mode (RolloutConfig refuses it); "
                "server mode is the only one and npu_flashrl follows the syncs there (docs/verl_server_mode.md)")
        if self.flashrl_config():
            quant = self.get(RO + "engine_kwargs.vllm.quantization")
            if not is_null(quant):
                self.problems.append(
                    f"{RO}engine_kwargs.vllm.quantization={quant} next to FLASHRL_CONFIG: vLLM would quantize "
                    f"the rollout itself and npu_flashrl's INT8 rollout cannot apply as well; drop "
                    f"{RO}engine_kwargs.vllm.quantization (or unset FLASHRL_CONFIG for vLLM's own)")
            plugins = self.environ.get("VLLM_PLUGINS")
            if plugins and "npu_flashrl" not in [p.strip() for p in plugins.split(",")]:
                self.problems.append(
                    f"VLLM_PLUGINS={plugins!r} leaves out npu_flashrl: verl's vLLM processes would build a "
                    "bf16 engine; add npu_flashrl to it or unset VLLM_PLUGINS")
        for where, value in (("VLLM_ASCEND_ENABLE_NZ in this shell", self.environ.get("VLLM_ASCEND_ENABLE_NZ")),
                             (f"+{RAY_ENV}VLLM_ASCEND_ENABLE_NZ", self.get(RAY_ENV + "VLLM_ASCEND_ENABLE_NZ"))):
            if value is not None and str(value).strip() not in ("", "0"):
                self.problems.append(
                    f"{where}: VLLM_ASCEND_ENABLE_NZ={value} reaches verl's vLLM workers (verl sets 0 only "
                    "when unset) and vllm-ascend refuses to wake the engine from sleep mode with FRACTAL_NZ "
                    "weights ('FRACTAL_NZ mode is enabled ...'); unset it or set 0")

    def checkpoint_engine(self) -> None:
        key = RO + "checkpoint_engine.backend"
        backend = self.get(key)
        if backend is None:
            return
        backend = str(backend)
        if not verl_lines.is_server_line(self.line):
            return  # the sync line has no checkpoint engines; its schema lint names the key
        if backend not in verl_lines.CHECKPOINT_ENGINES:
            self.problems.append(
                f"{self.name(key, backend)}: not a checkpoint engine of "
                f"{verl_lines.RELEASES[verl_lines.SERVER]} (its CheckpointEngineRegistry has "
                f"{', '.join(verl_lines.CHECKPOINT_ENGINES)}; on Ascend `nccl` is HCCL)")
        elif backend == "delta_sharded" and self.int8_rollout():
            self.problems.append(
                f"{self.name(key, backend)} with an INT8 FLASHRL_CONFIG: delta_sharded writes bf16 patches "
                "into the INT8 rollout's int8 parameters; use nccl (HCCL) or naive, or a bf16 rollout")

    def moe(self) -> None:
        ep = self.get(RO + "expert_parallel_size")
        if ep is not None:
            tp = self.integer(RO + "tensor_model_parallel_size", 1)
            dp = self.integer(RO + "data_parallel_size", 1)
            ep = self.integer(RO + "expert_parallel_size")
            if None not in (tp, dp, ep) and ep not in (1, tp * dp):
                self.problems.append(
                    f"{self.name(RO + 'expert_parallel_size', ep)}: "
                    f"{verl_lines.RELEASES[verl_lines.SERVER]}'s RolloutConfig requires {RO}expert_parallel_size "
                    f"= tensor_model_parallel_size x data_parallel_size ({tp} x {dp} = {tp * dp}) for expert "
                    "parallel, or 1 (experts split over the TP ranks)")
        if not self.int8_rollout():
            return
        for ov in self.cmd.overrides:
            key, _, value = ov.partition("=")
            leaf, text = key.rsplit(".", 1)[-1], value.strip("'\"").strip()
            on = {"dynamic_eplb": text.lower() in ("true", "1"), "enable_eplb": text.lower() in ("true", "1"),
                  "expert_map_path": not is_null(text), "num_redundant_experts": _nonzero(text)}.get(leaf)
            if on:
                self.problems.append(
                    f"{ov}: {EPLB[leaf]}, which npu_flashrl's in-place INT8 expert reload does not track (it "
                    "refuses such an engine at build, docs/moe.md); drop it for INT8 rollouts")
        profiled = [fn for fn in self.flashrl_fns() or [] if fn in PROFILE_FNS]
        if "moe" in self.features and profiled:
            self.problems.append(
                f"FLASHRL_CONFIG {self.flashrl_config()} has fn: {profiled[0]}: FlashRL's int8 profile has no entries for "
                "MoE experts and npu_flashrl refuses it for a MoE model; use fn: int8_profile_free "
                "(npu-flashrl setup -m $MODEL_PATH --fn int8_profile_free) or a W8A8 MoE checkpoint (docs/moe.md)")

    def layout(self) -> None:
        n = self.integer("trainer.n_gpus_per_node", 8)
        nnodes = self.integer("trainer.nnodes", 1)
        tp = self.integer(RO + "tensor_model_parallel_size", 1)
        batch = self.integer("data.train_batch_size")
        mini = self.integer("actor_rollout_ref.actor.ppo_mini_batch_size")
        if batch and mini and batch < mini:
            self.problems.append(
                f"{self.name('data.train_batch_size')} is smaller than "
                f"{self.name('actor_rollout_ref.actor.ppo_mini_batch_size')}: verl needs "
                "data.train_batch_size >= actor_rollout_ref.actor.ppo_mini_batch_size")
        if None in (n, nnodes, tp):
            return
        tp_name = self.name(RO + "tensor_model_parallel_size", tp)
        ray = self.environ.get("RAY_ADDRESS", "").strip() or self.get("ray_kwargs.ray_init.address")
        if self.recipe and not self.cmd.experimental and nnodes > 1 and is_null(ray):
            self.problems.append(
                f"{self.name('trainer.nnodes', nnodes)} needs a Ray cluster of {nnodes} nodes, but RAY_ADDRESS is "
                "empty (a local Ray on this one node would wait for the other nodes' NPUs forever): start the "
                "cluster (ray start) and set RAY_ADDRESS=head_ip:6379, or NNODES=1")
        if self.cmd.experimental:
            self.pools(n, nnodes, tp, tp_name)
        elif tp > n or n % tp:
            self.problems.append(
                f"{tp_name} must divide {self.name('trainer.n_gpus_per_node', n)}: each vLLM rollout "
                f"replica takes ROLLOUT_TP NPUs of one node" if self.recipe else
                f"{tp_name} must divide trainer.n_gpus_per_node={n}: each vLLM rollout replica takes "
                "tensor_model_parallel_size NPUs of one node")
        if str(self.get("actor_rollout_ref.actor.strategy")) == "megatron":
            self.megatron(n * nnodes)

    def pools(self, n: int, nnodes: int, tp: int, tp_name: str) -> None:
        rn = self.integer("rollout.n_gpus_per_node", 8)
        rnodes = self.integer("rollout.nnodes", 1)
        if None in (rn, rnodes):
            return
        rn_name = self.name("rollout.n_gpus_per_node", rn)
        if tp > rn or rn % tp:
            self.problems.append(f"{tp_name} must divide {rn_name}: the rollout replicas run on the rollout "
                                 "pool's NPUs, ROLLOUT_TP of one node each")
        node = self.node_npus
        if node is None:
            return
        for key, value in (("trainer.n_gpus_per_node", n), ("rollout.n_gpus_per_node", rn)):
            if value > node:
                self.problems.append(f"{self.name(key, value)} exceeds NPUS_PER_NODE={node}: a pool takes "
                                     "that many NPUs on each of its nodes")
        one_node = nnodes == 1 and rnodes == 1 and n + rn <= node
        ray = self.environ.get("RAY_ADDRESS", "").strip()
        if not one_node and not ray:
            need = ("the trainer and rollout pools" if nnodes == 1 and rnodes == 1 else
                    f"{nnodes} trainer node(s) and {rnodes} rollout node(s)")
            over = (f"TRAINER_NPUS={n} + ROLLOUT_NPUS={rn} exceed NPUS_PER_NODE={node}, so "
                    if n + rn > node else "")
            self.problems.append(
                f"{over}{need} need a Ray cluster of several nodes, but RAY_ADDRESS is empty (a local Ray on "
                "this one node would wait for the NPUs forever): start the cluster (ray start) and set "
                "RAY_ADDRESS=head_ip:6379, or make the pools fit one node (TRAINER_NPUS + ROLLOUT_NPUS <= "
                f"NPUS_PER_NODE={node}, ROLLOUT_NNODES=1)")

    def megatron(self, world: int) -> None:
        sizes = [(k, self.integer(MEG + k, 1)) for k in
                 ("tensor_model_parallel_size", "pipeline_model_parallel_size", "context_parallel_size")]
        if any(v is None for _, v in sizes):
            return
        product = 1
        for _, v in sizes:
            product *= v
        if world % product:
            named = " x ".join(self.name(MEG + k, v) for k, v in sizes)
            self.problems.append(
                f"{named} = {product} must divide the trainer's {world} NPUs (trainer.nnodes x "
                "trainer.n_gpus_per_node): Megatron's data parallel size is their quotient")
        if verl_lines.is_server_line(self.line) and "use_mbridge" in (self.get("actor_rollout_ref.actor.megatron")
                                                                      or {}):
            if not is_true(self.get(MEG + "use_mbridge")):
                self.problems.append(
                    f"{self.name(MEG + 'use_mbridge')}: {verl_lines.RELEASES[verl_lines.SERVER]}'s Megatron engine "
                    f"requires {MEG}use_mbridge=True (MegatronEngine.__init__ asserts it)")


def check_command(cmd: Command, line: str, environ: Mapping[str, str], features: Sequence[str] = (),
                  node_npus: Optional[int] = None) -> List[str]:
    """The problems of one verl command on verl config line `line` (empty: it can run)."""
    return Checker(cmd, line, environ, features, node_npus).check().problems


# ------------------------------------------------------------------------------ recipe phases

def model_problems(checker: Checker, line: str) -> Tuple[List[str], List[str]]:
    """The model's config.json against the command (`model_check`): its context limit, its
    `architectures` and their coverage on the recipe's line."""
    from npu_flashrl.recipes import model_check

    model = checker.get("actor_rollout_ref.model.path")
    if model is None or not str(model).strip():
        return [], []
    context = checker.get(RO + "max_model_len")
    if not isinstance(context, int) or isinstance(context, bool):
        prompt = checker.get("data.max_prompt_length")
        response = checker.get("data.max_response_length")
        ints = [v for v in (prompt, response) if isinstance(v, int) and not isinstance(v, bool)]
        context = sum(ints) if len(ints) == 2 else None
    recipe_line = "current" if verl_lines.is_server_line(line) else "pinned"
    return model_check.check(str(model), context, recipe_line, checker.environ)


def lint_problems(cmd: Command, line: str) -> Tuple[List[str], Optional[str]]:
    """(problems, note) of the schema lint against the installed verl when it runs `line`."""
    from npu_flashrl.recipes import lint

    if importlib.util.find_spec("verl") is None:
        return [], "verl is not installed for this interpreter: the overrides were not linted against its schema"
    installed = verl_lines.verl_line()
    if installed != line:
        return [], (f"the installed verl runs the {installed} config line, not this recipe's: overrides not "
                    "linted against its schema")
    try:
        schema = lint.load_schema(cmd.config_name, None, cmd.entry or lint.ENTRY_MODULE)
    except (OSError, ValueError) as exc:  # a verl without its generated reference yaml
        return [], f"verl's config schema not readable ({exc}): overrides not linted"
    return lint.lint(cmd.overrides, schema), None


def installed_line_problem(line: str, hint: str) -> Optional[str]:
    """A real run: the verl this interpreter imports must run the recipe's line."""
    spec = importlib.util.find_spec("verl")
    if spec is None or not spec.submodule_search_locations:
        return f"verl is not importable by {sys.executable} (run {hint}, or set PYTHON)"
    found = verl_lines.verl_line()
    if found == line:
        return None
    if verl_lines.is_server_line(line):
        return (f"this recipe is for {verl_lines.RELEASES[line]} server mode, but {sys.executable} imports a "
                f"verl without it ({verl_lines.RELEASES[found]} or older: use the pinned recipe without "
                f"_verl09, or install the current line: {hint})")
    return (f"this recipe is for {verl_lines.RELEASES[line]} (rollout.mode=sync), but {sys.executable} imports "
            "a server-mode verl (which refuses sync): use the _verl09 recipe")


def vars_phase(environ: Mapping[str, str], features: Sequence[str]) -> Tuple[List[str], List[str], Dict[str, str]]:
    problems, notes, values = V.check_variables(environ, features)
    pg = environ.get("TIS_USE_POLICY_GRADIENT", "")
    if "current" in features and pg.strip().lower() in V.BOOL_TRUE:
        removed = verl_lines.for_line(verl_lines.SERVER).REMOVED["use_policy_gradient"]
        problems.append(f"TIS_USE_POLICY_GRADIENT={pg}: {verl_lines.RELEASES[verl_lines.SERVER]} has no "
                        f"{RC}use_policy_gradient (replaced by {removed}). Fix: {TIS_RECIPE_FIX[verl_lines.SERVER]} "
                        "and leave TIS_USE_POLICY_GRADIENT unset")
    fn, precision = environ.get("FLASHRL_FN") or "int8", environ.get("ROLLOUT_PRECISION")
    if "entry" in features and precision and V.PRECISION_OF_FN.get(fn, precision) != precision:
        problems.append(f"ROLLOUT_PRECISION={precision} with FLASHRL_FN={fn}: the entry sets up a "
                        f"{V.PRECISION_OF_FN[fn]} rollout (npu-flashrl setup --fn {fn}) and would launch it under "
                        f"the {precision} name; unset ROLLOUT_PRECISION (it follows FLASHRL_FN), or run the "
                        f"{precision} recipe")
    if "moe" in features and "entry" in features and environ.get("FLASHRL_FN") in PROFILE_FNS:
        problems.append("FLASHRL_FN=int8: FlashRL's int8 profile has no entries for MoE experts and npu_flashrl "
                        "refuses it for a MoE model; use FLASHRL_FN=int8_profile_free (docs/moe.md)")
    # W4A8 on a MoE recipe: its group size against the experts' split is checked at launch (w4a8_groups)
    return problems, notes, values


def launch_phase(words: Sequence[str], environ: Mapping[str, str], features: Sequence[str], line: str,
                 dry_run: bool, node_npus: Optional[str], hint: str) -> Tuple[List[str], List[str]]:
    problems, notes, _ = V.check_variables(environ, features)
    if node_npus is not None:
        _, problem = V.parse(V.BY_NAME["NPUS_PER_NODE"], node_npus)
        if problem:
            return problems + [problem], notes
        node_npus = int(node_npus)
    cmd = read_words(list(words))
    checker = Checker(cmd, line, environ, features, node_npus).check()
    problems += checker.problems
    found, more = model_problems(checker, line)
    problems += found
    notes += more
    found, more = quant_check.checkpoint_problems(checker)
    problems += found
    notes += more
    found, more = config_check.problems(checker)
    problems += found
    notes += more
    problems += w4a8_groups.problems(checker)
    if not dry_run:
        problem = installed_line_problem(line, hint)
        if problem:
            return problems + [problem], notes
        if "megatron" in features and importlib.util.find_spec("mindspeed") is None:
            problems.append(f"mindspeed is not importable by {sys.executable}: the Megatron backend on NPU "
                            f"needs MindSpeed ({hint} --only mindspeed,megatron_core)")
    if not problems:
        lint_found, note = lint_problems(cmd, line)
        problems += [f"{p} (verl's config schema)" for p in lint_found]
        if note and not dry_run:
            notes.append(note)
    if not problems:
        found, more = verl_own_checks(cmd, line, environ)
        problems += found
        notes += more
    return problems, notes


def verl_own_checks(cmd: Command, line: str, environ: Mapping[str, str]) -> Tuple[List[str], List[str]]:
    """verl's own validation of the composed job (`verl_check`), when the installed verl runs the
    recipe's line. NPU_FLASHRL_PREFLIGHT_VERL=0 skips it (said in a note): it imports verl and so
    torch, some seconds of CPU."""
    raw = environ.get("NPU_FLASHRL_PREFLIGHT_VERL", "1").strip().lower()
    if raw not in V.BOOL_TRUE + V.BOOL_FALSE:
        return [f"NPU_FLASHRL_PREFLIGHT_VERL must be 1 or 0 (also true/false, yes/no, on/off), got {raw!r}"], []
    if raw in V.BOOL_FALSE:
        return [], ["NPU_FLASHRL_PREFLIGHT_VERL=0: verl's own config checks were skipped"]
    if importlib.util.find_spec("verl") is None:
        return [], ["verl is not installed for this interpreter: verl's own config checks did not run"]
    installed = verl_lines.verl_line()
    if installed != line:
        return [], [f"the installed verl runs the {installed} config line, not this recipe's: verl's own config "
                    "checks did not run"]
    from npu_flashrl.recipes import verl_check

    return verl_check.check(cmd, line)


# ------------------------------------------------------------------------------ CLI

def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("phase", choices=("vars", "launch"),
                   help="vars: the recipe variables in the environment; launch: the assembled verl command")
    p.add_argument("--features", default="",
                   help="comma-separated recipe features: entry, fsdp, megatron, moe, async, current")
    p.add_argument("--line", default="pinned", choices=("pinned", "current"), help="the recipe's stack line")
    p.add_argument("--name", default="recipe", help="the recipe's name, for messages")
    p.add_argument("--dry-run", action="store_true", help="the recipe's --dry-run: skip the installed-verl checks")
    p.add_argument("--node-npus", help="NPUS_PER_NODE, the node's size (a separate rollout pool)")
    p.add_argument("--resolve", action="store_true",
                   help="vars: also every variable the recipe reads, defaults filled (printed with their source)")
    p.add_argument("--experiment", default="", help="vars --resolve: EXPERIMENT_NAME's prefix (config scripts)")
    p.add_argument("--hint", default="scripts/install_pinned.sh", help="how to install the line, for messages")
    p.add_argument("command", nargs="*", help="the verl command (launch), after -- (options go before the phase)")


FEATURES = ("entry", "any", "fsdp", "megatron", "moe", "async", "one_step_off", "fully_async")


def run(args) -> int:
    features = [f.strip() for f in args.features.split(",") if f.strip()]
    unknown = [f for f in features if f not in FEATURES]
    if unknown:  # a typo would turn every check into a "not read" note
        print(f"[{args.name}] ERROR: --features {args.features!r}: unknown {', '.join(map(repr, unknown))}; "
              f"known: {', '.join(FEATURES)}", file=sys.stderr)
        return REFUSED
    features.append(args.line)
    words = list(args.command)
    if words[:1] == ["--"]:
        words = words[1:]
    if args.phase == "launch" and not words:
        print(f"[{args.name}] ERROR: preflight launch needs the verl command after `--` "
              "(e.g. -- python3 -m verl.trainer.main_ppo key=value ...)", file=sys.stderr)
        return REFUSED
    environ = os.environ
    values: Dict[str, str] = {}
    job: List[Tuple[str, str, str]] = []
    if args.phase == "vars":
        problems, notes, values = vars_phase(environ, features)
        if args.resolve and not problems:
            problems, _, job = V.resolve_job(environ, features, args.line, args.experiment)
            values = {name: value for name, value, _ in job}
    else:
        problems, notes = launch_phase(words, environ, features, verl_lines.verl_line(args.line), args.dry_run,
                                       args.node_npus, args.hint)
    for note in notes:
        print(f"[{args.name}] note: {note}", file=sys.stderr)
    for problem in problems:
        print(f"[{args.name}] ERROR: {problem}", file=sys.stderr)
    if problems:
        return REFUSED
    if job and "entry" not in features:  # the job as it will run (once: the config script's)
        print(f"[{args.name}] the job's variables (where each value came from, then the value):", file=sys.stderr)
        for name, value, source in job:
            print(f"[{args.name}]   {source:<11}  {name}={value}", file=sys.stderr)
    for name, value in values.items():
        print(f"{name}={value}")
    print("NPU_FLASHRL_PREFLIGHT=ok")  # the shell's proof that the checks ran
    return 0


def main(argv: Optional[Sequence[str]] = None) -> int:
    """`python -m npu_flashrl.recipes.preflight` (what the recipes run: no torch import, unlike the
    full CLI): options anywhere before `--`, the verl command after it."""
    argv = list(sys.argv[1:] if argv is None else argv)
    cut = argv.index("--") if "--" in argv else len(argv)
    p = argparse.ArgumentParser(prog="npu-flashrl preflight", description=HELP)
    add_arguments(p)
    args = p.parse_args(argv[:cut])
    args.command = argv[cut + 1:]
    return run(args)


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
