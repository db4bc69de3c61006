"""verl 51d2104's own worker modules and Hydra config with npu_flashrl active (Megatron / MindSpeed path).

Runs against the pinned verl source tree ``<project root>/../shared/upstream/verl-51d2104`` (read-only,
put first on PYTHONPATH of fresh subprocesses; Hydra reads its ``verl/trainer/config``). Without it the
tests skip and say how to get it.

* Worker imports (fresh process each): ``import verl.workers.fsdp_workers`` and ``import
  verl.workers.megatron_workers`` after the recipes' Ray hook (``npu_flashrl.activation.worker_process_setup``
  with FLASHRL_CONFIG set) on an NPU host, with and without MindSpeed. verl imports Megatron in every
  worker (``verl/workers/engine/__init__.py`` via ``verl.utils.checkpoint``), so an FSDP job must import
  whatever MindSpeed's state; a Megatron worker's ``__init__`` is where a missing MindSpeed is refused.
* Hydra: verl 51d2104's real ``ppo_megatron_trainer`` / ``ppo_trainer`` composed (hydra's compose API)
  with the recipes' ``--dry-run`` overrides plus every override docs/megatron.md and the adapter's error
  messages recommend.

Stand-ins (only for what needs an NPU or is not in the CPU stack):

* MindSpeed: ``mindspeed/megatron_adaptor.py`` written into tmp_path (the real one needs torch_npu/CANN).
  Like the real adaptor it imports ``megatron.core``; it records which megatron modules were imported
  before it and the configs ``repatch`` gets.
* NPU host: npu_flashrl's torch_npu emulation (npu_flashrl/kernels/emulation.py) with
  ``torch.npu.is_available`` returning True (verl's ``is_npu_available``) and the emulation's
  ``__npu_flashrl_emulated__`` mark cleared (npu_flashrl's own torch_npu probe then sees an NPU).
* ``peft`` and ``datasets``, only when this interpreter lacks them (verl imports them at module level;
  the CPU stack does not install them): modules with just the names verl imports, placed LAST on the
  path so real installs win.
* No cluster: verl's worker ``__init__`` runs until its distributed set-up asks torch for HCCL.
"""
from __future__ import annotations

import importlib.machinery
import json
import os
import re
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from npu_flashrl.adapters import megatron as M
from npu_flashrl.adapters.megatron import import_guard, output_layer, stream
from npu_flashrl.recipes.command import read_command

pytestmark = pytest.mark.every_line

from conftest import upstream_tree  # noqa: E402  (tests/conftest.py: ../shared/upstream or skip)

ROOT = Path(__file__).resolve().parents[3]
EX = ROOT / "tests" / "verl_examples"


def verl_src() -> Path:
    return Path(upstream_tree("verl-51d2104"))


MINDSPEED_STANDIN = '''"""Stand-in for MindSpeed's mindspeed/megatron_adaptor.py (the real one needs torch_npu/CANN)."""
import sys
MEGATRON_BEFORE = sorted(k for k in sys.modules if k == "megatron" or k.startswith("megatron."))
REPATCHED = []
def repatch(cfg):
    REPATCHED.append(dict(cfg))
import megatron.core  # the real adaptor patches megatron modules on import
'''

# verl 51d2104 imports these at module level (fsdp_workers: `from peft import LoraConfig, TaskType,
# get_peft_model`; verl.utils.dataset: `import datasets`); nothing here calls them.
MISSING_DEPS = {
    "peft": '"""Stand-in for peft (not in the CPU stack)."""\nclass LoraConfig: pass\n'
            'class TaskType:\n    CAUSAL_LM = "CAUSAL_LM"\n'
            'def get_peft_model(*a, **k):\n    raise NotImplementedError("peft stand-in")\n',
    "datasets": '"""Stand-in for datasets (not in the CPU stack)."""\nclass Dataset: pass\n',
}


@pytest.fixture()
def paths(tmp_path):
    ms = tmp_path / "mindspeed_standin"
    (ms / "mindspeed").mkdir(parents=True)
    (ms / "mindspeed" / "__init__.py").write_text('"""Stand-in MindSpeed package."""\n')
    (ms / "mindspeed" / "megatron_adaptor.py").write_text(MINDSPEED_STANDIN)
    deps = tmp_path / "missing_deps"
    deps.mkdir()
    for name, text in MISSING_DEPS.items():
        # installed on the path the subprocess gets: a stand-in module an earlier test left in
        # this process's sys.modules says nothing about it
        if importlib.machinery.PathFinder.find_spec(name) is None:
            (deps / name).mkdir()
            (deps / name / "__init__.py").write_text(text)
    return {"verl": str(verl_src()), "mindspeed": str(ms), "deps": str(deps)}


PROBE = r'''
import importlib, json, os, sys
from npu_flashrl.kernels import emulation
from npu_flashrl import lines
emulation.install(lines.current().emulated_packages)  # torchair where the line's vllm-ascend imports it
import torch, torch_npu
torch.npu.is_available = lambda: True            # NPU host stand-in (see the module docstring)
torch_npu.__npu_flashrl_emulated__ = False
from npu_flashrl import activation, patches
activation.worker_process_setup()                # the recipes' Ray worker_process_setup_hook
out = {}
if EARLY_MCORE:
    import verl.models.mcore                     # a verl module importing megatron before MindSpeed
try:
    mod = importlib.import_module(MODULE)
    out["imported"] = True
except Exception as e:
    out["imported"] = f"{type(e).__name__}: {e}"
    print("RESULT", json.dumps(out))
    sys.exit(0)
import megatron.core.tensor_parallel
out["megatron_core_attr"] = sys.modules["megatron"].core is sys.modules["megatron.core"]
out["tensor_parallel"] = megatron.core.tensor_parallel.ColumnParallelLinear.__name__
adaptor = sys.modules.get("mindspeed.megatron_adaptor")
out["megatron_before_adaptor"] = None if adaptor is None else adaptor.MEGATRON_BEFORE
out["applied"] = sorted(p["name"] for p in patches.status() if p["applied"])
if MODULE == "verl.workers.megatron_workers":
    out["wrapped"] = bool(getattr(mod.ActorRolloutRefWorker.__init__, "__npu_flashrl_megatron__", False))
    out["stream_wrapped"] = bool(getattr(mod.per_tensor_generator, "__npu_flashrl_megatron__", False))
    from omegaconf import OmegaConf
    cfg = OmegaConf.create({
        "model": {"use_fused_kernels": FUSED},
        "actor": {"use_fused_kernels": FUSED,
                  "megatron": {"override_transformer_config": {"use_flash_attn": True}, "use_mbridge": False}},
        "ref": {"use_fused_kernels": False}})
    try:
        mod.ActorRolloutRefWorker(cfg, role="actor_rollout")
        out["init"] = "built"
    except BaseException as e:
        out["init"] = f"{type(e).__name__}: {e}"
    out["repatched"] = getattr(adaptor, "REPATCHED", None)
print("RESULT", json.dumps(out))
'''


def probe(paths, module, mindspeed, early_mcore=False, fused=False, lmhead="1"):
    from npu_flashrl.sim.cpu_vllm import free_port

    prefix = [str(ROOT), paths["verl"]] + ([paths["mindspeed"]] if mindspeed else [])
    env = {k: v for k, v in os.environ.items() if not k.startswith(("FLASHRL_", "NPU_FLASHRL"))}
    env.update(PYTHONPATH=os.pathsep.join(prefix + [os.environ.get("PYTHONPATH", ""), paths["deps"]]),
               PYTHONWARNINGS="ignore", TORCH_DEVICE_BACKEND_AUTOLOAD="0", VLLM_PLUGINS="none",
               FLASHRL_CONFIG="int8_profile_free", FLASHRL_LMHEAD_FP32=lmhead, NPU_FLASHRL_NO_AUTOACTIVATE="1",
               WORLD_SIZE="1", RANK="0", LOCAL_RANK="0", MASTER_ADDR="127.0.0.1", MASTER_PORT=str(free_port()))
    code = (PROBE.replace("EARLY_MCORE", repr(early_mcore)).replace("MODULE", repr(module))
            .replace("FUSED", repr(fused)))
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=600)
    lines = [l for l in r.stdout.splitlines() if l.startswith("RESULT ")]
    assert r.returncode == 0 and lines, f"probe failed ({r.returncode}):\n{r.stdout[-2000:]}\n{r.stderr[-4000:]}"
    return json.loads(lines[-1][len("RESULT "):]), r.stderr


# --------------------------------------------------------------------------- worker imports

def test_fsdp_worker_imports_on_npu_without_mindspeed(paths):
    """The FSDP job on an NPU host with megatron-core installed and no MindSpeed: verl imports
    Megatron; npu_flashrl must not refuse it."""
    out, _ = probe(paths, "verl.workers.fsdp_workers", mindspeed=False)
    assert out["imported"] is True, out["imported"]
    assert out["megatron_core_attr"] and out["tensor_parallel"] == "ColumnParallelLinear"
    assert out["megatron_before_adaptor"] is None
    assert M.PATCH_GUARD in out["applied"]


def test_fsdp_worker_imports_mindspeed_first(paths):
    out, _ = probe(paths, "verl.workers.fsdp_workers", mindspeed=True)
    assert out["imported"] is True, out["imported"]
    assert out["megatron_before_adaptor"] == []          # verl's engine/__init__ + the guard: MindSpeed first
    assert out["megatron_core_attr"]


def test_megatron_worker_without_mindspeed_refused_at_init(paths):
    """Importing verl's Megatron worker module works; building the Megatron actor is refused."""
    out, _ = probe(paths, "verl.workers.megatron_workers", mindspeed=False)
    assert out["imported"] is True, out["imported"]
    assert out["wrapped"] and out["stream_wrapped"]
    assert out["init"].startswith("MindSpeedMissingError: verl's Megatron backend"), out["init"]
    assert "git checkout" in out["init"] and "strategy=fsdp" in out["init"]


@pytest.mark.parametrize("early_mcore", [False, True], ids=["verl_order", "megatron_imported_early"])
def test_megatron_worker_with_mindspeed(paths, early_mcore):
    """With MindSpeed: the adaptor comes before any megatron module, also when a verl module imports
    megatron first (then it is the guard that imports the adaptor, and `megatron` must stay the
    module the adaptor loaded); the worker passes npu_flashrl's checks and reaches verl's repatch."""
    out, _ = probe(paths, "verl.workers.megatron_workers", mindspeed=True, early_mcore=early_mcore)
    assert out["imported"] is True, out["imported"]
    assert out["megatron_before_adaptor"] == []
    assert out["megatron_core_attr"] and out["tensor_parallel"] == "ColumnParallelLinear"
    assert out["repatched"] == [{"use_flash_attn": True}], out
    # then verl's own distributed set-up on the NPU host stand-in: HCCL, which CPU torch lacks
    assert "hccl" in out["init"], out["init"]


def test_megatron_worker_refuses_fused_kernels_with_fp32_lmhead(paths):
    out, _ = probe(paths, "verl.workers.megatron_workers", mindspeed=True, fused=True)
    assert out["init"].startswith("FusedKernelsConflict: FLASHRL_LMHEAD_FP32=1 with "
                                  "actor_rollout_ref.model.use_fused_kernels=True"), out["init"]
    assert out["repatched"] == []                         # refused before verl's own __init__ ran


# --------------------------------------------------------------------------- Hydra composition

# a Hydra override of one of verl's top-level config groups, as written in docs and messages
_OVERRIDE = re.compile(r"(?<![\w.+])(\+{0,2}(?:actor_rollout_ref|ray_kwargs|trainer|algorithm|data|critic|"
                       r"reward_model)\.[\w.]+=[^\s`'\",;)]+)")


def recommended_overrides():
    """Every Hydra override docs/megatron.md (its pinned-line sections; section 5 is verl 0.9.1's
    engine, whose keys such as `vanilla_mbridge` verl 51d2104 does not have) and the Megatron
    adapter's error messages recommend."""
    doc = (ROOT / "docs" / "megatron.md").read_text(encoding="utf-8")
    current = doc.find("\n## 5. Current line")
    assert current > 0, "docs/megatron.md: the current line's section 5 heading moved"
    texts = [doc[:current],
             str(import_guard._order_error("megatron was imported first")), import_guard.missing_message(),
             str(stream.unsupported_message({"architectures": ["DeepseekV3ForCausalLM"]}))]
    try:
        output_layer.check_fused_kernels({"model": {"use_fused_kernels": True}}, environ={"FLASHRL_LMHEAD_FP32": "1"})
    except M.FusedKernelsConflict as exc:
        texts.append(str(exc))
    found = []
    for text in texts:
        for ov in _OVERRIDE.findall(text):
            if ov not in found:
                found.append(ov)
    return found


def recipe_overrides(script, tmp_path):
    model = tmp_path / "models" / "Qwen2.5-7B-Instruct"
    model.mkdir(parents=True)
    (model / "config.json").write_text("{}")
    (tmp_path / "models" / "Qwen2.5-7B-Instruct-W8A8").mkdir()
    data = tmp_path / "data"
    data.mkdir()
    for f in ("train.parquet", "test.parquet"):
        (data / f).write_bytes(b"")
    env = {k: v for k, v in os.environ.items() if not k.startswith(("FLASHRL_", "NPU_FLASHRL", "RAY_"))}
    env.update(HOME=str(tmp_path / "home"), MODEL_PATH=str(model), DATA_DIR=str(data), RUN_DIR=str(tmp_path / "run"),
               PYTHON=sys.executable)  # the recipes' preflight runs with it
    r = subprocess.run(["bash", str(script), "--dry-run"], env=env, capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, r.stderr
    cmd = read_command(r.stdout)  # npu_flashrl's one reading of a verl command
    return cmd.config_name, cmd.overrides


@pytest.mark.parametrize("script", ["grpo_qwen25_7b_megatron_int8_A2.sh", "grpo_qwen25_7b_fsdp_int8_A2.sh"])
def test_recommended_overrides_compose_with_the_recipe(tmp_path, script):
    pytest.importorskip("hydra")
    from hydra import compose, initialize_config_dir
    from hydra.errors import ConfigCompositionException

    config_dir = str(verl_src() / "verl" / "trainer" / "config")
    name, recipe = recipe_overrides(EX / "flash_rl" / script, tmp_path)
    hook = "ray_kwargs.ray_init.runtime_env.worker_process_setup_hook"
    assert f"+{hook}={M.RAY_HOOK}" in recipe                      # the recipe sets the hook itself
    extra = recommended_overrides()
    assert M.RAY_HOOK_OVERRIDE in extra and "actor_rollout_ref.model.use_fused_kernels=False" in extra, extra
    with initialize_config_dir(config_dir=config_dir, version_base=None):
        cfg = compose(config_name=name, overrides=recipe + extra)
        assert cfg.ray_kwargs.ray_init.runtime_env.worker_process_setup_hook == M.RAY_HOOK
        alone = compose(config_name=name, overrides=[M.RAY_HOOK_OVERRIDE])   # own launch command
        assert alone.ray_kwargs.ray_init.runtime_env.worker_process_setup_hook == M.RAY_HOOK
        # what the docs used to recommend: Hydra refuses to append a key the recipe already added
        old = f"+{hook}=npu_flashrl.adapters.megatron.worker_process_setup"
        with pytest.raises(ConfigCompositionException, match="Could not append"):
            compose(config_name=name, overrides=recipe + [old])
