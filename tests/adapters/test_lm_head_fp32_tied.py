"""FLASHRL_LMHEAD_FP32 with tied embeddings (Qwen2.5 0.5B-3B, Llama 3.2 1B / 3B): the shared
embedding / lm-head weight is held in fp32 for both uses on the policy rollout.

Real vLLM Qwen2ForCausalLM (which uses `embed_tokens` itself as `lm_head`) and LlamaForCausalLM
(which calls `ParallelLMHead.tie_weights` after the fp32 init patch) built on the CPU through
vLLM's own loader (`sim.cpu_vllm`), bf16 and INT8 (vllm-ascend's W8A8_DYNAMIC layers), each case in
a fresh subprocess (the patches are process-global). Stand-ins: torch_npu (reference kernels),
vLLM attention (plain causal SDPA), the trainer (its HF state dict, tied `lm_head.weight`
included, as FSDP sends it).
"""
import json
import textwrap

import pytest

from helpers import run_python_json

pytestmark = pytest.mark.every_line


_CODE = textwrap.dedent("""
    import json, torch
    from npu_flashrl.sim import cpu_vllm, ascend_harness
    from npu_flashrl.sim.tiny_models import build_tiny_llama, build_tiny_qwen2, trainer_weights
    va = cpu_vllm.prepare_int8_worker()
    from npu_flashrl import patches
    from npu_flashrl.adapters import vllm_lm_head as lmh
    from npu_flashrl.adapters.engine_choice import EngineChoice
    from npu_flashrl.adapters.vllm_ascend import end_weight_sync
    assert all(lmh.enable_lm_head_fp32().values())
    ROOT, ARCH, FN = %r, %r, %r
    build = {"qwen2": lambda d, s: build_tiny_qwen2(d, seed=s, tokenizer=False,
                                                    config_overrides={"tie_word_embeddings": True}),
             "llama": lambda d, s: build_tiny_llama(d, seed=s, tokenizer=False)}[ARCH]
    hf0, hf1 = build(ROOT + "/w0", 0), build(ROOT + "/w1", 1)
    assert hf0.config.tie_word_embeddings
    choice = cpu_vllm.int8(FN) if FN else EngineChoice(fn=None)
    R = {}
    ids = torch.randint(0, 512, (2, 7), generator=torch.Generator().manual_seed(0))
    with cpu_vllm.CpuVllm(ROOT + "/w0", dtype=torch.bfloat16, choice=choice,
                          quantization="ascend" if FN else None) as cv:
        m = cv.model
        head, emb = m.lm_head, m.model.embed_tokens
        R["shared"] = head.weight is emb.weight
        R["head_dtype"] = str(head.weight.dtype)
        R["layer_dtype"] = str(m.model.layers[0].mlp.down_proj.weight.dtype)
        want = hf0.model.embed_tokens.weight.detach()
        V = want.shape[0]
        R["cold_exact"] = torch.equal(head.weight[:V], want.float())
        R["embed_out_dtype"] = str(emb(ids.reshape(-1)).dtype)
        R["embed_out_exact"] = torch.equal(emb(ids.reshape(-1)), want[ids.reshape(-1)])
        hidden = (torch.randn(8, head.weight.shape[1]) * 3).to(torch.bfloat16)
        logits = ascend_harness.compute_logits(m, hidden)
        ref = hidden.double() @ want.double().T
        R["logits_dtype"] = str(logits.dtype)
        R["err_fp32"] = (logits[:, :V].double() - ref).abs().max().item()
        R["err_bf16"] = (torch.nn.functional.linear(hidden, want).double() - ref).abs().max().item()
        ptr = head.weight.data_ptr()
        m.load_weights(trainer_weights(hf1))  # a sync of the trainer's tied state dict
        if FN:
            end_weight_sync(m)
        new = hf1.model.embed_tokens.weight.detach()
        R["sync_exact"] = torch.equal(head.weight[:V], new.float()) and head.weight is emb.weight
        R["sync_dtype"] = str(head.weight.dtype)
        R["sync_same_storage"] = head.weight.data_ptr() == ptr
        R["finite"] = bool(torch.isfinite(cv.logits(ids)).all())
    with cpu_vllm.CpuVllm(ROOT + "/w0", dtype=torch.bfloat16) as other:  # another engine: vLLM's own
        R["other_dtype"] = str(other.model.lm_head.weight.dtype)
    R["extra"] = lmh.tied_head_extra_bytes(hf0.config.to_dict())
    R["numel"] = head.weight.numel()
    R["applied"] = {p["name"]: p["applied"] for p in patches.status()}.get(lmh.PATCH_TIED)
    print(json.dumps(R))
""")


@pytest.mark.parametrize("arch,fn", [("qwen2", None), ("qwen2", "int8_profile_free"),
                                     ("llama", "int8_profile_free")])
def test_tied_head_is_fp32_for_both_uses_and_syncs_in_place(tmp_path, arch, fn):
    r = run_python_json(_CODE % (str(tmp_path), arch, fn))
    assert r["applied"]
    assert r["shared"], "the tie must survive: one weight for the embedding and the head"
    assert r["head_dtype"] == "torch.float32" and r["cold_exact"], r
    assert r["layer_dtype"] in ("torch.bfloat16", "torch.int8")
    # the embedding's output is what the bf16 model's lookup gives: the rest of the model unchanged
    assert r["embed_out_dtype"] == "torch.bfloat16" and r["embed_out_exact"], r
    assert r["logits_dtype"] == "torch.float32" and r["err_fp32"] < r["err_bf16"] / 100, r
    assert r["sync_exact"] and r["sync_dtype"] == "torch.float32" and r["sync_same_storage"], r
    assert r["finite"]
    assert r["other_dtype"] == "torch.bfloat16"  # a reward / teacher engine keeps vLLM's head
    assert r["extra"] == 2 * r["numel"]  # the memory the fp32 shared weight adds (tp 1)


def test_verify_counts_the_tied_heads_fp32_memory(tmp_path):
    """`verify` with FLASHRL_LMHEAD_FP32=1 says a tied model's shared weight is held in fp32 and
    what it adds (vLLM pads the vocab to a multiple of 64); nothing for an untied model or with 0."""
    from npu_flashrl.sim.tiny_models import tiny_qwen2_config
    from npu_flashrl.verify import OK, tied_head_rows

    class Entry:
        def __init__(self, model):
            self.model = model

    dirs = {}
    for tied in (True, False):
        d = tmp_path / f"tied{int(tied)}"
        d.mkdir()
        cfg = tiny_qwen2_config(tie_word_embeddings=tied, vocab_size=1000).to_dict()
        (d / "config.json").write_text(json.dumps(cfg))
        dirs[tied] = str(d)
    rows = tied_head_rows([Entry(dirs[True]), Entry(dirs[False])], {"FLASHRL_LMHEAD_FP32": "1"})
    assert len(rows) == 1 and rows[0]["status"] == OK and dirs[True] in rows[0]["check"]
    hidden = json.loads((tmp_path / "tied1" / "config.json").read_text())["hidden_size"]
    want = 2 * 1024 * hidden  # 1000 rows padded to 1024
    assert f"+{want / 2 ** 20:.1f} MiB per rank" in rows[0]["detail"], rows[0]
    assert tied_head_rows([Entry(dirs[True])], {"FLASHRL_LMHEAD_FP32": "0"}) == []
