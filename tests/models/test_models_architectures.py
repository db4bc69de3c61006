"""The covered-architectures table (`npu_flashrl.architectures`): docs/compatibility.md shows it
as it is, every test it cites exists, and `verify` / `setup` / the engine build say when a model's
architecture is not (fully) covered and what was verified instead."""
import json
import logging
import os

import pytest

from npu_flashrl import architectures

from helpers import ROOT


def _model_dir(tmp_path, arch):
    d = tmp_path / arch
    d.mkdir()
    (d / "config.json").write_text(json.dumps({"architectures": [arch]}))
    return str(d)


def test_docs_show_the_table_as_it_is():
    with open(os.path.join(ROOT, "docs", "compatibility.md")) as f:
        text = f.read()
    begin, end = "<!-- architectures:begin -->\n", "\n<!-- architectures:end -->"
    assert begin in text and end in text
    assert text.split(begin, 1)[1].split(end, 1)[0] == architectures.table_markdown()


def test_every_cell_is_backed_by_an_existing_test_module():
    for a in architectures.COVERED:
        assert a.tests, a.name
        for t in a.tests:
            assert os.path.isfile(os.path.join(ROOT, t)), f"{a.name}: {t} does not exist"
        assert len(a.cells) == len(architectures.COLUMNS)
    names = [a.name for a in architectures.COVERED]
    assert len(set(names)) == len(names) and not set(names) & set(architectures.NOT_COVERED)


def test_verify_warns_for_an_architecture_not_covered_and_names_what_was_verified(tmp_path):
    from npu_flashrl.verify import WARN, architecture_rows

    class Entry:
        def __init__(self, model):
            self.model = model

    gpt2 = _model_dir(tmp_path, "GPT2LMHeadModel")
    vl = _model_dir(tmp_path, "Qwen2_5_VLForConditionalGeneration")
    qwen2 = _model_dir(tmp_path, "Qwen2ForCausalLM")
    ds = _model_dir(tmp_path, "DeepseekV3ForCausalLM")
    rows = architecture_rows([Entry(gpt2), Entry(vl), Entry(qwen2), Entry(ds), Entry(gpt2)])
    assert [r["check"] for r in rows] == [f"architecture of {gpt2}", f"architecture of {vl}",
                                          f"architecture of {ds}"]
    assert all(r["status"] == WARN for r in rows)
    assert "GPT2LMHeadModel is not covered" in rows[0]["detail"]
    assert "verified instead: Qwen2ForCausalLM; " in rows[0]["detail"]
    assert "LlamaForCausalLM" in rows[0]["detail"] and "DeepseekV3ForCausalLM" in rows[0]["detail"]
    assert "covered in part" in rows[1]["detail"] and "Megatron export" in rows[1]["detail"]
    assert "covered in part" in rows[2]["detail"] and "Megatron export: no" in rows[2]["detail"]


def test_setup_logs_the_coverage_warning(tmp_path, caplog):
    from npu_flashrl import commands

    gpt2 = _model_dir(tmp_path, "GPT2LMHeadModel")
    with caplog.at_level(logging.WARNING, logger="npu_flashrl.architectures"):
        commands.setup("int8_profile_free", gpt2, None, str(tmp_path / "flashrl.yaml"), check=False)
    assert any(f"setup -m {gpt2}: architecture GPT2LMHeadModel is not covered" in r.getMessage()
               for r in caplog.records)


@pytest.mark.parametrize("name", ["Qwen2ForCausalLM", "Qwen3MoeForCausalLM", "LlamaForCausalLM"])
def test_fully_covered_architectures_get_no_warning(name):
    assert architectures.coverage_problem(name) is None


def test_a_partly_covered_architecture_names_its_gaps():
    problem = architectures.coverage_problem("DeepseekV3ForCausalLM")
    assert problem.startswith("architecture DeepseekV3ForCausalLM is covered in part (Megatron export: no: "
                              "the current line's verl engine builds mbridge 0.15.1's DeepseekV3Bridge before")
    assert "forward on CPU" not in problem and "MoE:" not in problem
