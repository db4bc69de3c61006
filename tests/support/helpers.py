"""Helpers shared by the reload / sync tests (imported as `helpers`: tests/ is on sys.path, as for
`modelslim_writer` and `verl_server_engine`). Weight-sync delivery and state comparison helpers
are in `npu_flashrl.sim.sync` (the benchmarks use them too)."""
import contextlib
import json
import logging
import os
import subprocess
import sys

import torch

from npu_flashrl.sim import cpu_vllm

# vLLM's fused rollout layers of a Qwen2-style decoder layer -> the checkpoint projections in them
FUSED = {"self_attn.qkv_proj": ("q_proj", "k_proj", "v_proj"), "self_attn.o_proj": ("o_proj",),
         "mlp.gate_up_proj": ("gate_proj", "up_proj"), "mlp.down_proj": ("down_proj",)}


def build(va, model_dir, fn="int8_profile_free", profile=None, ascend=True, **kw):
    """The policy rollout's INT8 model of `model_dir` on the CPU harness, its engine choice
    carrying npu_flashrl's online quantizer `fn` (None: the checkpoint as loaded, profile-free
    reloads); with `fn` None and not `ascend`, vLLM's own model, no npu_flashrl. `va` (the
    vllm_ascend adapter fixture) only makes sure the patches are applied."""
    if not (fn or ascend):
        return cpu_vllm.CpuVllm(model_dir, **kw)
    return cpu_vllm.CpuVllm(model_dir, quantization="ascend",
                            choice=cpu_vllm.int8(fn or "int8_profile_free", profile), **kw)


def fresh_states(va, dirs, ks) -> dict:
    """{k: the state of a fresh `build` of dirs[k]}: what a sync of k's weights must equal."""
    from npu_flashrl.sim.sync import state

    out = {}
    for k in ks:
        with build(va, dirs[k]) as f:
            out[k] = state(f.model)
    return out


def layerwise_reload():
    """vLLM's layerwise reload (`model_loader.reload`); skips the test on a vLLM without it."""
    import pytest

    return pytest.importorskip("vllm.model_executor.model_loader.reload",
                               reason="vLLM's layerwise reload (vLLM >= 0.16)")


def deliver_spread_experts(model, weights, seed: int, expert_bytes: int) -> None:
    """Delivers `weights` in random buckets of at most four experts' bytes through one reused
    buffer (`sim.sync.BucketBuffer`), after asserting that layer 0's experts are spread over
    more than two buckets."""
    from npu_flashrl.sim.sync import BucketBuffer, bucket_bytes, random_buckets

    buckets = random_buckets(weights, seed=seed, max_bytes=4 * expert_bytes)
    layer0 = {b for b, bucket in enumerate(buckets) for n, _ in bucket
              if n.startswith("model.layers.0.mlp.experts.")}
    assert len(layer0) > 2, "layer 0's experts must be spread over several buckets"
    buffer = BucketBuffer(bucket_bytes(buckets))
    for bucket in buckets:
        buffer.deliver(model, bucket)


def fresh_w4a8_state(ms_dir):
    """Every parameter of a fresh W4A8 load of `ms_dir` (vllm-ascend's own path, no npu_flashrl
    loader)."""
    from npu_flashrl.sim.sync import state

    with cpu_vllm.CpuVllm(ms_dir, quantization="ascend") as v:
        assert getattr(v.model, "_npu_flashrl_loader", None) is None
        return state(v.model)


def assert_equal_states(got, want):
    """The same parameter names, each of the same dtype and equal bit for bit."""
    assert got.keys() == want.keys()
    for n in want:
        assert got[n].dtype == want[n].dtype and torch.equal(got[n], want[n]), f"{n} differs"


def hf_weights(model, dtype=None):
    """(name, tensor) of a transformers model's parameters, cloned (cast to `dtype` when given)."""
    return [(n, p.detach().clone().to(dtype) if dtype is not None else p.detach().clone())
            for n, p in model.named_parameters()]


ROOT = os.path.abspath(os.path.join(os.path.dirname(__file__), "..", ".."))
FAULT_ENV = "NPU_FLASHRL_REHEARSAL_FAULT"  # the rehearsal's fault seam (npu_flashrl.sim.faults)


def run_python_json(code: str, timeout: float = 600) -> dict:
    """Run `code` in a fresh interpreter (this checkout first on the path, an inherited PYTHONPATH
    kept, no torch_npu autoload, no vLLM plugins; for patches that are process-global) and return
    the JSON object its last line of output prints. A failed run fails the test with its output."""
    path = os.pathsep.join(p for p in (ROOT, os.environ.get("PYTHONPATH", "")) if p)
    env = dict(os.environ, TORCH_DEVICE_BACKEND_AUTOLOAD="0", VLLM_PLUGINS="none", PYTHONPATH=path)
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=timeout,
                          env=env, cwd=ROOT)
    if proc.returncode != 0:
        raise AssertionError(f"subprocess failed ({proc.returncode}):\n{proc.stdout[-3000:]}\n{proc.stderr[-6000:]}")
    return json.loads(proc.stdout.strip().splitlines()[-1])


def ppo_clip_per_token(cfg, old, current, adv):
    """PPO-clip with dual clip, per token (verl's vanilla loss before weighting/aggregation), from
    verl's actor config fields (`clip_ratio`, `clip_ratio_low` / `_high`, `clip_ratio_c`)."""
    ratio = torch.exp(current - old)
    low = cfg.clip_ratio_low if cfg.clip_ratio_low is not None else cfg.clip_ratio
    high = cfg.clip_ratio_high if cfg.clip_ratio_high is not None else cfg.clip_ratio
    pg = torch.maximum(-adv * ratio, -adv * torch.clamp(ratio, 1 - low, 1 + high))
    return torch.where(adv < 0, torch.minimum(pg, -adv * cfg.clip_ratio_c), pg)


def masked_mean(x, mask):
    return (x * mask).sum() / mask.sum()


def rehearsal_env() -> dict:
    """Environment of a `npu-flashrl rehearse` subprocess: this checkout first on the path, no
    torch_npu autoload, no vLLM plugins, offline, and none of a user's FlashRL settings or faults."""
    env = dict(os.environ, TORCH_DEVICE_BACKEND_AUTOLOAD="0", VLLM_PLUGINS="none", HF_HUB_OFFLINE="1",
               TRANSFORMERS_OFFLINE="1", PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""))
    for k in ("FLASHRL_CONFIG", "FLASHRL_LMHEAD_FP32", FAULT_ENV):
        env.pop(k, None)
    return env


def forward_tensors(model) -> dict:
    """Everything a forward reads: parameters, buffers, and the tensors vllm-ascend derives as
    plain attributes (not parameters): `weight_scale_fp32` of its W8A8 linear layers,
    `w13_weight_scale_fp32` of its fused-MoE layers (and `fused_w1_scale` / `fused_w2_scale`
    with fused MC2)."""
    out = dict(model.named_parameters())
    out.update((f"buffer:{n}", b) for n, b in model.named_buffers())
    for name, mod in model.named_modules():
        for attr, t in vars(mod).items():
            if (attr.endswith("scale_fp32") or attr.startswith("fused_w")) and \
                    isinstance(t, torch.Tensor) and not isinstance(t, torch.nn.Parameter):
                out[f"{name}.{attr}"] = t
    return out


def set_verl_replica_env(tag: str) -> dict:
    """What verl's rollout replica 0 has in its environment (the ZMQ handle of its weight
    receiver is built from VERL_RAY_JOB_ID); returns the previous values for `restore_environ`."""
    saved = {k: os.environ.get(k) for k in ("VERL_RAY_JOB_ID", "VERL_REPLICA_RANK")}
    os.environ["VERL_RAY_JOB_ID"] = f"npu-flashrl-{tag}-{os.getpid()}"
    os.environ["VERL_REPLICA_RANK"] = "0"
    return saved


def restore_environ(saved: dict) -> None:
    for k, v in saved.items():
        if v is None:
            os.environ.pop(k, None)
        else:
            os.environ[k] = v


class LogRecords(logging.Handler):
    """A logging handler that keeps every record of `level` and above in `records`."""

    def __init__(self, level=logging.WARNING):
        super().__init__(level)
        self.records = []

    def emit(self, record):
        self.records.append(record)


@contextlib.contextmanager
def emulated_torch_npu():
    """torch_npu, the emulation installed for the block (uninstalled after it unless it already
    was)."""
    from npu_flashrl.kernels import emulation

    was = emulation.is_installed()
    emulation.install()
    import torch_npu

    try:
        yield torch_npu
    finally:
        if not was:
            emulation.uninstall()


def needs_grpo_line():
    """The skip mark of `rehearse --grpo` tests: verified on the current and 0.11 lines only
    (the pinned line's verl 51d2104 has the same functions as 0.6.1, but the run was not tried
    there: skipped rather than claimed)."""
    import pytest

    from npu_flashrl import lines

    try:
        line = lines.current().name
    except lines.UnsupportedVersion:
        line = None
    return pytest.mark.skipif(line not in ("0.23.0", "0.11.0"),
                              reason="rehearse --grpo is verified on the current and 0.11 lines only")


def verl_npu_fused_moe(monkeypatch):
    """(vLLM's FusedMoE class with its bare weight_loader, verl's `npu_vllm_patch` module) for a
    test of verl 0.9's NPU FusedMoE weight-loader wrapper; skips where verl has none. Importing
    `verl.utils.vllm` runs verl's NPU patches process-wide (FusedMoE.weight_loader,
    ApplyRotaryEmb.__init__): both are restored after the test (a later model of this process
    loaded through the wrapper gets its square experts transposed)."""
    import pytest
    from packaging.version import Version

    from npu_flashrl.pins import installed_version

    verl_version, _ = installed_version(["verl"])
    # read from the metadata first: importing verl 0.6 here would make the verl 51d2104 tests of
    # this process skip (one process holds one verl)
    if verl_version is None or Version(verl_version) < Version("0.8"):
        pytest.skip(f"verl {verl_version or '(source tree)'} has no NPU FusedMoE weight-loader "
                    "wrapper (verl 0.9.1's verl/utils/vllm/npu_vllm_patch.py)")
    FusedMoE = pytest.importorskip("vllm.model_executor.layers.fused_moe").FusedMoE
    if isinstance(FusedMoE, type):
        monkeypatch.setattr(FusedMoE, "weight_loader", FusedMoE.weight_loader)
    try:
        from vllm.model_executor.layers.rotary_embedding.common import ApplyRotaryEmb
    except ImportError:
        pass
    else:
        monkeypatch.setattr(ApplyRotaryEmb, "__init__", ApplyRotaryEmb.__init__)
    try:
        npu_patch = __import__("verl.utils.vllm.npu_vllm_patch", fromlist=["_"])
    except ImportError as exc:
        pytest.skip(f"verl's NPU vLLM patches do not import on this stack: {exc}")
    if not hasattr(npu_patch, "_patch_legacy_fused_moe_weight_loader"):
        pytest.skip("this verl has no FusedMoE weight-loader wrapper")
    loader = FusedMoE.weight_loader
    while getattr(loader, "_verl_npu_weight_loader_patched", False):
        loader = loader.__wrapped__  # importing verl.utils.vllm may have installed it already
    FusedMoE.weight_loader = loader  # unwrapped now; the original is restored after the test
    return FusedMoE, npu_patch
