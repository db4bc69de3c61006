"""The CPU harness builds several vLLM models in one process (a vLLM worker builds one): each is
built as in a fresh process, whatever was built before it. Real vLLM Qwen2ForCausalLM on the CPU
(`npu_flashrl.sim.cpu_vllm`); stand-ins: emulated torch_npu, plain causal attention, and "verl's
engine config" played by the harness's own config with vLLM's custom ops switched on (what
`EngineArgs.create_engine_config` leaves for an eager CPU engine, and what the server-mode tests
build from verl's pickled config)."""
import pytest
import torch

pytest.importorskip("vllm")

from npu_flashrl.sim.tiny_models import TINY_QWEN2, build_tiny_qwen2  # noqa: E402

pytestmark = pytest.mark.every_line  # line-specific upstream code: runs on every stack line


def _rope(model):
    return model.model.layers[0].self_attn.rotary_emb


def test_a_model_after_one_built_with_custom_ops_on_runs_plain_torch_rope(tmp_path):
    """vLLM's get_rope hands every model of the same rope shape one RotaryEmbedding, whose forward
    was fixed under the config of the model that built it first: after a model built with custom
    ops on (vLLM's compiled kernels), the next harness model must not inherit its
    `_C.rotary_embedding` forward (absent on a CPU test stack), nor its instance."""
    from npu_flashrl.sim import cpu_vllm

    cpu_vllm.prepare_process()  # the CPU platform before a config is built outside CpuVllm
    hf = build_tiny_qwen2(str(tmp_path), dtype=torch.bfloat16, seed=0, tokenizer=False).eval()
    vc = cpu_vllm.make_vllm_config(str(tmp_path))
    vc.compilation_config.custom_ops = ["all"]
    with cpu_vllm.CpuVllm(str(tmp_path), vllm_config=vc) as first:
        kernel_rope = _rope(first.model)
        # custom ops on: the platform's compiled kernel (forward_cpu / forward_cuda: `_C.rotary_embedding`)
        assert kernel_rope._forward_method.__name__ != "forward_native"
    with cpu_vllm.CpuVllm(str(tmp_path)) as second:
        rope = _rope(second.model)
        assert rope is not kernel_rope
        assert rope._forward_method.__name__ == "forward_native"
        ids = torch.randint(0, TINY_QWEN2["vocab_size"], (1, 12), generator=torch.Generator().manual_seed(0))
        lv = second.logits(ids)
        with torch.no_grad():
            lh = hf(ids).logits.float()
        assert ((lv - lh).norm() / lh.norm()).item() < 3e-2  # the harness's bf16 tolerance


def test_a_given_config_for_more_ranks_than_the_harness_runs_is_refused_by_name(tmp_path):
    """A config built for TP 2 (verl's default rollout TP) in a one-rank harness process: refused
    naming both sizes, before any process group is made. Before, its build depended on what ran
    first: vllm-ascend's groups left by an earlier model hid the mismatch; in a fresh process its
    `init_ascend_model_parallel` failed on a tensor reshape."""
    from npu_flashrl.sim import cpu_vllm

    cpu_vllm.prepare_process()
    build_tiny_qwen2(str(tmp_path), dtype=torch.bfloat16, seed=0, tokenizer=False)
    vc = cpu_vllm.make_vllm_config(str(tmp_path))
    vc.parallel_config.tensor_parallel_size = 2
    with pytest.raises(ValueError, match=r"tensor_parallel_size=2 but this harness runs 1 rank"):
        with cpu_vllm.CpuVllm(str(tmp_path), vllm_config=vc):
            pass
