"""FlashRL 1.0.3 coexistence: its vLLM patches are undone (already imported) or pre-empted (imported
later) by the registered patch `flashrl_yield_to_npu_flashrl`. Each scenario runs in a fresh process
with the real FlashRL and vLLM code (FlashRL patches global vLLM state and the root logger)."""
import json
import os
import subprocess
import sys
import textwrap

import pytest

from npu_flashrl.adapters import flashrl as FA

_PRELUDE = textwrap.dedent("""
    import json, os, sys
    from npu_flashrl import patches
    from npu_flashrl.adapters import flashrl as fa

    def state():
        out = {}
        for s in fa.FLASHRL_SITES:
            owner = fa._resolve_owner(s, True)
            if owner is None:
                out[s.what] = None
                continue
            out[s.what] = fa._is_flashrl_object(getattr(owner, s.attr))
        return out

    def originals_restored():
        bad = []
        for s in fa.FLASHRL_SITES:
            owner = fa._resolve_owner(s, False)
            if owner is None:
                continue
            saved = getattr(owner, s.marker, None)
            if saved is None:
                bad.append(s.what + ': marker gone')
            elif not fa._is_flashrl_object(saved) and getattr(owner, s.attr) is not saved:
                bad.append(s.what + ': not the saved original')
        return bad
""")


def _run(body, env_extra):
    env = dict(os.environ, VLLM_PLUGINS="none", TORCH_DEVICE_BACKEND_AUTOLOAD="0",
               FLASHRL_LOGGING_LEVEL="DEBUG")
    env.pop("FLASHRL_CONFIG", None)
    env.pop(FA.YIELD_ENV, None)
    env.update(env_extra)
    res = subprocess.run([sys.executable, "-c", _PRELUDE + textwrap.dedent(body)], capture_output=True,
                         text=True, env=env, timeout=600)
    assert res.returncode == 0, res.stderr[-4000:]
    return json.loads(res.stdout.strip().splitlines()[-1]), res.stderr


FLASHRL_ENV = {"FLASHRL_CONFIG": "bf16", "FLASHRL_LMHEAD_FP32": "1", "FLASHRL_TEST_RELOAD": "unused"}


def test_restores_vllm_after_flashrl_import():
    out, err = _run("""
        import flash_rl
        before = state()
        os.environ[fa.YIELD_ENV] = "1"
        first = fa.yield_flashrl()
        after = state()
        bad = originals_restored()
        # FlashRL re-running its patch functions (e.g. a second LLM init) must find the markers
        from flash_rl import vllm_patch
        vllm_patch.patch_vllm_process_weights_after_loading()
        vllm_patch.patch_vllm_lmhead_to_fp32()
        vllm_patch.patch_vllm_logprob_compute()
        again = state()
        second = fa.yield_flashrl()
        print(json.dumps({"before": before, "after": after, "again": again, "bad": bad,
                          "first": first, "second": second, "result": fa.last_result,
                          "root_handlers": len(fa.flashrl_root_handlers())}))
    """, FLASHRL_ENV)
    patched_before = [k for k, v in out["before"].items() if v]
    # what FlashRL 1.0.3 really patches in this vLLM (vllm.LLM needs fastapi, absent on the CPU stack)
    for site in ("model_loader.utils.process_weights_after_loading", "BaseModelLoader.load_model",
                 "BaseKVCacheMethod.process_weights_after_loading",
                 "VocabParallelEmbedding.__init__ (FLASHRL_LMHEAD_FP32)",
                 "UnquantizedEmbeddingMethod.apply (FLASHRL_LMHEAD_FP32)"):
        assert site in patched_before, out["before"]
    assert out["first"] is True and out["second"] is True
    assert not any(out["after"].values()), out["after"]
    assert not any(out["again"].values()), out["again"]
    assert out["bad"] == []
    # a target FlashRL patched twice (vllm.LLM.__init__, where vllm.LLM imports: config swap, then
    # FLASHRL_TEST_RELOAD over it) is restored once, to the innermost original; its second
    # marker is then already neutral ("kept-marker")
    actions = list(out["result"].values())
    assert actions.count("restored") >= 1
    assert sum(v in ("restored", "kept-marker") for v in actions) >= len(patched_before), out["result"]
    assert out["root_handlers"] == 1  # FlashRL's root-logger handler is reported, not removed
    assert err.count("vLLM patch site(s) neutralized") == 1  # applied once
    assert "restored vLLM's BaseModelLoader.load_model" in err


def test_preempts_flashrl_imported_later():
    out, err = _run("""
        os.environ[fa.YIELD_ENV] = "1"
        ok = fa.yield_flashrl()
        preempted = dict(fa.last_result)
        import flash_rl   # FLASHRL_CONFIG is set: FlashRL tries to patch now
        print(json.dumps({"ok": ok, "after": state(), "preempted": preempted}))
    """, FLASHRL_ENV)
    assert out["ok"] is True
    assert sum(v == "preempted" for v in out["preempted"].values()) >= 5
    assert not any(out["after"].values()), out["after"]
    assert "already patched" in err  # FlashRL's own DEBUG/print when it finds a marker


@pytest.mark.parametrize("value", [None, "0"])
def test_not_applied_off_ascend(value):
    env = dict(FLASHRL_ENV)
    if value is not None:
        env[FA.YIELD_ENV] = value
    out, err = _run("""
        import flash_rl
        ok = fa.yield_flashrl()
        st = [p for p in patches.status() if p["name"] == fa.PATCH_NAME][0]
        print(json.dumps({"ok": ok, "error": st["error"], "after": state()}))
    """, env)
    assert out["ok"] is False
    assert "not on an Ascend platform" in out["error"]
    assert any(out["after"].values())  # FlashRL left as it was
    assert "cannot patch flashrl_yield_to_npu_flashrl" in err


def test_detection(tmp_path):
    site_dir = tmp_path / "site"
    site_dir.mkdir()
    info = FA.detect_flashrl([str(site_dir)])
    assert info["installed"] is True and info["version"] == "1.0.3" and info["usercustomize"] == []
    (site_dir / "usercustomize.py").write_text("# try: import flash_rl\n")
    assert FA.usercustomize_files([str(site_dir)]) == []
    (site_dir / "usercustomize.py").write_text("try: import flash_rl\nexcept ImportError: pass\n")
    assert FA.usercustomize_files([str(site_dir)]) == [str(site_dir / "usercustomize.py")]
    assert FA.detect_flashrl([str(site_dir)])["usercustomize"] == [str(site_dir / "usercustomize.py")]


def test_should_yield_env(monkeypatch):
    monkeypatch.setenv(FA.YIELD_ENV, "1")
    assert FA.should_yield() is True
    monkeypatch.setenv(FA.YIELD_ENV, "0")
    assert FA.should_yield() is False
    monkeypatch.delenv(FA.YIELD_ENV)
    assert FA.should_yield() is FA.on_ascend() is False  # no real torch_npu on the CPU stack
