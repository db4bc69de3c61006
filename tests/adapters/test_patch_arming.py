"""Patches armed by activation (`patches.arm_patch`): applied at once when their module is
imported, else right after its import, inside it, importing nothing themselves.

Stand-ins: tiny modules written to tmp_path play the upstream targets (what is tested is the
import machinery, not an upstream module); the patches are registered under test-only names and
removed from the registry afterwards."""
import importlib
import inspect
import sys

import pytest
import yaml

from npu_flashrl import patches, verify
from npu_flashrl.adapters import vllm_engine
from npu_flashrl.config import load_config
from npu_flashrl.errors import UnquantizedRolloutError


@pytest.fixture
def pkg(tmp_path, monkeypatch):
    """A fresh tmp_path on sys.path; the test's modules and patches (named nfa_*) are removed
    after (the adapters' own patches, which verify declares, stay)."""
    monkeypatch.syspath_prepend(str(tmp_path))
    before_mods = set(sys.modules)
    yield tmp_path
    for name in set(sys.modules) - before_mods:
        if name.startswith("nfa_"):
            del sys.modules[name]
    for name in [n for n in patches._REGISTRY if n.startswith("nfa_")]:
        del patches._REGISTRY[name]
    for name in [n for n in patches._CALLBACKS if n.startswith("nfa_")]:
        del patches._CALLBACKS[name]
    patches.CALLBACK_ERRORS[:] = [e for e in patches.CALLBACK_ERRORS if not e[0].startswith("nfa_")]


def _declare(name, target, apply_fn, when=None, required=False):
    patches.declare([patches.Patch(name, target, "test", apply_fn, "test", when=when,
                                   required=required)])


def _wrap_f():
    patches.replace("nfa_target:f", lambda orig: (lambda: "patched " + orig()))


def test_pending_patch_applies_inside_the_import_before_the_importer_binds_it(pkg):
    (pkg / "nfa_target.py").write_text("def f():\n    return 'f'\n")
    # the importer copies the name as the target's import returns, like vLLM's default_loader
    # does with get_quant_config: it must get the patched function
    (pkg / "nfa_importer.py").write_text("from nfa_target import f\n")
    _declare("nfa_patch_f", "nfa_target:f", _wrap_f)

    armed = patches.arm_patch("nfa_patch_f")
    assert isinstance(armed, patches.Pending) and armed and armed.modules == ("nfa_target",)
    assert "nfa_target" not in sys.modules  # arming imports nothing
    assert str(armed) == "pending: applied when nfa_target is imported"
    assert patches.get("nfa_patch_f").as_dict()["pending"] == ["nfa_target"]

    importer = importlib.import_module("nfa_importer")
    assert importer.f() == "patched f"
    assert patches.get("nfa_patch_f").applied and patches.get("nfa_patch_f").pending == ()
    assert patches.arm_patch("nfa_patch_f") is True  # idempotent
    assert sys.modules["nfa_target"].f() == "patched f"  # wrapped once


def test_a_patch_whose_module_is_imported_applies_at_once(pkg):
    (pkg / "nfa_target.py").write_text("def f():\n    return 'f'\n")
    importlib.import_module("nfa_target")
    _declare("nfa_patch_now", "nfa_target:f", _wrap_f)
    assert patches.arm_patch("nfa_patch_now") is True
    assert sys.modules["nfa_target"].f() == "patched f"


def test_a_patch_applied_from_a_hook_imports_nothing_and_waits_for_what_it_needs(pkg):
    """The reverted attempt's lesson: a patch applied while its importer is half-initialised must
    not start another import (it may close an import cycle). Here the patch needs `nfa_needed`:
    its import is refused inside the hook, `nfa_needed` stays unimported, and the patch applies
    when the process imports it."""
    (pkg / "nfa_target.py").write_text("def f():\n    return 'f'\n")
    (pkg / "nfa_needed.py").write_text("SUFFIX = '!'\n")

    def apply():
        needed = importlib.import_module("nfa_needed")
        patches.replace("nfa_target:f", lambda orig: (lambda: orig() + needed.SUFFIX))

    _declare("nfa_patch_needs", "nfa_target:f", apply)
    patches.arm_patch("nfa_patch_needs")
    target = importlib.import_module("nfa_target")
    assert "nfa_needed" not in sys.modules
    patch = patches.get("nfa_patch_needs")
    assert not patch.applied and patch.pending == ("nfa_needed",) and patch.refused == ("nfa_needed",)
    assert target.f() == "f"

    importlib.import_module("nfa_needed")
    assert patch.applied and target.f() == "f!"


def test_a_patch_waiting_for_two_modules_applies_after_the_last(pkg):
    (pkg / "nfa_a.py").write_text("X = 1\n")
    (pkg / "nfa_b.py").write_text("import nfa_a\nY = 2\n")
    seen = []
    _declare("nfa_patch_ab", "nfa_a:X", lambda: seen.append((sys.modules["nfa_a"].X,
                                                             sys.modules["nfa_b"].Y)),
             when=("nfa_b", "nfa_a"))
    assert patches.arm_patch("nfa_patch_ab").modules == ("nfa_b", "nfa_a")
    importlib.import_module("nfa_b")  # nfa_a completes first, inside nfa_b's import
    assert seen == [(1, 2)]


def test_a_failing_patch_warns_from_the_hook_and_the_import_goes_on(pkg, caplog):
    (pkg / "nfa_target.py").write_text("def f():\n    return 'f'\n")
    _declare("nfa_patch_missing", "nfa_target:g", lambda: patches.resolve("nfa_target:g"))
    patches.arm_patch("nfa_patch_missing")
    with caplog.at_level("WARNING", logger="npu_flashrl.patches"):
        importlib.import_module("nfa_target")
    patch = patches.get("nfa_patch_missing")
    assert not patch.applied and "nfa_target has no g" in patch.error
    assert any("cannot patch nfa_patch_missing" in r.getMessage() for r in caplog.records)


def test_the_hooked_module_keeps_its_own_loader(pkg):
    (pkg / "nfa_target.py").write_text("def f():\n    return 'f'\n")
    _declare("nfa_patch_loader", "nfa_target:f", lambda: None)
    patches.arm_patch("nfa_patch_loader")
    mod = importlib.import_module("nfa_target")
    assert type(mod.__loader__).__module__ != patches.__name__
    assert type(mod.__spec__.loader).__module__ != patches.__name__
    assert "return 'f'" in inspect.getsource(mod)


def test_verify_says_what_a_pending_patch_waits_for(pkg):
    from npu_flashrl import verify

    (pkg / "nfa_target.py").write_text("def f():\n    return 'f'\n")
    _declare("nfa_patch_verify", "nfa_target:f", _wrap_f)
    patches.arm_patch("nfa_patch_verify")
    row = next(r for r in verify.patch_rows() if r["check"] == "patch nfa_patch_verify")
    assert row["status"] == verify.INFO
    assert row["detail"].startswith("pending: applied when nfa_target is imported")


def _boom():
    raise AttributeError("module 'nfa_target' has no attribute 'Renamed'")


def test_a_patch_raising_in_the_hook_is_not_applied_and_the_import_goes_on(pkg, caplog):
    """Not a PatchNotApplicable: an upstream rename, say. The user's import still succeeds; the
    patch is recorded not applied, with the exception as its reason, and a WARNING."""
    (pkg / "nfa_target.py").write_text("def f():\n    return 'f'\n")
    _declare("nfa_patch_raises", "nfa_target:f", _boom)
    assert patches.arm_patch("nfa_patch_raises")  # pending
    with caplog.at_level("WARNING", logger="npu_flashrl.patches"):
        target = importlib.import_module("nfa_target")
    assert target.f() == "f"
    patch = patches.get("nfa_patch_raises")
    assert not patch.applied and patch.pending == ()
    assert patch.error == "AttributeError: module 'nfa_target' has no attribute 'Renamed'"
    assert any("cannot patch nfa_patch_raises" in r.getMessage() and "Renamed" in r.getMessage()
               for r in caplog.records)


def test_a_callback_raising_after_the_import_is_charged_to_the_patch_that_left_it(pkg, caplog):
    """A patch applied at once that leaves a `when_imported` callback (the verl and Megatron
    adapters' shape): the callback's failure inside the user's import fails neither the import nor
    silently; the patch turns not applied, its reason naming the module."""
    (pkg / "nfa_target.py").write_text("def f():\n    return 'f'\n")

    def apply():
        patches.when_imported("nfa_target", lambda module: _boom())

    _declare("nfa_patch_later", "nfa_target:f", apply, when=())
    assert patches.arm_patch("nfa_patch_later") is True
    with caplog.at_level("WARNING", logger="npu_flashrl.patches"):
        importlib.import_module("nfa_target")
    patch = patches.get("nfa_patch_later")
    assert not patch.applied
    assert patch.error.startswith("after the import of nfa_target: AttributeError:")
    assert any("cannot patch nfa_patch_later" in r.getMessage() for r in caplog.records)
    row = [r for r in verify.patch_rows() if r["check"] == "patch nfa_patch_later"][0]
    assert row["status"] == verify.WARN and "after the import of nfa_target" in row["detail"]


def test_a_callback_of_no_patch_that_raises_is_listed_by_verify(pkg):
    (pkg / "nfa_target.py").write_text("X = 1\n")
    patches.when_imported("nfa_target", lambda module: _boom())
    importlib.import_module("nfa_target")
    rows = [r for r in verify.patch_rows() if r["check"] == "post-import nfa_target"]
    assert len(rows) == 1 and rows[0]["status"] == verify.WARN and "Renamed" in rows[0]["detail"]


def _quantized_config(tmp_path, fn):
    path = tmp_path / "flashrl.yaml"
    path.write_text(yaml.safe_dump({"configs": [{"fn": fn}]}))
    return load_config(str(path))


def test_a_required_patch_that_failed_makes_the_int8_engine_build_refuse(pkg, tmp_path):
    """The engine patch's wrapper (`vllm_engine._wrap`) around a stand-in for vLLM's
    create_engine_config (never reached): a required patch that failed in its hook refuses an
    INT8 config's build, naming the patch and its reason; a bf16 config builds. verify fails."""
    (pkg / "nfa_target.py").write_text("def f():\n    return 'f'\n")
    _declare("nfa_patch_required", "nfa_target:f", _boom, required=True)
    patches.arm_patch("nfa_patch_required")
    importlib.import_module("nfa_target")  # the import succeeds
    assert patches.required_failures() == {
        "nfa_patch_required": "AttributeError: module 'nfa_target' has no attribute 'Renamed'"}

    built = []
    create = vllm_engine._wrap(lambda self: built.append(self) or "vllm_config")
    saved = vllm_engine.current_config()
    try:
        vllm_engine.set_config(_quantized_config(tmp_path, "int8_profile_free"))
        with pytest.raises(patches.RequiredPatchError, match=r"nfa_patch_required \(nfa_target:f\): "
                           r"AttributeError: .*Renamed.*unset FLASHRL_CONFIG") as exc:
            create(object())
        assert isinstance(exc.value, UnquantizedRolloutError) and built == []
        vllm_engine.set_config(_quantized_config(tmp_path, "bf16"))
        vllm_engine.refuse_if_patches_failed(vllm_engine.current_config(), "a bf16 build")  # no refusal
    finally:
        vllm_engine.set_config(saved)
    row = [r for r in verify.patch_rows() if r["check"] == "patch nfa_patch_required"][0]
    assert row["status"] == verify.FAIL and "the engine build refuses" in row["detail"]
