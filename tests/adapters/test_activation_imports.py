"""Activation imports only what the process it runs in needs (issue 43): `activate()` arms the
patches, imports no vLLM, vllm-ascend, verl (nor verl's device probe) or transformers module, and
each patch is applied when the process imports its module, from that import, without importing
anything itself.

Runs the installed line's real vLLM / vllm-ascend / verl in a fresh process. Stand-in: the
emulated torch_npu (installed before activation, as a real torch_npu would be there)."""
import json
import os
import subprocess
import sys
import textwrap

import pytest
import yaml

pytestmark = pytest.mark.every_line  # each line's patches wait for its own modules

_CHILD = """
    import importlib, json, sys
    from npu_flashrl.kernels import emulation
    from npu_flashrl import lines
    emulation.install(lines.current().emulated_packages)
    heavy = ("vllm", "vllm_ascend", "verl", "transformers")
    def count():
        return {p: sum(1 for m in sys.modules if m == p or m.startswith(p + ".")) for p in heavy}
    before = count()
    import npu_flashrl
    from npu_flashrl import patches
    armed = npu_flashrl.activate(sys.argv[1])
    after = count()
    out = {"before": before, "after": after, "device_probe": "verl.utils.device" in sys.modules,
           "armed": {n: (v if isinstance(v, bool) else list(v.modules)) for n, v in armed.items()},
           "unimportable": {}}
    # then the process imports what a rollout / trainer imports, each patch's modules in turn
    for name, value in armed.items():
        for module in ([] if isinstance(value, bool) else value.modules):
            try:
                importlib.import_module(module)
            except ImportError as exc:  # a dependency this CPU stack lacks (e.g. `datasets`)
                out["unimportable"][module] = f"{type(exc).__name__}: {exc}"
    out["status"] = {p["name"]: p for p in patches.status()}
    print("RESULT" + json.dumps(out, default=str))
"""


def test_activation_imports_no_upstream_and_each_patch_applies_when_its_module_is_imported(tmp_path):
    cfg = tmp_path / "c.yaml"
    cfg.write_text(yaml.safe_dump({"configs": [{"fn": "int8_profile_free"}]}))
    env = dict(os.environ, TORCH_DEVICE_BACKEND_AUTOLOAD="0", VLLM_PLUGINS="none",
               NPU_FLASHRL_NO_AUTOACTIVATE="1", FLASHRL_LOGGING_LEVEL="DEBUG",
               FLASHRL_LMHEAD_FP32="1")  # the lm-head patches too (trainer and rollout side)
    env.pop("FLASHRL_CONFIG", None)
    r = subprocess.run([sys.executable, "-c", textwrap.dedent(_CHILD), str(cfg)], env=env,
                       capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stderr[-4000:]
    out = json.loads(r.stdout.split("RESULT", 1)[1])

    # 1. activation itself: no upstream module, no device probe, every patch armed
    assert out["after"] == out["before"], (out["before"], out["after"])
    assert not out["device_probe"]
    assert out["armed"] and all(out["armed"].values()), out["armed"]
    pending = {n: mods for n, mods in out["armed"].items() if isinstance(mods, list)}
    assert pending, "nothing waited for an import: activation imported the targets itself"

    # 2. each pending patch applied by the import of its modules, nothing imported from a hook
    status = out["status"]
    checked = []
    for name, modules in pending.items():
        if any(m in out["unimportable"] for m in modules):
            assert not status[name]["target"].startswith("vllm"), (name, out["unimportable"])
            continue
        st = status[name]
        assert st["applied"], (name, st, r.stderr[-3000:])
        assert st["refused"] == [], (name, st["refused"])
        assert f"npu_flashrl: patched {name} ->" in r.stderr
        checked.append(name)
    assert any(n.startswith("ascend_") for n in checked), checked  # the rollout's own patches


def test_the_quant_description_patch_is_bound_by_vllms_loader(tmp_path):
    """vLLM's loaders copy get_quant_config as weight_utils' import returns (0.23: default_loader):
    the hook applies the patch before that, so every vLLM module's own name is the wrapper."""
    cfg = tmp_path / "c.yaml"
    cfg.write_text(yaml.safe_dump({"configs": [{"fn": "int8_profile_free"}]}))
    code = """
        import sys
        from npu_flashrl.kernels import emulation
        from npu_flashrl import lines
        emulation.install(lines.current().emulated_packages)
        import npu_flashrl
        from npu_flashrl import patches
        npu_flashrl.activate(sys.argv[1])
        assert "vllm.model_executor.model_loader" not in sys.modules
        import vllm.model_executor.model_loader  # noqa: F401  (its loaders, as a vLLM worker imports them)
        from vllm.model_executor.model_loader import weight_utils
        bound = {n: getattr(m, "get_quant_config") for n, m in list(sys.modules.items())
                 if n.startswith("vllm.") and getattr(m, "get_quant_config", None) is not None}
        assert bound, "no vLLM module holds get_quant_config"  # 0.23: weight_utils and default_loader
        print("BOUND", sorted(n for n, f in bound.items() if patches.original(f) is f))
    """
    env = dict(os.environ, TORCH_DEVICE_BACKEND_AUTOLOAD="0", VLLM_PLUGINS="none",
               NPU_FLASHRL_NO_AUTOACTIVATE="1")
    env.pop("FLASHRL_CONFIG", None)
    r = subprocess.run([sys.executable, "-c", textwrap.dedent(code), str(cfg)], env=env,
                       capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stderr[-4000:]
    assert "BOUND []" in r.stdout, r.stdout[-2000:]  # no vLLM module holds the original
