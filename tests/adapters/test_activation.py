"""Activation: vLLM plugin entry point in a fresh process, idempotence, engine config rewrite,
hybrid entries, and the refusal of engines a FlashRL-style sync would not reach."""
import os
import subprocess
import sys
import textwrap
import types

import pytest
import yaml

from npu_flashrl.adapters import vllm_engine

pytestmark = pytest.mark.every_line  # line-specific upstream code: runs on every stack line


def _write_config(path, entries):
    with open(path, "w") as f:
        yaml.safe_dump({"configs": entries}, f)
    return str(path)


def _run(code, env_extra, timeout=240):
    env = dict(os.environ)
    # the emulation must be installed before activation imports vllm_ascend: no import-time
    # activation in these child processes (the plugin path is what is tested)
    env.update(TORCH_DEVICE_BACKEND_AUTOLOAD="0", FLASHRL_LOGGING_LEVEL="DEBUG",
               NPU_FLASHRL_NO_AUTOACTIVATE="1")
    env.update(env_extra)
    return subprocess.run([sys.executable, "-c", textwrap.dedent(code)], env=env, capture_output=True,
                          text=True, timeout=timeout)


def test_plugin_entry_point_activates_in_a_fresh_process(tmp_path):
    cfg = _write_config(tmp_path / "c.yaml", [{"fn": "int8_profile_free", "load_format": "auto"}])
    code = """
        from npu_flashrl.kernels import emulation
        from npu_flashrl import lines
        emulation.install(lines.current().emulated_packages)  # torchair where the line's vllm-ascend imports it
        from vllm.plugins import load_general_plugins
        load_general_plugins()
        load_general_plugins()          # vLLM may load plugins more than once per process
        import npu_flashrl.activation as a
        a.activate()                    # and users may import/activate on top: still once
        from npu_flashrl import lines, patches
        pending = sorted(p["name"] for p in patches.status() if p["pending"])
        # what the vLLM process then imports as it builds the engine and the model
        import importlib
        line = lines.current()
        for module in ("vllm.engine.arg_utils", "vllm.model_executor.model_loader") + line.scheme_modules():
            importlib.import_module(module)
        a.activate()
        st = {p["name"]: p["applied"] for p in patches.status()}
        print("PENDING", pending)
        print("STATUS", sorted(k for k, v in st.items() if v))
    """
    r = _run(code, {"FLASHRL_CONFIG": cfg, "VLLM_PLUGINS": "npu_flashrl"})
    assert r.returncode == 0, r.stderr[-3000:]
    pending = eval(r.stdout.split("PENDING", 1)[1].split("\n", 1)[0].strip())
    applied = eval(r.stdout.split("STATUS", 1)[1].strip())
    for name in ("ascend_quant_description", "model_loader_int8_load_weights",
                 "ascend_w8a8_dynamic_process_once", "vllm_engine_flashrl_config"):
        assert name in applied
    assert "ascend_w8a8_dynamic_process_once" in pending  # armed by the plugin, applied by the import
    # exactly one DEBUG line per applied patch, whatever the number of activations
    lines = [l for l in r.stderr.splitlines() if "npu_flashrl: patched ascend_quant_description ->" in l]
    assert len(lines) == 1, r.stderr[-3000:]


def test_without_flashrl_config_the_plugin_does_nothing():
    code = """
        from npu_flashrl.kernels import emulation
        from npu_flashrl import lines
        emulation.install(lines.current().emulated_packages)  # torchair where the line's vllm-ascend imports it
        from vllm.plugins import load_general_plugins
        load_general_plugins()
        from npu_flashrl import patches
        print("APPLIED", [p["name"] for p in patches.status() if p["applied"]])
    """
    env = {"VLLM_PLUGINS": "npu_flashrl"}
    r = _run(code, env | {"FLASHRL_CONFIG": ""})
    assert r.returncode == 0, r.stderr[-3000:]
    assert "APPLIED []" in r.stdout


def test_config_pointing_nowhere_fails_loudly_in_the_plugin(tmp_path):
    code = """
        from npu_flashrl.kernels import emulation
        from npu_flashrl import lines
        emulation.install(lines.current().emulated_packages)  # torchair where the line's vllm-ascend imports it
        from npu_flashrl.plugin import register
        register()
    """
    missing = str(tmp_path / "nope.yaml")
    r = _run(code, {"FLASHRL_CONFIG": missing, "VLLM_PLUGINS": "none",
                    "NPU_FLASHRL_NO_AUTOACTIVATE": "1"})
    assert r.returncode != 0
    assert "nope.yaml" in r.stderr


def _engine_args(**kw):
    base = dict(model="/models/bf16", tokenizer=None, tensor_parallel_size=2, pipeline_parallel_size=1,
                distributed_executor_backend="external_launcher", load_format="dummy", quantization=None)
    base.update(kw)
    return types.SimpleNamespace(**base)


def test_engine_args_follow_the_config_entry(tmp_path, monkeypatch):
    from npu_flashrl.config import load_config

    cfg = load_config(_write_config(tmp_path / "c.yaml", [
        {"fn": "int8_profile_free", "load_format": "auto", "model": "/models/other"}]))
    args = _engine_args()
    entry = vllm_engine.apply_entry(args, cfg)
    assert args.quantization == "ascend"
    assert args.model == "/models/other" and args.tokenizer == "/models/bf16"
    assert args.load_format == "auto"
    assert vllm_engine.engine_choice(args) == vllm_engine.EngineChoice(fn="int8_profile_free")
    assert entry.fn == "int8_profile_free"


def test_hybrid_config_assigns_entries_by_dp_group(tmp_path, monkeypatch):
    from npu_flashrl.config import load_config

    cfg = load_config(_write_config(tmp_path / "h.yaml", [
        {"fn": "int8_profile_free", "load_format": "auto"}, {"fn": "bf16", "load_format": "auto"}]))
    seen = {}
    for rank in range(8):  # TP=2: ranks 0-1 are DP group 0, 2-3 group 1, ...
        monkeypatch.setenv("RANK", str(rank))
        args = _engine_args()
        seen[rank] = (vllm_engine.apply_entry(args, cfg).fn, args.quantization,
                      vllm_engine.engine_choice(args).fn, vllm_engine.engine_choice(args).rank)
    assert [seen[r][0] for r in range(8)] == ["int8_profile_free"] * 2 + ["bf16"] * 2 + \
        ["int8_profile_free"] * 2 + ["bf16"] * 2
    assert seen[2][1] is None and seen[2][2] is None   # bf16 groups stay unquantized
    assert seen[0][1] == "ascend" and seen[0][2] == "int8_profile_free"
    assert [seen[r][3] for r in range(8)] == [0, 0, 1, 1, 2, 2, 3, 3]  # each engine's own choice
    assert vllm_engine.engine_choice(_engine_args(additional_config={})) is None


@pytest.mark.parametrize("backend", ["mp", "ray", None])
def test_async_style_engine_is_refused_with_the_fix(tmp_path, backend):
    from npu_flashrl.config import load_config

    cfg = load_config(_write_config(tmp_path / "c.yaml", [{"fn": "int8_profile_free"}]))
    with pytest.raises(RuntimeError, match=r"actor_rollout_ref\.rollout\.mode=sync"):
        vllm_engine.apply_entry(_engine_args(distributed_executor_backend=backend), cfg)


def test_ray_worker_setup_hook_activates_trainer_side_patches(tmp_path):
    cfg = _write_config(tmp_path / "c.yaml", [{"fn": "int8_profile_free", "load_format": "auto"}])
    code = """
        from npu_flashrl.kernels import emulation
        from npu_flashrl import lines
        emulation.install(lines.current().emulated_packages)  # torchair where the line's vllm-ascend imports it
        from npu_flashrl.activation import worker_process_setup
        worker_process_setup()
        from npu_flashrl import patches
        armed = sorted(p["name"] for p in patches.status() if p["pending"] or p["applied"])
        # what a trainer / rollout worker then imports: each armed patch applies with its module
        import importlib
        for p in patches.status():
            for module in p["pending"]:
                try:
                    importlib.import_module(module)
                except ImportError:  # a dependency this CPU stack lacks (e.g. `datasets`)
                    pass
        print("ARMED", armed)
        print("APPLIED", sorted(p["name"] for p in patches.status() if p["applied"]))
    """
    r = _run(code, {"FLASHRL_CONFIG": cfg, "FLASHRL_LMHEAD_FP32": "1", "VLLM_PLUGINS": "none"})
    assert r.returncode == 0, r.stderr[-3000:]
    armed = r.stdout.split("ARMED", 1)[1].split("APPLIED", 1)[0]
    applied = r.stdout.split("APPLIED", 1)[1]
    for name in ("transformers_lmhead_fp32", "vllm_lmhead_fp32_compute", "model_loader_int8_load_weights",
                 "verl_rollout_corr_metrics"):
        assert name in armed, name
    for name in ("transformers_lmhead_fp32", "vllm_lmhead_fp32_compute", "model_loader_int8_load_weights",
                 "verl_rollout_corr_metrics"):
        assert name in applied, name
