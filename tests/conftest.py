"""Test harness: the real upstream code on CPU with emulated torch_npu.

Environment is fixed here before anything imports torch or vLLM: no torch device-backend
autoload (a stray torch_npu would break `import torch`), and vLLM plugins only as a test asks.
"""
import os

os.environ.setdefault("TORCH_DEVICE_BACKEND_AUTOLOAD", "0")
os.environ.setdefault("VLLM_PLUGINS", "none")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
os.environ.pop("FLASHRL_CONFIG", None)

# Optional: run against a vllm-ascend SOURCE TREE instead of the installed distribution, e.g. the
# pinned v0.10.1rc1 line (no wheel exists): NPU_FLASHRL_VLLM_ASCEND_SRC=<dir containing
# vllm_ascend/>. Prepended to sys.path here, before any test imports vllm_ascend; also exported
# through PYTHONPATH so subprocesses the tests start see the same tree.
_VLLM_ASCEND_SRC = os.environ.get("NPU_FLASHRL_VLLM_ASCEND_SRC")
if _VLLM_ASCEND_SRC:
    import sys

    _VLLM_ASCEND_SRC = os.path.abspath(_VLLM_ASCEND_SRC)
    if not os.path.isdir(os.path.join(_VLLM_ASCEND_SRC, "vllm_ascend")):
        raise RuntimeError(f"NPU_FLASHRL_VLLM_ASCEND_SRC={_VLLM_ASCEND_SRC} has no vllm_ascend/ "
                           "package directory")
    if "vllm_ascend" in sys.modules:
        raise RuntimeError("vllm_ascend was imported before tests/conftest.py could put "
                           f"{_VLLM_ASCEND_SRC} first on sys.path")
    if _VLLM_ASCEND_SRC not in sys.path:
        sys.path.insert(0, _VLLM_ASCEND_SRC)
    _pp = os.environ.get("PYTHONPATH", "")
    if _VLLM_ASCEND_SRC not in _pp.split(os.pathsep):
        os.environ["PYTHONPATH"] = _VLLM_ASCEND_SRC + (os.pathsep + _pp if _pp else "")


import sys  # noqa: E402

# tests/support (shared helpers: `helpers`, `models_checks`, ...) importable from every test folder
# and from the scripts the tests start (through PYTHONPATH).
SUPPORT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "support")
if SUPPORT not in sys.path:
    sys.path.insert(0, SUPPORT)

import logging  # noqa: E402

import pytest  # noqa: E402  (after the environment is fixed)

_ROOT_LEVEL = logging.getLogger().level  # before any upstream import changes it

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
# The pinned line's upstream trees (no registry release); a user's clone has no ../shared.
# NPU_FLASHRL_UPSTREAM points elsewhere (e.g. from a git worktree, whose ../shared is not there).
SHARED_UPSTREAM = os.environ.get("NPU_FLASHRL_UPSTREAM") or os.path.join(os.path.dirname(ROOT), "shared", "upstream")
UPSTREAM_TREES = {
    "verl-51d2104": ("https://github.com/volcengine/verl", "51d2104ecb61563c41123a8f0bce2f06b18387dc"),
    "vllm-ascend-v0.10.1rc1": ("https://github.com/vllm-project/vllm-ascend",
                               "7e16b4a7cdb15723c63c1c0efe58672a056eace8"),
}


def pytest_configure(config):
    config.addinivalue_line(
        "markers", "every_line: runs on every CPU test-stack line (scripts/test.sh), not only the "
        "primary one: the test exercises line-specific upstream code")


# What a pinned tree imports that a newer stack line lacks (the current line's transformers 5
# dropped `AutoModelForVision2Seq`, which verl 51d2104 imports at module level).
UPSTREAM_NEEDS = {"verl-51d2104": ("transformers", "AutoModelForVision2Seq")}


def upstream_tree(name: str) -> str:
    """Path of a pinned upstream source tree in ../shared/upstream, or skip saying how to get it
    (or that this stack line cannot import it)."""
    path = os.path.join(SHARED_UPSTREAM, name)
    if not os.path.isdir(path):
        url, commit = UPSTREAM_TREES[name]
        pytest.skip(f"{path} not found: git clone {url} and check out {commit} there "
                    "(read-only; never copy it into the project)")
    if name in UPSTREAM_NEEDS:
        import importlib

        module, attr = UPSTREAM_NEEDS[name]
        mod = importlib.import_module(module)
        if not hasattr(mod, attr):
            pytest.skip(f"{name} imports {module}.{attr}, which {module} "
                        f"{getattr(mod, '__version__', '?')} of this stack line does not have")
    return path


@pytest.fixture(scope="session")
def verl_51d2104():
    """verl 51d2104's own source tree first on sys.path (and PYTHONPATH, for subprocesses); returns
    the tree. Skips when the tree is missing, or when another verl (e.g. the 0.11 line's 0.6.1) was
    imported before: one process cannot hold both, run the module alone or on the pinned line."""
    import sys

    tree = os.path.realpath(upstream_tree("verl-51d2104"))
    loaded = sys.modules.get("verl")
    if loaded is not None and not os.path.realpath(getattr(loaded, "__file__", None) or "").startswith(tree + os.sep):
        pytest.skip(f"verl {loaded.__file__} was imported first; verl 51d2104 runs on the pinned line "
                    "or with this test module run on its own")
    if tree not in sys.path:
        sys.path.insert(0, tree)
    pp = os.environ.get("PYTHONPATH", "")
    if tree not in pp.split(os.pathsep):
        os.environ["PYTHONPATH"] = tree + (os.pathsep + pp if pp else "")
    import verl

    assert os.path.realpath(verl.__file__).startswith(tree + os.sep), verl.__file__
    return tree


@pytest.fixture(scope="module")
def va():
    """The vllm-ascend adapter with its patches applied on the CPU harness (emulated torch_npu);
    models built in the test with an INT8 choice (`CpuVllm(choice=cpu_vllm.int8(...))`, what the
    engine patch records for the policy rollout) get the online INT8 loader."""
    from npu_flashrl import patches
    from npu_flashrl.sim import cpu_vllm

    cpu_vllm.prepare_process()
    from npu_flashrl.adapters import vllm_ascend

    patches.apply_patches(list(vllm_ascend.PATCHES))
    return vllm_ascend


@pytest.fixture(scope="session")
def rehearsal_cache(tmp_path_factory):
    """One `npu-flashrl rehearse --cache-dir` for the session: the tiny model is pre-trained by the
    first rehearsal that runs (tests/rehearsal/test_rehearsal.py in file order) and reused by the others."""
    return tmp_path_factory.mktemp("rehearsal-cache")


@pytest.fixture(autouse=True)
def _npu_flashrl_logging_restored():
    """A test that configures npu_flashrl's own handler (FLASHRL_LOGGING_LEVEL / _FILE in this
    process) leaves the `npu_flashrl` logger non-propagating: restore the default (propagate to
    the root, no handler of ours, no level) after it, so later tests' caplog sees our lines.
    The root's level too: importing vLLM 0.23's API server imports model_hosting_container_standards,
    which sets the root logger to ERROR (its LOG_LEVEL default), and every later test that expects
    one of our WARNINGs would see none (docs/configuration.md, FLASHRL_LOGGING_LEVEL)."""
    yield
    import logging

    if logging.getLogger().level != _ROOT_LEVEL:
        logging.getLogger().setLevel(_ROOT_LEVEL)
    lg = logging.getLogger("npu_flashrl")
    if not lg.propagate or lg.handlers or lg.level != logging.NOTSET:
        for h in list(lg.handlers):
            lg.removeHandler(h)
        lg.propagate = True
        lg.setLevel(logging.NOTSET)


@pytest.fixture(scope="module", autouse=True)
def _verl_npu_fused_moe_loader_unwrapped():
    """The first import of `verl.utils.vllm` in this process (verl's worker extension, its rollout
    server, `npu_flashrl.sim.verl_transfer.make_worker`) runs verl's `apply_npu_vllm_patches`,
    which on an NPU (the emulated torch.npu here) wraps vLLM's `FusedMoE.weight_loader` class-wide
    for the rest of the process. The wrapper transposes any expert parameter whose dim 1 (w1/w3) or
    dim 2 (w2) equals hidden_size: a later module's model with hidden == moe_intermediate (the W4A8
    Qwen3-MoE of tests/support/w4a8_moe_models.py) has its w2 experts loaded transposed. Unwrap it
    after each module (only verl's marked wrapper; vLLM's loader and any other wrapper stay)."""
    yield
    fused_moe = sys.modules.get("vllm.model_executor.layers.fused_moe")
    FusedMoE = getattr(fused_moe, "FusedMoE", None)
    if not isinstance(FusedMoE, type):
        return
    loader = FusedMoE.__dict__.get("weight_loader")
    unwrapped = loader
    while getattr(unwrapped, "_verl_npu_weight_loader_patched", False) and hasattr(unwrapped, "__wrapped__"):
        unwrapped = unwrapped.__wrapped__
    if unwrapped is not loader:
        FusedMoE.weight_loader = unwrapped
