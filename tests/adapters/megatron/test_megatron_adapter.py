"""Megatron / MindSpeed trainer side (npu_flashrl.adapters.megatron) on CPU.

* Layout: a real megatron-core 0.12.1 ``GPTModel`` (local spec, gloo, TP=1) is built in a subprocess
  with a tiny Qwen2's weights put in Megatron's layout; its logits equal the HF model's, which proves
  the layout (fused per-KV-group QKV with bias, [gate; up] fc1, names). Two CPU shims are needed for the
  forward (not for building): ``torch.cuda.current_device`` (RotaryEmbedding moves ``inv_freq`` to it)
  and the CUDA RNG tracker's ``fork`` (DotProductAttention enters it for dropout).
* That state dict is sharded TP=2 (partition dims from the real model's parameters) and split PP=2,
  converted by ``megatron_to_hf_stream`` and compared with the HF state dict exactly; verl 0.6.1's own
  TP merge + name converter (identical to 51d2104's) produce the same stream, which the adapter passes
  through unchanged.
* The converted stream goes through the real online INT8 reload (vLLM + vllm-ascend on CPU) and gives the
  same INT8 state as loading the HF weights directly.
* Import-order guard with a stand-in MindSpeed (subprocesses; ``STANDIN`` below is a stand-in for
  ``mindspeed/megatron_adaptor.py``, which needs torch_npu/CANN); FP32 output_layer on a real
  ColumnParallelLinear.
* Architectures the INT8 reload does not handle (DeepSeek-V3 / MLA shapes) get one "INT8 rollout does
  not support <arch>" error, never a dense-formula shape error.

verl 51d2104's own worker modules and Hydra config: tests/adapters/megatron/test_megatron_verl_pin.py.
"""
import importlib.util
import json
import os
import subprocess
import sys
import tempfile
import textwrap

import pytest
import torch

from npu_flashrl import pins
from npu_flashrl.adapters import megatron as M
from npu_flashrl.adapters.megatron import stream as S
from npu_flashrl.sim.tiny_models import build_tiny_qwen2

pytestmark = pytest.mark.every_line  # line-specific upstream code: runs on every stack line
# The current line (requirements/cpu-stack-current.txt) has no megatron-core yet: verl 0.9's
# MindSpeed/Megatron core_r0.16 reads transformers 5 configs (no `rope_theta`), not done here.
# Not imported here: importing megatron in this process is what some tests below check for.
if importlib.util.find_spec("megatron") is None:
    pytest.skip("megatron-core is not in this stack line", allow_module_level=True)

ROOT = os.path.abspath(os.path.join(os.path.dirname(__file__), "..", "..", ".."))


def run_py(code, *, path_prefix=(), env=None, check=True):
    e = dict(os.environ)
    e.pop("FLASHRL_CONFIG", None)
    e["PYTHONPATH"] = os.pathsep.join([*path_prefix, ROOT, e.get("PYTHONPATH", "")])
    e["PYTHONWARNINGS"] = "ignore"
    e.update(env or {})
    r = subprocess.run([sys.executable, "-c", textwrap.dedent(code)], capture_output=True, text=True,
                       env=e, timeout=600)
    if check and r.returncode != 0:
        raise AssertionError(f"subprocess failed ({r.returncode}):\n{r.stdout}\n{r.stderr[-4000:]}")
    return r


# --------------------------------------------------------------------------- layout helpers (test side)

def hf_to_megatron(sd, cfg, te_names=False):
    """HF Qwen2 state dict -> Megatron GPT (TP=1) layout, following megatron-core's GPTModel."""
    hd = cfg.hidden_size // cfg.num_attention_heads
    ng, qpk = cfg.num_key_value_heads, cfg.num_attention_heads // cfg.num_key_value_heads
    out = {"embedding.word_embeddings.weight": sd["model.embed_tokens.weight"],
           "decoder.final_layernorm.weight": sd["model.norm.weight"],
           "output_layer.weight": sd["lm_head.weight"]}
    for i in range(cfg.num_hidden_layers):
        p, o = f"model.layers.{i}.", f"decoder.layers.{i}."
        for kind in ("weight", "bias"):
            q = sd[p + f"self_attn.q_proj.{kind}"].reshape(ng, qpk * hd, -1)
            k = sd[p + f"self_attn.k_proj.{kind}"].reshape(ng, hd, -1)
            v = sd[p + f"self_attn.v_proj.{kind}"].reshape(ng, hd, -1)
            fused = torch.cat([q, k, v], dim=1).reshape(ng * (qpk + 2) * hd, -1)
            out[o + f"self_attention.linear_qkv.{kind}"] = fused if kind == "weight" else fused.flatten()
        out[o + "self_attention.linear_proj.weight"] = sd[p + "self_attn.o_proj.weight"]
        out[o + "mlp.linear_fc1.weight"] = torch.cat([sd[p + "mlp.gate_proj.weight"], sd[p + "mlp.up_proj.weight"]])
        out[o + "mlp.linear_fc2.weight"] = sd[p + "mlp.down_proj.weight"]
        if te_names:
            out[o + "self_attention.linear_qkv.layer_norm_weight"] = sd[p + "input_layernorm.weight"]
            out[o + "mlp.linear_fc1.layer_norm_weight"] = sd[p + "post_attention_layernorm.weight"]
        else:
            out[o + "input_layernorm.weight"] = sd[p + "input_layernorm.weight"]
            out[o + "pre_mlp_layernorm.weight"] = sd[p + "post_attention_layernorm.weight"]
    return out


def tp_shards(name, t, tp, partition_dims):
    """Megatron's per-rank tensors: partition dim from the real model; fc1 is [gate_r; up_r] per rank
    (MLP.forward chunks the local fc1 output in two); QKV is contiguous because whole KV groups go to
    each rank."""
    rel = name.split(".", 3)[-1] if name.startswith("decoder.layers.") else name
    key = next((k for k in partition_dims if k.endswith(rel)), None)
    dim = partition_dims.get(key) if key else None
    if dim is None:
        return [t.clone() for _ in range(tp)]
    if rel == "mlp.linear_fc1.weight":
        gate, up = t.chunk(2)
        return [torch.cat([g, u]) for g, u in zip(gate.chunk(tp), up.chunk(tp))]
    return list(t.chunk(tp, dim=dim))


def pp_stages(mcore_sd, tp, pp, num_layers, partition_dims):
    """Per PP stage: [(local name, [tp shards])], as each stage's ranks hold them."""
    per = num_layers // pp
    stages = [[] for _ in range(pp)]
    for name, t in mcore_sd.items():
        shards = tp_shards(name, t, tp, partition_dims)
        if name.startswith("decoder.layers."):
            layer = int(name.split(".")[2])
            s = layer // per
            local = name.replace(f"decoder.layers.{layer}.", f"decoder.layers.{layer - s * per}.")
            stages[s].append(("module." + local, shards))
        elif name.startswith("embedding."):
            stages[0].append((name, shards))
        else:
            stages[-1].append((name, shards))
    return stages


def convert_stages(stages, cfg, **kw):
    out = {}
    for s, items in enumerate(stages):
        off = M.pp_layer_offset(s, len(stages), cfg.num_hidden_layers)
        for n, t in M.megatron_to_hf_stream(items, cfg, layer_offset=off, **kw):
            assert n not in out, f"{n} twice"
            out[n] = t
    return out


def assert_equal_sd(a, b):
    assert sorted(a) == sorted(b)
    for n in a:
        assert a[n].dtype == b[n].dtype and torch.equal(a[n], b[n]), n


# --------------------------------------------------------------------------- fixtures

GPT_SCRIPT = r"""
import contextlib, json, os, sys, torch
os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=sys.argv[3])
torch.distributed.init_process_group("gloo", rank=0, world_size=1)
from megatron.core import parallel_state as mpu, tensor_parallel
mpu.initialize_model_parallel(1, 1)
from megatron.core.models.gpt import GPTModel
from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
from megatron.core.transformer import TransformerConfig
from transformers import Qwen2ForCausalLM
hf = Qwen2ForCausalLM.from_pretrained(sys.argv[1], torch_dtype=torch.float32).eval()
c = hf.config
cfg = TransformerConfig(num_layers=c.num_hidden_layers, hidden_size=c.hidden_size,
    num_attention_heads=c.num_attention_heads, num_query_groups=c.num_key_value_heads,
    ffn_hidden_size=c.intermediate_size, add_qkv_bias=True, add_bias_linear=False, gated_linear_unit=True,
    activation_func=torch.nn.functional.silu, normalization="RMSNorm", layernorm_epsilon=c.rms_norm_eps,
    use_cpu_initialization=True, params_dtype=torch.float32, hidden_dropout=0.0, attention_dropout=0.0)
model = GPTModel(cfg, get_gpt_layer_local_spec(normalization="RMSNorm"), vocab_size=c.vocab_size,
    max_sequence_length=c.max_position_embeddings, position_embedding_type="rope",
    rotary_base=int(c.rope_theta), share_embeddings_and_output_weights=False).eval()
mc = torch.load(sys.argv[2])
missing = set(n for n, _ in model.named_parameters()) ^ set(mc)
assert not missing, missing
with torch.no_grad():
    for n, p in model.named_parameters():
        assert p.shape == mc[n].shape, (n, p.shape, mc[n].shape)
        p.copy_(mc[n])
# CPU shims for the forward only (see the module docstring)
torch.cuda.current_device = lambda: "cpu"
tensor_parallel.get_cuda_rng_tracker().fork = lambda *a, **k: contextlib.nullcontext()
ids = torch.randint(0, c.vocab_size, (2, 12), generator=torch.Generator().manual_seed(0))
pos = torch.arange(12)[None].expand(2, -1)
mask = torch.triu(torch.ones(1, 1, 12, 12, dtype=torch.bool), 1)
with torch.no_grad():
    got = model(ids, pos, attention_mask=mask)
    ref = hf(ids).logits
print(json.dumps({"max_err": float((got - ref).abs().max()), "ref_max": float(ref.abs().max()),
    "dims": {n: getattr(p, "partition_dim", None) if getattr(p, "tensor_model_parallel", False) else None
             for n, p in model.named_parameters()}}))
"""


@pytest.fixture(scope="module")
def tiny():
    d = tempfile.mkdtemp(prefix="npu_flashrl_megatron_")
    hf = build_tiny_qwen2(os.path.join(d, "w0"), seed=0)          # bf16, q/k/v bias, GQA 4/2
    other = build_tiny_qwen2(os.path.join(d, "w1"), seed=1)
    return d, hf, other


@pytest.fixture(scope="module")
def gpt_layout(tiny):
    d, hf, _ = tiny
    sd = {n: p.detach().float() for n, p in hf.state_dict().items()}
    path = os.path.join(d, "mcore.pt")
    torch.save(hf_to_megatron(sd, hf.config), path)
    from npu_flashrl.sim.cpu_vllm import free_port

    r = run_py(GPT_SCRIPT.replace("sys.argv[1]", repr(os.path.join(d, "w0")))
               .replace("sys.argv[2]", repr(path)).replace("sys.argv[3]", repr(str(free_port()))))
    return json.loads(r.stdout.strip().splitlines()[-1])


# --------------------------------------------------------------------------- layout and conversion

def test_megatron_gptmodel_layout_matches_hf(gpt_layout):
    assert gpt_layout["max_err"] < 1e-4 * max(1.0, gpt_layout["ref_max"]), gpt_layout["max_err"]
    dims = gpt_layout["dims"]
    assert dims["decoder.layers.0.self_attention.linear_qkv.weight"] == 0
    assert dims["decoder.layers.0.self_attention.linear_qkv.bias"] == 0
    assert dims["decoder.layers.0.self_attention.linear_proj.weight"] == 1
    assert dims["decoder.layers.0.mlp.linear_fc1.weight"] == 0
    assert dims["decoder.layers.0.mlp.linear_fc2.weight"] == 1
    assert dims["embedding.word_embeddings.weight"] == 0 and dims["output_layer.weight"] == 0
    assert dims["decoder.layers.0.input_layernorm.weight"] is None


@pytest.mark.parametrize("te_names", [False, True], ids=["local_spec", "te_spec"])
@pytest.mark.parametrize("use_verl", [True, False], ids=["verl_converter", "builtin_table"])
@pytest.mark.parametrize("tp,pp", [(1, 1), (2, 1), (1, 2), (2, 2)])
def test_tp_pp_shards_convert_to_hf_exactly(tiny, gpt_layout, tp, pp, te_names, use_verl):
    _, hf, _ = tiny
    sd = {n: p.detach() for n, p in hf.state_dict().items()}           # bf16, as verl sends
    mc = hf_to_megatron(sd, hf.config, te_names=te_names)
    dims = dict(gpt_layout["dims"])
    dims.update({k.replace("input_layernorm.weight", "self_attention.linear_qkv.layer_norm_weight"): None
                 for k in list(dims) if k.endswith("input_layernorm.weight")})
    stages = pp_stages(mc, tp, pp, hf.config.num_hidden_layers, dims)
    if tp == 1:  # a single TP rank may also send plain tensors
        stages = [[(n, s[0]) for n, s in st] for st in stages]
    assert_equal_sd(convert_stages(stages, hf.config, use_verl=use_verl), sd)


def test_verl_pipeline_stream_is_hf_and_passes_through(tiny, gpt_layout, monkeypatch):
    """What verl 51d2104 sends: per_tensor_generator's TP merge (default_tp_concat_fn, simple split)
    + McoreToHFWeightConverterDense on each gathered tensor. Reproduced with verl's own functions."""
    from megatron.core import mpu
    from verl.models.mcore.weight_converter import McoreToHFWeightConverterDense
    from verl.utils import megatron_utils as vmu

    _, hf, _ = tiny
    tp = 2
    monkeypatch.setattr(mpu, "get_tensor_model_parallel_world_size", lambda: tp)
    sd = {n: p.detach() for n, p in hf.state_dict().items()}
    mc = hf_to_megatron(sd, hf.config, te_names=True)
    conv = McoreToHFWeightConverterDense(hf.config, None)
    mapping = {"qkv_layer_name": "self_attention.linear_qkv.", "gate_proj_layer_name": "linear_fc1."}
    stream = []
    for name, t in mc.items():
        shards = tp_shards(name, t, tp, {**gpt_layout["dims"], "layer_norm_weight": None})
        probe = shards[0]
        if "layer_norm" not in name and "final_layernorm" not in name:
            probe.tensor_model_parallel, probe.partition_dim = True, (1 if name.endswith(S._ROW_PARALLEL) else 0)
            merged = vmu.default_tp_concat_fn(mapping, name, probe, shards, hf.config, hf.config, True)
        else:
            merged = probe
        merged = merged if isinstance(merged, list) else [merged]
        stream += list(zip(*conv.convert_param(name, merged)))
    assert_equal_sd(dict(stream), sd)
    out = list(M.megatron_to_hf_stream(iter(stream), hf.config))
    assert [n for n, _ in out] == [n for n, _ in stream]
    assert all(a is b for (_, a), (_, b) in zip(out, stream))  # identity pass, no copies


def test_stream_errors_name_the_tensor(tiny):
    _, hf, _ = tiny
    q = hf.model.layers[0].self_attn.q_proj.weight.detach()
    with pytest.raises(M.WeightStreamError, match=r"q_proj.weight: expected full shape .*TP shard"):
        list(M.megatron_to_hf_stream([("model.layers.0.self_attn.q_proj.weight", q[:64])], hf.config))
    with pytest.raises(M.WeightStreamError, match="layer 3 >= num_hidden_layers 2"):
        list(M.megatron_to_hf_stream([("model.layers.3.self_attn.q_proj.weight", q)], hf.config))
    with pytest.raises(M.WeightStreamError, match="unsupported Megatron parameter"):
        list(M.megatron_to_hf_stream([("decoder.layers.0.mlp.router.weight", q)], hf.config))
    with pytest.raises(M.WeightStreamError, match="must arrive unsharded"):
        list(M.megatron_to_hf_stream([("model.layers.0.self_attn.q_proj.weight", [q, q])], hf.config))
    assert list(M.megatron_to_hf_stream([("decoder.layers.0.self_attention.core_attention._extra_state",
                                          torch.zeros(1))], hf.config)) == []


def _deepseek_v3_config(**kw):
    from transformers import DeepseekV3Config

    return DeepseekV3Config(**kw)  # defaults are DeepSeek-V3's: hidden 7168, 128 heads, MLA (v_head_dim 128)


# DeepSeek-V3 / MLA tensors (as verl's McoreToHFWeightConverterDpskv3 names them), meta tensors: shapes only
MLA_STREAM = [
    ("model.layers.0.self_attn.o_proj.weight", (7168, 16384)),       # 128 heads x v_head_dim 128
    ("model.layers.0.self_attn.q_a_proj.weight", (1536, 7168)),
    ("model.layers.0.self_attn.kv_a_proj_with_mqa.weight", (576, 7168)),
    ("model.layers.0.mlp.gate_proj.weight", (18432, 7168)),
]


@pytest.mark.parametrize("archs", [["DeepseekV3ForCausalLM"], None], ids=["architectures", "model_type_only"])
def test_unsupported_architecture_one_clear_error(archs):
    cfg = _deepseek_v3_config(architectures=archs)
    stream = [(n, torch.empty(*shape, device="meta")) for n, shape in MLA_STREAM]
    with pytest.raises(M.UnsupportedArchitectureError) as exc:
        list(M.megatron_to_hf_stream(iter(stream), cfg))
    msg = str(exc.value)
    want = "DeepseekV3ForCausalLM" if archs else "model_type=deepseek_v3"
    assert msg.startswith(f"INT8 rollout does not support {want}:"), msg
    assert "expected" not in msg and "(7168, 8192)" not in msg        # no dense-formula shape error
    assert not M.is_dense_supported(cfg)


def test_unsupported_architecture_in_verl_stream_patch(monkeypatch, tmp_path):
    """The wrapped per_tensor_generator: INT8 rollout -> the one error; bf16-only FLASHRL_CONFIG ->
    verl's stream untouched (same tensor objects)."""
    cfg = _deepseek_v3_config(architectures=["DeepseekV3ForCausalLM"])
    stream = [(n, torch.empty(*shape, device="meta")) for n, shape in MLA_STREAM]
    gen = S._wrap_per_tensor_generator(lambda module, config, *a: iter(module))
    monkeypatch.setenv("FLASHRL_CONFIG", "int8_profile_free")
    with pytest.raises(M.UnsupportedArchitectureError, match="^INT8 rollout does not support DeepseekV3ForCausalLM"):
        list(gen(stream, cfg, None, None, None))
    monkeypatch.setenv("FLASHRL_CONFIG", "bf16")
    out = list(gen(stream, cfg, None, None, None))
    assert all(a is b for (_, a), (_, b) in zip(out, stream)) and len(out) == len(stream)


def test_dense_architectures_still_validated(tiny):
    """Qwen2/Qwen3/Llama keep the full-shape checks (what the INT8 reload consumes); names the
    reload does not consume are not judged."""
    from transformers import LlamaConfig, Qwen3Config

    _, hf, _ = tiny
    assert M.is_dense_supported(hf.config)
    for cls in (LlamaConfig, Qwen3Config):
        cfg = cls(hidden_size=64, num_attention_heads=4, num_key_value_heads=2, intermediate_size=96,
                  num_hidden_layers=2, vocab_size=128, head_dim=16)
        assert M.is_dense_supported(cfg)
        with pytest.raises(M.WeightStreamError, match=r"o_proj.weight: expected full shape \(64, 64\)"):
            list(M.megatron_to_hf_stream([("model.layers.0.self_attn.o_proj.weight", torch.zeros(64, 32))], cfg))
        odd = [("model.layers.0.self_attn.rotary_emb.inv_freq", torch.zeros(3))]
        assert [n for n, _ in M.megatron_to_hf_stream(odd, cfg)] == [odd[0][0]]


def test_fused_kernels_refused_with_fp32_lmhead():
    from omegaconf import OmegaConf

    on = {"FLASHRL_LMHEAD_FP32": "1"}
    base = {"model": {"use_fused_kernels": False},
            "actor": {"use_fused_kernels": "${oc.select:actor_rollout_ref.model.use_fused_kernels,false}"},
            "ref": {"use_fused_kernels": False}}
    cfg = OmegaConf.create(base)
    M.check_fused_kernels(cfg, environ=on)                               # default: fine
    cfg.model.use_fused_kernels = True
    with pytest.raises(M.FusedKernelsConflict) as exc:
        M.check_fused_kernels(cfg, environ=on)
    msg = str(exc.value)
    assert "actor_rollout_ref.model.use_fused_kernels=True" in msg
    assert "model_forward_fused.py" in msg and "actor_rollout_ref.model.use_fused_kernels=False" in msg
    M.check_fused_kernels(cfg, environ={"FLASHRL_LMHEAD_FP32": "0"})     # bf16 lm-head: nothing to bypass
    ref_only = OmegaConf.create({**base, "ref": {"use_fused_kernels": True}})
    with pytest.raises(M.FusedKernelsConflict, match="actor_rollout_ref.ref.use_fused_kernels=True"):
        M.check_fused_kernels(ref_only, environ=on)


def test_use_mbridge_warns_that_the_stream_check_is_bypassed():
    import logging

    from omegaconf import OmegaConf
    from npu_flashrl.adapters.megatron import workers as W

    seen = []
    handler = logging.Handler()
    handler.emit = lambda record: seen.append(record.getMessage())
    log = logging.getLogger("npu_flashrl.adapters.megatron")
    log.addHandler(handler)
    try:
        W._check_config(OmegaConf.create({"actor": {"megatron": {"use_mbridge": False}}, "model": {}}))
        assert seen == []
        W._check_config(OmegaConf.create({"actor": {"megatron": {"use_mbridge": True}}, "model": {}}))
    finally:
        log.removeHandler(handler)
    assert len(seen) == 1 and "use_mbridge=True" in seen[0] and "bridge.export_weights" in seen[0]


def test_pp_layer_offset():
    assert [M.pp_layer_offset(r, 4, 8) for r in range(4)] == [0, 2, 4, 6]
    assert [M.pp_layer_offset(r, 3, 10, first_stage_layers=2) for r in range(3)] == [0, 2, 6]
    assert [M.pp_layer_offset(r, 3, 10, last_stage_layers=2) for r in range(3)] == [0, 4, 8]


# --------------------------------------------------------------------------- into the INT8 reload


def test_megatron_stream_into_int8_reload_equals_hf_load(va, tiny, gpt_layout):
    from npu_flashrl.sim import cpu_vllm

    d, hf, _ = tiny
    sd = {n: p.detach().clone() for n, p in hf.state_dict().items()}
    stages = pp_stages(hf_to_megatron(sd, hf.config), 2, 2, hf.config.num_hidden_layers, gpt_layout["dims"])
    def synced(stream):
        with cpu_vllm.CpuVllm(os.path.join(d, "w1"), quantization="ascend",
                              choice=cpu_vllm.int8()) as v:   # other weights first
            v.model.load_weights(stream)
            va.end_weight_sync(v.model)
            return {n: p.detach().clone() for n, p in v.model.named_parameters()}

    def megatron_stream():
        for s, items in enumerate(stages):
            yield from M.megatron_to_hf_stream(items, hf.config, layer_offset=M.pp_layer_offset(s, 2, 2))

    got = synced(megatron_stream())
    want = synced(iter(list(sd.items())))
    assert got.keys() == want.keys()
    for n in got:
        assert torch.equal(got[n], want[n]), n
    qkv = got["model.layers.1.self_attn.qkv_proj.weight"]
    assert qkv.dtype == torch.int8


# --------------------------------------------------------------------------- import-order guard

STANDIN = '''
import sys
MEGATRON_BEFORE = sorted(k for k in sys.modules if k == "megatron" or k.startswith("megatron."))
REPATCHED = []
def repatch(cfg):
    REPATCHED.append(dict(cfg))
import megatron.core  # the real adaptor patches megatron modules on import
'''

FAKE_WORKERS = '''
try:
    from mindspeed.megatron_adaptor import repatch
except ImportError:
    repatch = None
from megatron.core import parallel_state as mpu

def per_tensor_generator(actor_module, model_config, *a, **k):
    yield from actor_module

class ActorRolloutRefWorker:
    def __init__(self, config, role="actor"):
        self.config = config
        if repatch is not None:
            repatch({"use_flash_attn": True})
'''


@pytest.fixture()
def standin(tmp_path):
    ms = tmp_path / "ms" / "mindspeed"
    ms.mkdir(parents=True)
    (ms / "__init__.py").write_text("")
    (ms / "megatron_adaptor.py").write_text(STANDIN)
    (tmp_path / "ms" / "fake_megatron_workers.py").write_text(FAKE_WORKERS)
    (tmp_path / "plain").mkdir()
    (tmp_path / "plain" / "fake_megatron_workers.py").write_text(FAKE_WORKERS)
    return str(tmp_path / "ms"), str(tmp_path / "plain")


def test_guard_imports_mindspeed_first(standin):
    r = run_py("""
        import sys
        from npu_flashrl.adapters import megatron as M
        assert M.install_import_guard()
        import megatron.core                      # someone imports megatron first ...
        import mindspeed.megatron_adaptor as a
        print(a.MEGATRON_BEFORE)                  # ... but the adaptor ran before it
        print(M.ensure_mindspeed_before_megatron("npu"))
        """, path_prefix=[standin[0]])
    assert r.stdout.split("\n")[:2] == ["[]", "already"]


def test_guard_ensure_imports_adaptor(standin):
    r = run_py("""
        from npu_flashrl.adapters import megatron as M
        print(M.ensure_mindspeed_before_megatron("npu"))
        import mindspeed.megatron_adaptor as a
        print(a.MEGATRON_BEFORE)
        """, path_prefix=[standin[0]])
    assert r.stdout.split("\n")[:2] == ["imported", "[]"]


def test_guard_megatron_imported_first_is_an_error(standin):
    r = run_py("""
        import megatron.core
        from npu_flashrl.adapters import megatron as M
        assert not M.install_import_guard()
        try:
            M.ensure_mindspeed_before_megatron("npu")
        except M.MindSpeedImportOrderError as e:
            print("ERR", e)
        import mindspeed.megatron_adaptor            # late import: still detected
        try:
            M.ensure_mindspeed_before_megatron("npu")
        except M.MindSpeedImportOrderError as e:
            print("ERR2", e)
        """, path_prefix=[standin[0]])
    out = r.stdout
    assert "ERR megatron (megatron" in out and "is not" in out
    assert "ERR2 megatron was imported before mindspeed.megatron_adaptor" in out
    assert "Fix: import mindspeed.megatron_adaptor before anything imports megatron" in out
    # the recommended override composes with the recipes' own '+...worker_process_setup_hook' (Hydra)
    assert M.RAY_HOOK_OVERRIDE in out and M.RAY_HOOK_OVERRIDE.startswith("++")


def test_guard_mindspeed_absent(standin):
    commit = pins.load_pins()["packages"]["mindspeed"]["commit"]
    r = run_py("""
        from npu_flashrl.adapters import megatron as M
        print(M.ensure_mindspeed_before_megatron("cuda"))   # GPU/CPU Megatron: no MindSpeed needed
        print(M.ensure_mindspeed_before_megatron(None))     # no torch_npu here
        M.install_import_guard("npu")
        import megatron.core.tensor_parallel  # the guard never refuses Megatron (FSDP jobs import it too)
        print(megatron.core.tensor_parallel.__name__)
        try:
            M.ensure_mindspeed_before_megatron("npu")  # where a Megatron model is built
        except M.MindSpeedMissingError as e:
            print("ERR", e)
        """, path_prefix=[standin[1]])
    lines = r.stdout.splitlines()
    assert lines[:3] == ["None", "None", "megatron.core.tensor_parallel"]
    assert lines[3].startswith("ERR ") and commit in lines[3]
    assert "gitee.com/ascend/MindSpeed" in lines[3] and "pip install -e ." in lines[3]
    assert "strategy=megatron" in lines[3] and "strategy=fsdp" in lines[3]


def test_guard_keeps_the_megatron_module_the_adaptor_loaded(standin):
    """The guard's own path: the first `import megatron` makes the guard import the adaptor, which
    imports megatron.core itself (as the real one does). The import that triggered the guard must get
    that same `megatron` module back, not a fresh namespace package without `core`."""
    r = run_py("""
        import sys
        from npu_flashrl.adapters import megatron as M
        assert M.install_import_guard()
        import megatron.core.tensor_parallel
        import mindspeed.megatron_adaptor as a
        m = sys.modules["megatron"]
        print(a.MEGATRON_BEFORE, m is megatron, m.core is sys.modules["megatron.core"])
        print(megatron.core.tensor_parallel.ColumnParallelLinear.__name__)
        print(m.__spec__.loader.__class__.__name__, list(m.__path__) == list(m.__spec__.submodule_search_locations))
        print(M.ensure_mindspeed_before_megatron("npu"))
        """, path_prefix=[standin[0]])
    lines = r.stdout.splitlines()
    assert lines[0] == "[] True True"
    assert lines[1] == "ColumnParallelLinear"
    assert lines[2].split()[0] != "_AlreadyLoaded" and lines[2].split()[1] == "True"   # the real spec is kept
    assert lines[3] == "already"


def test_guard_with_broken_mindspeed_warns_then_worker_refuses(standin, tmp_path):
    (tmp_path / "ms" / "mindspeed" / "megatron_adaptor.py").write_text("import no_such_dependency_xyz\n")
    r = run_py("""
        from npu_flashrl.adapters import megatron as M
        M.install_import_guard()
        import megatron.core.tensor_parallel        # an FSDP job's import: not refused
        print("imported")
        try:
            M.ensure_mindspeed_before_megatron("npu")   # a Megatron worker: the remembered error
        except ImportError as e:
            print("ERR", e.name)
        """, path_prefix=[standin[0]])
    assert r.stdout.splitlines() == ["imported", "ERR no_such_dependency_xyz"]
    assert "mindspeed.megatron_adaptor failed to import (ModuleNotFoundError" in r.stderr


def test_broken_mindspeed_is_not_swallowed(standin, tmp_path):
    (tmp_path / "ms" / "mindspeed" / "megatron_adaptor.py").write_text("import no_such_dependency_xyz\n")
    r = run_py("""
        from npu_flashrl.adapters import megatron as M
        try:
            M.ensure_mindspeed_before_megatron("npu")
        except ImportError as e:
            print("ERR", e.name)
        """, path_prefix=[standin[0]])
    assert "ERR no_such_dependency_xyz" in r.stdout


def test_worker_process_setup_hooks_verl_megatron_worker(standin):
    """Ray worker_process_setup_hook path: runs before the worker module is imported; the worker
    module (a stand-in with verl 51d2104's import lines) then sees MindSpeed first, its workers are
    wrapped, and its per_tensor_generator feeds megatron_to_hf_stream."""
    r = run_py("""
        import sys, torch
        from npu_flashrl import patches
        from npu_flashrl.adapters import megatron as M
        from npu_flashrl.adapters.megatron import _common
        _common.WORKER_MODULE = "fake_megatron_workers"
        M.worker_process_setup()
        assert "fake_megatron_workers" not in sys.modules and "megatron" not in sys.modules
        import fake_megatron_workers as w
        import mindspeed.megatron_adaptor as a
        print(a.MEGATRON_BEFORE)
        print(getattr(w.ActorRolloutRefWorker.__init__, "__wrapped__", None) is not None,
              getattr(w.per_tensor_generator, "__wrapped__", None) is not None)
        w.ActorRolloutRefWorker({})
        print(a.REPATCHED)
        from transformers import Qwen2Config
        cfg = Qwen2Config(hidden_size=8, num_attention_heads=2, num_key_value_heads=1, intermediate_size=12,
                          num_hidden_layers=1, vocab_size=16)
        try:
            list(w.per_tensor_generator([("model.layers.0.self_attn.q_proj.weight", torch.zeros(4, 8))], cfg))
        except M.WeightStreamError as e:
            print("ERR", e)
        """, path_prefix=[standin[0]])
    lines = r.stdout.splitlines()
    assert lines[:3] == ["[]", "True True", "[{'use_flash_attn': True}]"]
    assert lines[3].startswith("ERR model.layers.0.self_attn.q_proj.weight: expected full shape (8, 8)")


def test_worker_init_refuses_npu_without_mindspeed(standin):
    r = run_py("""
        from npu_flashrl.adapters import megatron as M
        from npu_flashrl.adapters.megatron import workers as W
        W._worker_device = lambda: "npu"            # verl.utils.device.is_npu_available on an NPU node
        init = W._wrap_worker_init(lambda self, config: print("built"))
        try:
            init(object(), {})
        except M.MindSpeedMissingError as e:
            print("ERR", str(e)[:60])
        W._worker_device = lambda: "cpu"
        init(object(), {})
        """, path_prefix=[standin[1]])
    assert r.stdout.splitlines() == ["ERR verl's Megatron backend (actor_rollout_ref.actor.strategy=me", "built"]


def test_patches_registered_and_lazy():
    from npu_flashrl import patches

    names = {p["name"] for p in patches.status()}
    assert {M.PATCH_GUARD, M.PATCH_STREAM, M.PATCH_LMHEAD} <= names
    r = run_py("""
        import sys
        from npu_flashrl import adapters
        adapters.load_all()
        print(sorted(k for k in sys.modules if k.split(".")[0] in ("megatron", "mindspeed", "verl")))
        """)
    assert r.stdout.strip() == "[]"


# --------------------------------------------------------------------------- FP32 output layer

FP32_SCRIPT = r"""
import os, sys, torch
os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=sys.argv[1])
torch.distributed.init_process_group("gloo", rank=0, world_size=1)
from megatron.core import parallel_state as mpu
mpu.initialize_model_parallel(1, 1)
from npu_flashrl import patches
from npu_flashrl.adapters import megatron as M
from megatron.core.models.gpt import GPTModel
from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
from megatron.core.transformer import TransformerConfig
cfg = TransformerConfig(num_layers=1, hidden_size=256, num_attention_heads=4, ffn_hidden_size=64,
    use_cpu_initialization=True, params_dtype=torch.bfloat16, bf16=True, init_method_std=0.5)
build = lambda: GPTModel(cfg, get_gpt_layer_local_spec(), vocab_size=1024, max_sequence_length=32,
                         share_embeddings_and_output_weights=False)
torch.manual_seed(0)
m = build()
head = m.output_layer
w = head.weight
x = (torch.randn(16, 2, 256) * 3).to(torch.bfloat16).requires_grad_(True)
ref = torch.einsum("sbh,vh->sbv", x.double(), w.double())
bf16, _ = head(x)
assert not M.is_fp32_output_layer(m)
assert M.enable_fp32_output_layer(m) and M.enable_fp32_output_layer(m)   # idempotent
assert head.weight is w and w.dtype == torch.bfloat16
out, _ = head(x)
err = lambda t: float((t.double() - ref).abs().max())
print("dtype", bf16.dtype, out.dtype)
print("closer", err(out) < err(bf16) / 10, err(out), err(bf16))
out.float().sum().backward()
print("grad", w.grad.dtype, x.grad.dtype)
# shared-embedding path: GPTModel passes the weight explicitly
out2, _ = head(x, weight=w)
print("explicit", out2.dtype, torch.equal(out2, out))
assert M.disable_fp32_output_layer(m) and not M.is_fp32_output_layer(m)
print("restored", head(x)[0].dtype)
os.environ["FLASHRL_LMHEAD_FP32"] = "1"
assert patches.apply_patch(M.PATCH_LMHEAD)
print("patched", M.is_fp32_output_layer(build()))
"""


def test_fp32_output_layer():
    from npu_flashrl.sim.cpu_vllm import free_port

    r = run_py(FP32_SCRIPT.replace("sys.argv[1]", repr(str(free_port()))))
    out = r.stdout.splitlines()
    assert "dtype torch.bfloat16 torch.float32" in out
    assert any(l.startswith("closer True") for l in out), out
    assert "grad torch.bfloat16 torch.bfloat16" in out
    assert "explicit torch.float32 True" in out
    assert "restored torch.bfloat16" in out
    assert "patched True" in out


def test_lmhead_switch():
    assert M.lmhead_fp32_requested({"FLASHRL_LMHEAD_FP32": "1"})
    assert not M.lmhead_fp32_requested({"FLASHRL_LMHEAD_FP32": "0"})
    assert not M.lmhead_fp32_requested({})
