"""A required patch that fails inside the user's import of its target (issue 43): the import
succeeds, `npu-flashrl verify` fails the patch's row with the reason, and the INT8 engine build
refuses instead of running bf16.

Real upstream code: vLLM's plugin loader activates npu_flashrl in a fresh process, vLLM's own
modules are imported, vLLM's `EngineArgs.create_engine_config` is called through the engine patch.
Stand-ins: torch_npu is emulated (`kernels.emulation`); the INT8 loader patch's apply function is
replaced, before vLLM's model loader is imported, by one raising the AttributeError an upstream
rename of `initialize_model` would give (no installed vLLM lacks it)."""
import os
import subprocess
import sys
import textwrap

import pytest
import yaml

pytestmark = pytest.mark.every_line  # the line's own patches and vLLM's import graph


def test_a_required_patch_failing_in_the_import_hook_makes_the_int8_engine_refuse(tmp_path):
    from npu_flashrl.sim.tiny_models import build_tiny_qwen2

    model = tmp_path / "model"
    build_tiny_qwen2(str(model))  # EngineArgs reads its config before the engine patch's wrapper runs
    cfg = tmp_path / "c.yaml"
    cfg.write_text(yaml.safe_dump({"configs": [{"fn": "int8_profile_free", "load_format": "auto"}]}))
    code = """
        import sys
        from npu_flashrl.kernels import emulation
        from npu_flashrl import lines
        emulation.install(lines.current().emulated_packages)
        from vllm.plugins import load_general_plugins
        load_general_plugins()
        from npu_flashrl import patches, verify
        attach = patches.get(lines.current().PATCH_ATTACH)
        print("PENDING", bool(attach.pending))
        def renamed():
            raise AttributeError("module 'base_loader' has no attribute 'initialize_model'")
        attach.apply_fn = renamed
        import vllm.model_executor.model_loader  # imports base_loader: the hook fails, not the import
        print("IMPORTED", attach.applied, attach.error)
        row = next(r for r in verify.patch_rows() if r["check"] == "patch " + attach.name)
        print("ROW", row["status"], row["detail"])
        from vllm.engine.arg_utils import EngineArgs
        try:
            EngineArgs(model=sys.argv[1], distributed_executor_backend="external_launcher"
                       ).create_engine_config()
        except patches.RequiredPatchError as exc:
            print("REFUSED", exc)
        else:
            print("BUILT")
    """
    env = dict(os.environ, TORCH_DEVICE_BACKEND_AUTOLOAD="0", NPU_FLASHRL_NO_AUTOACTIVATE="1",
               FLASHRL_CONFIG=str(cfg), VLLM_PLUGINS="npu_flashrl")
    r = subprocess.run([sys.executable, "-c", textwrap.dedent(code), str(model)], env=env, capture_output=True,
                       text=True, timeout=300)
    assert r.returncode == 0, r.stderr[-3000:]
    out = dict(line.split(" ", 1) for line in r.stdout.splitlines() if " " in line)
    assert out["PENDING"] == "True"  # armed by the plugin, applied by the import
    assert out["IMPORTED"] == ("False AttributeError: module 'base_loader' has no attribute "
                               "'initialize_model'")
    assert out["ROW"].startswith("FAIL not applied: AttributeError") and "engine build refuses" in out["ROW"]
    assert "cannot patch model_loader_int8_load_weights" in r.stderr  # the WARNING
    refused = out.get("REFUSED", "")
    assert "the vLLM engine build refused" in refused and "model_loader_int8_load_weights" in refused \
        and "initialize_model" in refused, r.stdout
