"""Bad input at the W4A8 front door (issues 37 / 39): a W4A8 config, recipe launch, checkpoint or
rehearsal option that was accepted, or refused with the wrong reason, is refused before anything
starts, naming the file / key / flag and what was expected.

- the FlashRL config a recipe launch names is read by npu_flashrl's own reader in the preflight
  (`recipes/config_check.py`): a config every rollout process would refuse at activation (after Ray,
  the trainer and the model load) is refused before launch; a key the rollout ignores is a note;
- the preflight reads a config entry as that reader does: no `fn` is FlashRL's int8, the value is
  stripped; a `group_size` that is no group size is named, never replaced by the default;
- `wire: int8` on a W4A8 entry says why (not the bf16 entry's reason);
- a ModelSlim W4A8 checkpoint with fused-MoE experts on a line whose W4A8 MoE post-processing
  npu_flashrl does not follow (vllm-ascend v0.10.1rc1) is refused by `setup` / `verify`, as the
  engine build would refuse it;
- `npu-flashrl rehearse` refuses the W4A8 variant's limits without `--w4a8`.

The preflight runs in-process on a launch command (no recipe is spawned; the model dir holds a
config.json with Qwen2.5-7B's dims only). Stand-in: for the line rule, a description-only model
dir (the rule reads the description before any tensor).
"""
from __future__ import annotations

import json

import pytest

from npu_flashrl.lines import verl as verl_lines
from npu_flashrl.recipes import preflight as P

RO = "actor_rollout_ref.rollout."
FEATURES = ["fsdp", "current"]  # a config script of the current line, as the W4A8 recipe's
QWEN25_7B_DIMS = {"architectures": ["Qwen2ForCausalLM"], "hidden_size": 3584, "num_attention_heads": 28,
                  "intermediate_size": 18944, "max_position_embeddings": 32768}


def launch(tmp_path, config_text, precision="w4a8", tp=4):
    model = tmp_path / "model"
    model.mkdir(exist_ok=True)
    (model / "config.json").write_text(json.dumps(QWEN25_7B_DIMS))
    cfg = tmp_path / "flashrl.yaml"
    cfg.write_text(config_text)
    words = ["python3", "-m", "verl.trainer.main_ppo", f"actor_rollout_ref.model.path={model}",
             f"{RO}tensor_model_parallel_size={tp}", "trainer.n_gpus_per_node=8"]
    env = {"NPU_FLASHRL_PREFLIGHT_VERL": "0", "ROLLOUT_PRECISION": precision, "FLASHRL_CONFIG": str(cfg)}
    problems, notes = P.launch_phase(words, env, FEATURES, verl_lines.SERVER, True, None, "hint")
    return str(cfg), problems, notes


REFUSED_BY_THE_READER = {  # the config: what the refusal must name (the file comes first)
    "group_size_string": ("configs:\n  - fn: w4a8_profile_free\n    group_size: '128'\n",
                          "configs[0].group_size: expected a positive integer"),
    "group_size_negative": ("configs:\n  - fn: w4a8_profile_free\n    group_size: -128\n",
                            "configs[0].group_size = -128"),
    "group_size_on_int8": ("configs:\n  - fn: int8_profile_free\n    group_size: 128\n",
                           "configs[0].group_size: fn 'int8_profile_free' has no weight groups"),
    "w4a8_int8_wire": ("configs:\n  - fn: w4a8_profile_free\n    group_size: 128\n    wire: int8\n",
                       "configs[0].wire: int8 needs fn int8_profile_free"),
    "fp8": ("configs:\n  - fn: fp8\n", "configs[0].fn: fn='fp8' is not supported on Ascend"),
    "malformed": ("configs: [\n", "malformed YAML"),
}


@pytest.mark.parametrize("name", sorted(REFUSED_BY_THE_READER))
def test_the_preflight_refuses_a_config_the_rollout_would_refuse_naming_file_and_key(tmp_path, name):
    text, needle = REFUSED_BY_THE_READER[name]
    precision = "int8" if "int8_profile_free" in text or "fp8" in text else "w4a8"
    cfg, problems, _ = launch(tmp_path, text, precision)
    mine = [p for p in problems if p.startswith("FLASHRL_CONFIG: ")]
    assert len(mine) == 1, problems
    assert f"FLASHRL_CONFIG: {cfg}:" in mine[0] and needle in mine[0], mine
    # never the default group size in place of a value that is none
    assert not any("(the default group size)" in p for p in problems), problems


def test_a_sound_w4a8_config_passes_and_an_ignored_key_is_a_note(tmp_path):
    cfg, problems, notes = launch(tmp_path, "configs:\n  - fn: w4a8_profile_free\n    group_size: 128\n")
    assert problems == []
    cfg, problems, notes = launch(tmp_path, "configs:\n  - fn: w4a8_profile_free\n    group_size: 128\n"
                                            "    groupsize: 64\n")
    assert problems == []
    assert any(f"{cfg}: configs[0]: unknown key 'groupsize'" in n and "did you mean 'group_size'" in n
               for n in notes), notes


def test_an_entry_without_fn_is_int8_for_the_precision_rule(tmp_path):
    """FlashRL (and npu_flashrl's reader): a missing `fn` means int8; a W4A8 run with it would launch
    under the w4a8 name with an INT8 rollout."""
    cfg, problems, _ = launch(tmp_path, "configs:\n  - load_format: auto\n")
    assert any(f"ROLLOUT_PRECISION=w4a8 but FLASHRL_CONFIG {cfg} has fn: int8" in p for p in problems), problems


def test_a_padded_w4a8_fn_is_still_held_to_the_tp_split(tmp_path):
    """The reader strips `fn`; so does the preflight: group_size 256 at rollout TP 4 leaves o_proj
    896 input channels per rank, refused before launch."""
    cfg, problems, _ = launch(tmp_path, "configs:\n  - fn: ' w4a8_profile_free '\n    group_size: 256\n")
    assert any(f"group_size 256 ({cfg}: configs[0].group_size) does not divide" in p for p in problems), problems
    cfg, problems, _ = launch(tmp_path, "configs:\n  - fn: ' w4a8_profile_free '\n    group_size: 128\n")
    assert problems == []


def test_int8_wire_on_a_w4a8_entry_gives_the_w4a8_reason():
    from npu_flashrl.config import ConfigError, parse_config

    with pytest.raises(ConfigError) as exc:
        parse_config({"configs": [{"fn": "w4a8_profile_free", "wire": "int8"}]}, "cfg.yaml")
    message = str(exc.value)
    assert message.startswith("cfg.yaml: configs[0].wire: int8 needs fn int8_profile_free")
    assert "bf16" not in message and "fn 'w4a8_profile_free' do not hold" in message, message


MOE_DESCRIPTION = {"model.layers.0.self_attn.q_proj.weight": "W4A8_DYNAMIC",
                   "model.layers.0.mlp.experts.0.gate_proj.weight": "W4A8_DYNAMIC",
                   "model.layers.0.mlp.experts.1.down_proj.weight": "W4A8_DYNAMIC",
                   "model.layers.0.mlp.gate.weight": "FLOAT", "group_size": 256}


@pytest.mark.parametrize("label", ["0.10.1rc1", "0.11.0", "0.23.0"])
def test_w4a8_moe_experts_are_refused_by_setup_on_the_line_that_does_not_reload_them(monkeypatch, label, tmp_path):
    from npu_flashrl.lines import detect
    from npu_flashrl.w4a8_checkpoint import DESCRIPTION_FILE, line_problems, w4a8_checkpoint_problems

    line = next(ln for ln in detect.LINES if ln.vllm_ascend == label)
    monkeypatch.setattr(detect, "current", lambda: line)
    found = line_problems("desc.json", MOE_DESCRIPTION)
    if line.w4a8_moe_cast is not None:
        assert found == []
        return
    assert len(found) == 1, found
    assert found[0].startswith("desc.json: model.layers.0.mlp.experts.0.gate_proj is a W4A8_DYNAMIC fused-MoE "
                               "expert (2 expert projection(s)); vllm-ascend 0.10.1rc1's")
    assert "0.11.0, 0.23.0" in found[0]
    assert line_problems("desc.json", {k: v for k, v in MOE_DESCRIPTION.items() if ".experts." not in k}) == []
    (tmp_path / DESCRIPTION_FILE).write_text(json.dumps(MOE_DESCRIPTION))
    assert w4a8_checkpoint_problems(str(tmp_path)) == [found[0].replace("desc.json", str(tmp_path / DESCRIPTION_FILE))]


@pytest.mark.every_line
def test_w4a8_moe_experts_on_the_installed_line(tmp_path):
    """The installed line's answer (the pinned line, v0.10.1rc1, refuses; 0.11.0 and 0.23.0 reload)."""
    from npu_flashrl import lines
    from npu_flashrl.w4a8_checkpoint import line_problems

    found = line_problems("desc.json", MOE_DESCRIPTION)
    assert bool(found) == (lines.current().w4a8_moe_cast is None), found


@pytest.mark.parametrize("flags", [["--max-w4a8-error", "2"], ["--max-w4a8-layer-error", "0.5"],
                                   ["--group-size", "32"], ["--grpo", "--max-w4a8-layer-error", "0.5"]])
def test_rehearse_refuses_the_w4a8_variants_options_without_w4a8(flags):
    from npu_flashrl.cli import build_parser
    from npu_flashrl.errors import CliError
    from npu_flashrl.rehearsal.arguments import DEFAULT_MAX_W4A8_LAYER_ERROR, check_arguments

    args = build_parser().parse_args(["rehearse", *flags])
    with pytest.raises(CliError, match=rf"^{flags[-2]} \S+ is the W4A8 variant's: add --w4a8, or drop it"):
        check_arguments(args)
    args = build_parser().parse_args(["rehearse", *flags, "--w4a8"])
    if flags[0] == "--grpo":
        check_arguments(args)
        assert args.max_w4a8_layer_error == 0.5
    args = build_parser().parse_args(["rehearse"])
    check_arguments(args)
    assert args.max_w4a8_layer_error == DEFAULT_MAX_W4A8_LAYER_ERROR  # the default, when not given


@pytest.mark.parametrize("fn, precision", [(None, "w4a8"), ("int8_profile_free", "w4a8"), (None, "bf16"),
                                           ("w4a8_profile_free", "int8")])
def test_an_entry_recipe_refuses_a_precision_its_fn_does_not_set_up(fn, precision):
    """FLASHRL_FN decides what `npu-flashrl setup` writes; ROLLOUT_PRECISION (its default follows it)
    names the run. Both given and disagreeing: refused before setup, naming both."""
    env = {"ROLLOUT_PRECISION": precision, **({"FLASHRL_FN": fn} if fn else {})}
    problems, _, _ = P.vars_phase(env, ["entry", "any", "current"])
    assert any(p.startswith(f"ROLLOUT_PRECISION={precision} with FLASHRL_FN={fn or 'int8'}: ") for p in problems), \
        problems
    agreeing = {"FLASHRL_FN": fn or "int8", "ROLLOUT_PRECISION": "w4a8" if fn == "w4a8_profile_free" else "int8"}
    assert P.vars_phase(agreeing, ["entry", "any", "current"])[0] == []
    assert P.vars_phase(env, ["fsdp", "current"])[0] == []  # a config script: its own recipe_sets rule


@pytest.mark.parametrize("extra", ["group_size=abc", "group_size=1.5", "group_size=-64", "group_size="])
def test_a_setup_extra_group_size_that_is_none_is_named_not_replaced_by_the_default(tmp_path, extra):
    model = tmp_path / "model"
    model.mkdir()
    (model / "config.json").write_text(json.dumps(QWEN25_7B_DIMS))
    words = ["python3", "-m", "verl.trainer.main_ppo", f"actor_rollout_ref.model.path={model}",
             f"{RO}tensor_model_parallel_size=4", "trainer.n_gpus_per_node=8"]
    env = {"NPU_FLASHRL_PREFLIGHT_VERL": "0", "FLASHRL_FN": "w4a8_profile_free", "SETUP_EXTRA": f"load_format=auto {extra}",
           "FLASHRL_CONFIG": str(tmp_path / "not_written_yet.yaml")}
    problems, _ = P.launch_phase(words, env, ["entry", "any", "current"], verl_lines.SERVER, True, None, "hint")
    assert len(problems) == 1, problems
    assert problems[0].startswith(f"SETUP_EXTRA=load_format=auto {extra}: {extra}: expected a positive integer")
    env["SETUP_EXTRA"] = "group_size=0"  # a group size (per-channel), but not for a bare bf16 checkpoint
    problems, _ = P.launch_phase(words, env, ["entry", "any", "current"], verl_lines.SERVER, True, None, "hint")
    assert len(problems) == 1 and problems[0].startswith("group_size 0 (SETUP_EXTRA=group_size=0) with "), problems
    assert "bare bf16 checkpoint" in problems[0] and "expected a positive integer" not in problems[0]


def test_a_w4a8_entrys_quantization_key_is_refused_unless_ascend():
    """The engine build sets quantization 'ascend' for every quantized entry: another value on a W4A8
    entry was overwritten without a word (the INT8 fns keep FlashRL's key)."""
    from npu_flashrl.config import ConfigError, parse_config

    for value in ("compressed-tensors", "awq"):
        with pytest.raises(ConfigError, match=rf"^cfg.yaml: configs\[0\].quantization: '{value}' with fn "
                                              r"'w4a8_profile_free': .* would be overwritten; drop it"):
            parse_config({"configs": [{"fn": "w4a8_profile_free", "quantization": value}]}, "cfg.yaml")
    assert parse_config({"configs": [{"fn": "w4a8_profile_free", "quantization": "ascend"}]}).entries[0].quantization
    assert parse_config({"configs": [{"fn": "int8_profile_free", "quantization": "compressed-tensors"}]})


def test_w4a8_as_a_flashrl_config_shortcut_says_how_to_write_one(monkeypatch, tmp_path):
    from npu_flashrl.config import ConfigError, load_config

    monkeypatch.chdir(tmp_path)
    with pytest.raises(ConfigError, match=r"^'w4a8_profile_free': fn 'w4a8_profile_free' is not a shortcut .*"
                                          r"`npu-flashrl setup -m MODEL --fn w4a8_profile_free -o FILE"):
        load_config("w4a8_profile_free")


@pytest.mark.parametrize("fn", ["w4a8_profile_free", "int8_profile_free"])
def test_the_bf16_recipe_refuses_a_quantized_config(tmp_path, fn):
    """The bf16 twin handed the W4A8 (or INT8) config would launch a quantized rollout under the
    bf16 name."""
    cfg, problems, _ = launch(tmp_path, f"configs:\n  - fn: {fn}\n    model: /x\n", precision="bf16")
    assert any(p.startswith(f"ROLLOUT_PRECISION=bf16 but FLASHRL_CONFIG {cfg} has fn: {fn}") for p in problems), \
        problems
    assert launch(tmp_path, "configs:\n  - fn: bf16\n", precision="bf16")[1] == []
