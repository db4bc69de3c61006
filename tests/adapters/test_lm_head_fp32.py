"""FLASHRL_LMHEAD_FP32 on both sides.

Trainer side (transformers) runs in-process. The vLLM side runs the REAL vLLM 0.11.0 Qwen2 model (and
vllm-ascend 0.11.0's AscendParallelLMHead / AscendLogitsProcessor) on the CPU through
npu_flashrl.sim.cpu_vllm, each scenario in a fresh subprocess: the patches are process-global
(every lm head built afterwards is fp32) and must not leak into other tests.
"""
import textwrap

import pytest
import torch

from helpers import run_python_json
from npu_flashrl import patches
from npu_flashrl.adapters import transformers as tfa
from npu_flashrl.sim.tiny_models import build_tiny_qwen2, tiny_qwen2_config

pytestmark = pytest.mark.every_line  # line-specific upstream code: runs on every stack line


# ------------------------------------------------------------------------------ trainer side (HF)

def _hf_model(dtype=torch.bfloat16, seed=0, **over):
    from transformers import Qwen2ForCausalLM

    torch.manual_seed(seed)
    model = Qwen2ForCausalLM(tiny_qwen2_config(**over)).to(dtype)
    with torch.no_grad():  # peaked-ish logits so rounding matters
        model.lm_head.weight.normal_(0, 0.5)
    return model.eval()


def _ref64(model, hidden):
    w = model.lm_head.weight.detach().double()
    return hidden.double() @ w.T


def test_hf_logits_fp32_and_closer_to_float64():
    model = _hf_model()
    hidden = (torch.randn(3, 5, model.config.hidden_size) * 2).to(torch.bfloat16)
    bf16_logits = model.lm_head(hidden)
    assert bf16_logits.dtype == torch.bfloat16
    assert tfa.enable_fp32_lm_head(model) and tfa.is_fp32_lm_head(model)
    logits = model.lm_head(hidden)
    assert logits.dtype == torch.float32
    assert model.lm_head.weight.dtype == torch.bfloat16  # trained parameter untouched
    ref = _ref64(model, hidden)
    err32 = (logits.double() - ref).abs().max().item()
    err16 = (bf16_logits.double() - ref).abs().max().item()
    assert err32 < 1e-4 and err16 > 1e-3 and err32 < err16 / 100, (err32, err16)
    # full model forward: logits dtype fp32
    out = model(input_ids=torch.randint(0, 512, (2, 7)))
    assert out.logits.dtype == torch.float32


def test_hf_idempotent_reload_and_grad():
    model = _hf_model()
    assert tfa.enable_fp32_lm_head(model)
    fwd = model.lm_head.forward
    assert tfa.enable_fp32_lm_head(model)
    assert model.lm_head.forward == fwd  # not wrapped twice
    # weight reload (state dict load) keeps the switch and uses the new values
    sd = {k: v.clone() for k, v in model.state_dict().items()}
    sd["lm_head.weight"] = torch.randn_like(sd["lm_head.weight"])
    model.load_state_dict(sd)
    hidden = torch.randn(4, model.config.hidden_size, dtype=torch.bfloat16)
    torch.testing.assert_close(model.lm_head(hidden).double(), _ref64(model, hidden), rtol=1e-5, atol=1e-4)
    # gradients flow to the bf16 parameter
    model.lm_head(hidden.requires_grad_()).sum().backward()
    assert model.lm_head.weight.grad is not None and model.lm_head.weight.grad.dtype == torch.bfloat16
    # autocast (bf16) does not pull the matmul back to bf16
    with torch.autocast("cpu", dtype=torch.bfloat16):
        assert model.lm_head(hidden).dtype == torch.float32
    assert tfa.disable_fp32_lm_head(model) and not tfa.is_fp32_lm_head(model)
    assert model.lm_head(hidden).dtype == torch.bfloat16


def test_hf_tied_embeddings_untouched():
    model = _hf_model(tie_word_embeddings=True)
    assert model.lm_head.weight is model.model.embed_tokens.weight
    assert tfa.enable_fp32_lm_head(model)
    ids = torch.randint(0, 512, (1, 6))
    assert model.model.embed_tokens(ids).dtype == torch.bfloat16
    assert model(input_ids=ids).logits.dtype == torch.float32
    assert model.lm_head.weight is model.model.embed_tokens.weight


def test_hf_registered_patch_applies_to_new_models(tmp_path):
    # run in a subprocess: the post_init patch is process-global
    code = textwrap.dedent("""
        import json, torch
        from npu_flashrl import patches
        from npu_flashrl.adapters import transformers as tfa
        from npu_flashrl.sim.tiny_models import build_tiny_qwen2
        from transformers import Qwen2ForCausalLM
        assert patches.apply_patch(tfa.PATCH_NAME) and patches.apply_patch(tfa.PATCH_NAME)
        build_tiny_qwen2(%r, dtype=torch.bfloat16, tokenizer=False)
        m = Qwen2ForCausalLM.from_pretrained(%r, torch_dtype=torch.bfloat16)
        out = m(input_ids=torch.randint(0, 512, (1, 5))).logits
        print(json.dumps({"fp32": tfa.is_fp32_lm_head(m), "dtype": str(out.dtype),
                          "wdtype": str(m.lm_head.weight.dtype),
                          "status": [p for p in patches.status() if p["name"] == tfa.PATCH_NAME]}))
    """ % (str(tmp_path / "m"), str(tmp_path / "m")))
    res = run_python_json(code)
    assert res["fp32"] and res["dtype"] == "torch.float32" and res["wdtype"] == "torch.bfloat16"
    assert res["status"][0]["applied"]


# ------------------------------------------------------------------------------ rollout side (vLLM)



_PRELUDE = textwrap.dedent("""
    import json, torch
    from npu_flashrl.sim import cpu_vllm
    from npu_flashrl.sim.tiny_models import build_tiny_qwen2
    from npu_flashrl import patches
    from npu_flashrl.sim import ascend_harness
    cpu_vllm.prepare_process()
    from npu_flashrl.adapters import vllm_lm_head as va
    MODEL_DIR = %r
    R = {}
    def err(a, ref):
        return (a.double() - ref).abs().max().item()
    def bf16_path(hidden, w):  # what vLLM's default_unquantized_gemm computes on a bf16 model
        return torch.nn.functional.linear(hidden.to(torch.bfloat16), w.to(torch.bfloat16))
""")


def _vllm_available():
    try:
        import vllm  # noqa: F401
        return True
    except Exception:  # noqa: BLE001
        return False


needs_vllm = pytest.mark.skipif(not _vllm_available(), reason="vLLM not installed")


@needs_vllm
def test_vllm_patched_build_fp32_logits_and_reload(tmp_path):
    code = _PRELUDE % str(tmp_path / "m") + textwrap.dedent("""
        build_tiny_qwen2(MODEL_DIR, dtype=torch.bfloat16, tokenizer=False)
        assert all(va.enable_lm_head_fp32().values())
        from npu_flashrl.adapters.engine_choice import EngineChoice
        with cpu_vllm.CpuVllm(MODEL_DIR, dtype=torch.bfloat16, choice=EngineChoice(fn=None)) as cv:
            m = cv.model
            head, emb = m.lm_head, m.model.embed_tokens
            R["head_type"] = type(head).__name__
            R["head_dtype"] = str(head.weight.dtype)
            R["emb_dtype"] = str(emb.weight.dtype)
            R["layer_dtype"] = str(m.model.layers[0].mlp.down_proj.weight.dtype)
            from safetensors.torch import load_file
            import glob
            ck = {}
            for f in glob.glob(MODEL_DIR + "/*.safetensors"):
                ck.update(load_file(f))
            V = ck["lm_head.weight"].shape[0]
            R["loaded_exact"] = torch.equal(head.weight[:V], ck["lm_head.weight"].float())
            torch.manual_seed(0)
            hidden = (torch.randn(16, head.weight.shape[1]) * 3).to(torch.bfloat16)
            logits = ascend_harness.compute_logits(m, hidden)
            ref = hidden.double() @ head.weight[:V].double().T
            R["logits_dtype"] = str(logits.dtype)
            R["err_fp32"] = err(logits[:, :V], ref)
            R["err_bf16"] = err(bf16_path(hidden, head.weight[:V]), ref)
            # reload with fp32 weights that are NOT bf16-representable: kept exactly (no bf16 rounding)
            param_id = id(head.weight)
            new = ck["lm_head.weight"].float() + torch.randn(ck["lm_head.weight"].shape) * 1e-3
            m.load_weights([("lm_head.weight", new)])
            R["reload_same_param"] = id(head.weight) == param_id
            R["reload_dtype"] = str(head.weight.dtype)
            R["reload_exact_fp32"] = torch.equal(head.weight[:V], new)
            # a bf16 source still loads (copy_ casts)
            m.load_weights([("lm_head.weight", new.to(torch.bfloat16))])
            R["reload_bf16_exact"] = torch.equal(head.weight[:V], new.to(torch.bfloat16).float())
            full = cv.logits(torch.randint(0, 512, (2, 6)))
            R["full_finite"] = bool(torch.isfinite(full).all())
            R["upcast_again"] = va.upcast_lm_head(m)
        # a model of another engine (no npu_flashrl choice, e.g. a reward model): vLLM's lm head
        with cpu_vllm.CpuVllm(MODEL_DIR, dtype=torch.bfloat16) as other:
            R["other_head_dtype"] = str(other.model.lm_head.weight.dtype)
            R["other_marked"] = bool(getattr(other.model.lm_head, va.MARK, False))
        R["status"] = {p["name"]: p["applied"] for p in patches.status()}
        print(json.dumps(R))
    """)
    r = run_python_json(code)
    assert r["head_dtype"] == "torch.float32" and r["logits_dtype"] == "torch.float32"
    assert r["other_head_dtype"] == "torch.bfloat16" and not r["other_marked"]  # policy only
    assert r["emb_dtype"] == r["layer_dtype"], "input embedding must stay in the model dtype"
    assert r["loaded_exact"]
    assert r["err_fp32"] < 1e-4 < r["err_bf16"] and r["err_fp32"] < r["err_bf16"] / 100, r
    assert r["reload_same_param"] and r["reload_dtype"] == "torch.float32"
    assert r["reload_exact_fp32"] and r["reload_bf16_exact"]
    assert r["full_finite"] and r["upcast_again"]
    assert r["status"]["vllm_lmhead_fp32_compute"] and r["status"]["vllm_lmhead_fp32_init"]


@needs_vllm
def test_vllm_upcast_after_load_untied_and_tied(tmp_path):
    code = _PRELUDE % str(tmp_path / "m") + textwrap.dedent("""
        for tied in (False, True):
            d = MODEL_DIR + ("_tied" if tied else "_untied")
            build_tiny_qwen2(d, dtype=torch.bfloat16, tokenizer=False,
                             config_overrides={"tie_word_embeddings": tied})
            out = {}
            with cpu_vllm.CpuVllm(d, dtype=torch.bfloat16) as cv:
                m = cv.model
                torch.set_default_dtype(torch.float32)
                # make the lm head bf16 as on an NPU bf16 model (the CPU platform may build fp32)
                m.lm_head.weight.data = m.lm_head.weight.data.to(torch.bfloat16)
                m.model.embed_tokens.weight.data = m.model.embed_tokens.weight.data.to(torch.bfloat16)
                out["is_tied_module"] = m.lm_head is m.model.embed_tokens
                before = m.lm_head.weight.detach().clone()
                p = m.lm_head.weight
                loader = getattr(p, "weight_loader", None)
                out["upcast"] = va.upcast_lm_head(m)
                out["same_param"] = m.lm_head.weight is p and getattr(p, "weight_loader", None) is loader
                out["head_dtype"] = str(m.lm_head.weight.dtype)
                out["emb_dtype"] = str(m.model.embed_tokens.weight.dtype)
                out["values_kept"] = torch.equal(m.lm_head.weight, before.float())
                ptr = m.lm_head.weight.data_ptr()
                out["idempotent"] = va.upcast_lm_head(m) and m.lm_head.weight.data_ptr() == ptr
                ids = torch.randint(0, 512, (5,))
                out["embed_out_dtype"] = str(m.model.embed_tokens(ids).dtype)
                V = 512
                hidden = (torch.randn(8, m.lm_head.weight.shape[1]) * 3).to(torch.bfloat16)
                logits = ascend_harness.compute_logits(m, hidden)
                ref = hidden.double() @ m.lm_head.weight[:V].double().T
                out["logits_dtype"] = str(logits.dtype)
                out["err_fp32"] = err(logits[:, :V], ref)
                out["err_bf16"] = err(bf16_path(hidden, m.lm_head.weight[:V]), ref)
                name = "model.embed_tokens.weight" if tied else "lm_head.weight"
                new = torch.randn(V, m.lm_head.weight.shape[1]) * 0.05
                m.load_weights([(name, new)])
                out["reload_exact"] = torch.equal(m.lm_head.weight[:V], new)
                out["reload_dtype"] = str(m.lm_head.weight.dtype)
            R["tied" if tied else "untied"] = out
        print(json.dumps(R))
    """)
    r = run_python_json(code)
    for case in ("untied", "tied"):
        o = r[case]
        assert o["is_tied_module"] == (case == "tied")
        assert o["upcast"] and o["same_param"] and o["values_kept"] and o["idempotent"], (case, o)
        assert o["head_dtype"] == "torch.float32" and o["logits_dtype"] == "torch.float32"
        assert o["err_fp32"] < o["err_bf16"] / 100, (case, o)
        assert o["reload_exact"] and o["reload_dtype"] == "torch.float32", (case, o)
        assert o["embed_out_dtype"] == "torch.bfloat16", (case, o)  # rest of the model unchanged
    assert r["untied"]["emb_dtype"] == "torch.bfloat16"  # untied: embedding untouched
    assert r["tied"]["emb_dtype"] == "torch.float32"  # tied: it IS the lm head


@needs_vllm
def test_vllm_ascend_lm_head_and_logits_processor(tmp_path):
    code = _PRELUDE % str(tmp_path / "m") + textwrap.dedent("""
        build_tiny_qwen2(MODEL_DIR, dtype=torch.bfloat16, tokenizer=False)
        assert all(va.enable_lm_head_fp32().values())
        from npu_flashrl.adapters.engine_choice import EngineChoice
        with cpu_vllm.CpuVllm(MODEL_DIR, dtype=torch.bfloat16, choice=EngineChoice(fn=None)) as cv:
            from vllm.model_executor.custom_op import CustomOp
            from vllm.model_executor.layers.logits_processor import LogitsProcessor
            from vllm.model_executor.layers.vocab_parallel_embedding import ParallelLMHead
            from vllm_ascend.ops.vocab_parallel_embedding import AscendLogitsProcessor, AscendParallelLMHead
            # what vllm-ascend's platform does at start-up (register_ascend_customop), for these two ops
            CustomOp.register_oot(_decorated_op_cls=AscendParallelLMHead, name="ParallelLMHead")
            CustomOp.register_oot(_decorated_op_cls=AscendLogitsProcessor, name="LogitsProcessor")
            head = ParallelLMHead(512, 128, params_dtype=torch.bfloat16, prefix="lm_head")
            lp = LogitsProcessor(512)
            R["head_type"] = type(head).__name__
            R["lp_type"] = type(lp).__name__
            R["head_dtype"] = str(head.weight.dtype)
            w = (torch.randn(512, 128) * 0.5).to(torch.bfloat16)
            head.weight_loader(head.weight, w)
            hidden = (torch.randn(6, 128) * 3).to(torch.bfloat16)
            logits = lp(head, hidden)
            ref = hidden.double() @ w.double().T
            R["logits_dtype"] = str(logits.dtype)
            R["err_fp32"] = err(logits, ref)
            R["err_bf16"] = err(bf16_path(hidden, w), ref)
            new = torch.randn(512, 128) * 0.1
            head.weight_loader(head.weight, new)
            R["reload_exact"] = torch.equal(head.weight[:512], new)
        print(json.dumps(R))
    """)
    r = run_python_json(code)
    assert r["head_type"] == "AscendParallelLMHead"
    # vLLM 0.10.1's LogitsProcessor is no CustomOp, so vllm-ascend's out-of-tree class is not
    # swapped in there; both call UnquantizedEmbeddingMethod.apply, which the patch covers
    assert r["lp_type"] in ("AscendLogitsProcessor", "LogitsProcessor")
    assert r["head_dtype"] == "torch.float32" and r["logits_dtype"] == "torch.float32"
    assert r["err_fp32"] < r["err_bf16"] / 100, r
    assert r["reload_exact"]
