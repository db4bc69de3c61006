"""FLASHRL_LMHEAD_FP32 in verl 0.9's FSDP engine (`verl/workers/engine/fsdp/transformer_impl.py`):
the actor's and the reference's logits come out in fp32.

What runs for real, in a fresh process (the patch on `PreTrainedModel.post_init`, verl's platform
and the process group are process-wide): npu_flashrl's registered patch `transformers_lmhead_fp32`
(what activation applies in verl's trainer workers when FLASHRL_LMHEAD_FP32=1), then verl 0.9.1's
own `FSDPEngineWithLMHead(...)`, `.initialize()` (`_build_module`: `from_pretrained` of a tiny
Qwen2 saved to disk, `apply_monkey_patch`; `_build_fsdp_module`: FSDP2 `fully_shard` with verl's
default mixed precision, param_dtype bf16; optimizer, LR scheduler, checkpoint manager) and
`.infer_batch(...)` (`forward_backward_batch` -> `forward_step` under verl's autocast ->
`prepare_model_outputs` -> log-probs), the call behind `compute_log_prob` / `compute_ref_log_prob`.
The actor is built for training, the reference `forward_only` (FSDP2 CPU offload), both with
verl's defaults: fp32 weights (`model_dtype`), bf16 compute (mixed precision and autocast).

Stand-ins, each for what needs a GPU/NPU or a cluster:
- verl's platform: a CPU `PlatformBase` given to verl's own `set_platform` (verl 0.9.1 has no CPU
  platform; device "cpu", `torch.cpu` as device module, gloo);
- the process group: gloo, world size 1, instead of NCCL/HCCL over the trainer's GPUs/NPUs;
- the reference's FSDP2 `CPUOffloadPolicy(pin_memory=True)`: built with `pin_memory=False`
  (pinning host memory needs an accelerator);
- attention: HF `eager` (`override_config.attn_implementation`) and the padded input path
  (`use_remove_padding=False`), instead of flash-attention varlen on packed sequences;
- `peft` and HF `datasets`, which verl imports at module level (LoRA, the dataset loader) and the
  current CPU stack lacks: empty modules while verl's engine is imported, removed afterwards so
  transformers does not take peft for installed.
"""
import json
import os
import subprocess
import sys

import pytest

from npu_flashrl import lines
from npu_flashrl.sim.megatron_engine import cpu_platform, stub_absent_modules
from npu_flashrl.sim.ports import free_port

pytestmark = [
    pytest.mark.every_line,
    pytest.mark.skipif(not lines.verl_server_mode(),
                       reason="needs verl 0.7.1+ (verl/workers/engine/fsdp), e.g. 0.9.1"),
]

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.abspath(os.path.join(HERE, "..", "..", ".."))
SUPPORT = os.path.join(ROOT, "tests", "support")


# ------------------------------------------------------------------------ the child process

def child(model_dir: str, role: str, port: int) -> dict:
    """Build verl's FSDP engine for `role` ("actor" | "ref") with npu_flashrl's patch applied and
    run its log-prob forward twice: fp32 lm-head on, then off (verl's own bf16 path)."""
    import torch
    import torch.distributed as dist

    from npu_flashrl import patches
    from npu_flashrl.adapters import transformers as hf

    lora = ("peft", "peft.utils", "peft.utils.save_and_load")
    added = stub_absent_modules(lora + ("datasets",))
    from verl.plugin.platform import platform_manager

    platform_manager.set_platform(cpu_platform())  # before the engine module reads the device
    from verl.workers.engine.fsdp.transformer_impl import FSDPEngineWithLMHead

    for name in lora:
        if name in added:
            sys.modules.pop(name)
    from verl.workers.engine.fsdp import transformer_impl

    # the reference's FSDP2 CPU offload pins host memory, which needs an accelerator
    offload = transformer_impl.CPUOffloadPolicy
    transformer_impl.CPUOffloadPolicy = lambda pin_memory=True: offload(pin_memory=False)
    from tensordict import TensorDict

    from verl.trainer.config import CheckpointConfig
    from verl.utils import tensordict_utils as tu
    from verl.workers.config import FSDPEngineConfig, FSDPOptimizerConfig, HFModelConfig

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=0, world_size=1)
    assert hf.lmhead_fp32_requested()  # FLASHRL_LMHEAD_FP32=1 in this process
    assert patches.apply_patch(hf.PATCH_NAME)

    model_config = HFModelConfig(path=model_dir, load_tokenizer=False, use_remove_padding=False,
                                 override_config={"attn_implementation": "eager"})
    engine_config = FSDPEngineConfig(strategy="fsdp2", forward_only=role == "ref",
                                     use_torch_compile=False)
    engine = FSDPEngineWithLMHead(model_config, engine_config, FSDPOptimizerConfig(lr=1e-5),
                                  CheckpointConfig())
    engine.initialize()
    module = engine.module
    seen = {}
    module.register_forward_hook(lambda mod, args, out: seen.update(logits=out.logits.detach()))
    module.lm_head.register_forward_pre_hook(
        lambda mod, args: seen.update(hidden=args[0].detach(), weight=mod.weight.detach().clone()))

    g = torch.Generator().manual_seed(1)
    seqs = [torch.randint(0, 512, (n,), generator=g) for n in (9, 6)]

    def nested(ts):
        return torch.nested.as_nested_tensor(ts, layout=torch.jagged)

    def run():
        data = TensorDict({"input_ids": nested(seqs),
                           "position_ids": nested([torch.arange(len(s)) for s in seqs]),
                           "loss_mask": nested([torch.ones(len(s), dtype=torch.long) for s in seqs]),
                           "temperature": torch.ones(len(seqs))}, batch_size=[len(seqs)])
        tu.assign_non_tensor(data, use_remove_padding=False, use_dynamic_bsz=False,
                             micro_batch_size_per_gpu=len(seqs), calculate_entropy=False)
        out = engine.infer_batch(data)
        logits = seen["logits"]
        # float64 reference of the same head on the same inputs: the hidden states and the
        # (mixed-precision, unsharded) weight the lm_head saw in this forward
        ref = seen["hidden"].double() @ seen["weight"].double().T
        return {"logits_dtype": str(logits.dtype), "hidden_dtype": str(seen["hidden"].dtype),
                "forward_weight_dtype": str(seen["weight"].dtype),
                "log_probs_dtype": str(out["model_output"]["log_probs"].dtype),
                "err": float((logits.double() - ref).abs().max()),
                "scale": float(ref.abs().max())}

    result = {"module": type(module).__name__, "fp32_head": hf.is_fp32_lm_head(module),
              "param_dtype": str(module.lm_head.weight.dtype),
              "autocast": str(engine._autocast_dtype), "on": run()}
    assert hf.disable_fp32_lm_head(module)
    result["off"] = run()
    dist.destroy_process_group()
    return result


# ------------------------------------------------------------------------------------ tests

@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    import torch

    from npu_flashrl.sim.tiny_models import build_tiny_qwen2

    path = str(tmp_path_factory.mktemp("qwen2"))
    build_tiny_qwen2(path, dtype=torch.float32, tokenizer=False,
                     config_overrides={"tie_word_embeddings": False})
    return path


@pytest.mark.parametrize("role", ["actor", "ref"])
def test_fsdp_engine_logits_fp32(model_dir, role):
    code = (f"import json, sys; sys.path[:0] = [{HERE!r}, {SUPPORT!r}]; import test_verl_server_lmhead_fp32 as t; "
            f"print('RESULT ' + json.dumps(t.child({model_dir!r}, {role!r}, {free_port()})))")
    env = dict(os.environ, FLASHRL_LMHEAD_FP32="1", TORCH_DEVICE_BACKEND_AUTOLOAD="0",
               PYTHONPATH=os.pathsep.join(p for p in (ROOT, os.environ.get("PYTHONPATH")) if p))
    env.pop("FLASHRL_CONFIG", None)
    proc = subprocess.run([sys.executable, "-W", "ignore", "-c", code], env=env, capture_output=True,
                          text=True, timeout=300)
    lines = [line for line in proc.stdout.splitlines() if line.startswith("RESULT ")]
    assert proc.returncode == 0 and lines, proc.stdout[-3000:] + proc.stderr[-3000:]
    res = json.loads(lines[-1][len("RESULT "):])

    assert res["module"].startswith("FSDP") and res["fp32_head"]  # FSDP2 kept the instance forward
    assert res["autocast"] == "torch.bfloat16"  # verl's default mixed precision
    assert res["param_dtype"] == "torch.float32"  # verl's model_dtype default; FSDP computes in bf16
    on, off = res["on"], res["off"]
    assert on["hidden_dtype"] == off["hidden_dtype"] == "torch.bfloat16"  # the body stays bf16
    assert on["forward_weight_dtype"] == "torch.bfloat16"  # FSDP's unsharded bf16 weight, kept
    assert on["logits_dtype"] == "torch.float32" and off["logits_dtype"] == "torch.bfloat16"
    assert on["log_probs_dtype"] == "torch.float32"
    # fp32 accumulation and no bf16 rounding of the logits: far closer to float64
    assert on["err"] < 1e-5 * on["scale"], on
    assert off["err"] > 20 * on["err"], (on, off)


def test_fused_kernels_with_fp32_head_refused_at_the_driver():
    """verl's fused kernels bypass lm_head: with FLASHRL_LMHEAD_FP32=1 the driver check refuses
    them instead of letting the fp32 head silently do nothing (verl 0.9.1's own trainer config)."""
    from omegaconf import OmegaConf

    import verl
    from npu_flashrl.adapters import verl as ad

    cfg = OmegaConf.load(os.path.join(os.path.dirname(verl.__file__), "trainer", "config",
                                      "_generated_ppo_trainer.yaml"))
    cfg = OmegaConf.merge(cfg, OmegaConf.from_dotlist(ad.tis_overrides(verl="0.9")))
    env = {"FLASHRL_CONFIG": "int8.yaml", "FLASHRL_LMHEAD_FP32": "1"}
    assert ad.check_rollout_mode(cfg, environ=env, verl="0.9") == []  # verl's default: not fused
    fused = OmegaConf.merge(cfg, OmegaConf.from_dotlist(["actor_rollout_ref.model.use_fused_kernels=True"]))
    with pytest.raises(ad.RolloutModeError, match="use_fused_kernels=False"):
        ad.check_rollout_mode(fused, environ=env, verl="0.9")
    ad.check_rollout_mode(fused, environ=dict(env, FLASHRL_LMHEAD_FP32="0"), verl="0.9")
