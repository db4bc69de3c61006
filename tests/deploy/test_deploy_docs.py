"""docs/: the pins table never drifts from pins.yaml, every documented knob exists and every knob is
documented, every referenced file exists, the required topics are covered."""

from __future__ import annotations

import re
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
DOCS = ROOT / "docs"
sys.path.insert(0, str(ROOT))
from npu_flashrl.pins import load_pins, markdown_table  # noqa: E402

PINS = load_pins()
LINES = {"pinned": PINS, "current": load_pins(line="current")}
SCRIPTS = sorted(list((ROOT / "scripts").glob("install_pinned.sh")) + list((ROOT / "docker").glob("*.sh"))
                 + list((ROOT / "tests" / "verl_examples").rglob("*.sh")))


def doc(name):
    return (DOCS / name).read_text()


def all_docs():
    return "\n".join(p.read_text() for p in sorted(DOCS.glob("*.md")))


@pytest.mark.parametrize("line", sorted(LINES))
def test_pins_table_matches_pins_file(line):
    text = doc("compatibility.md")
    marker = "pins" if line == "pinned" else f"pins:{line}"
    m = re.search(rf"<!-- {marker}:begin -->\n(.*?)<!-- {marker}:end -->", text, re.S)
    assert m, f"{marker} markers missing in docs/compatibility.md"
    assert m.group(1) == markdown_table(LINES[line]), f"regenerate with: python3 npu_flashrl/pins.py --line {line} table"


@pytest.mark.parametrize("line", sorted(LINES))
def test_every_pinned_commit_and_version_is_in_the_docs(line):
    text = doc("compatibility.md")
    pins = LINES[line]
    for name, spec in pins["packages"].items():
        for field in ("commit", "ref", "version"):
            if field in spec:
                assert str(spec[field]) in text, (name, field)
    assert pins["cann"] in text and pins["python"] in text
    for image in pins["docker"].values():
        assert image in text


def test_every_script_variable_is_documented():
    conf = doc("configuration.md")
    pattern = re.compile(r'^\s*([A-Z][A-Z0-9_]*)="\$\{\1:-', re.M)
    missing = set()
    for script in SCRIPTS:
        for var in pattern.findall(script.read_text()):
            if f"`{var}`" not in conf and not re.search(rf"\b{var}\b", conf):
                missing.add(f"{var} ({script.name})")
    assert not missing, f"undocumented in docs/configuration.md: {sorted(missing)}"


def test_runtime_env_and_cli_reference():
    from npu_flashrl.config import SUPPORTED_FNS  # every fn `setup --fn` takes

    conf = doc("configuration.md")
    for var in ["FLASHRL_CONFIG", "FLASHRL_LOGGING_LEVEL", "FLASHRL_LOGGING_FILE", "FLASHRL_LMHEAD_FP32",
                "NPU_FLASHRL_PINS"]:
        assert f"`{var}`" in conf, var
    for cmd, flags in {
        "npu-flashrl profile": ["-m BF16_DIR", "-q W8A8_DIR", "-o OUT.pt", "--fn int8"],
        "npu-flashrl setup": ["-m MODEL", "-p PROFILE", "--fn {" + ",".join(SUPPORTED_FNS) + "}", "-o CONFIG.yaml", "`-a`",
                              "key=value"],
        "npu-flashrl cleanup": [],
        "npu-flashrl verify": ["--config F", "--json"],
        "npu-flashrl rehearse": ["--model DIR", "--device cpu\\|npu"],
    }.items():
        row = next((line for line in conf.splitlines() if line.startswith(f"| `{cmd}`")), None)
        assert row is not None, cmd
        for f in flags:
            assert f in row, (cmd, f)
    for flag in ["--line pinned|current", "--dry-run", "--workdir", "--log", "--only", "--skip-checks",
                 "--allow-mismatch", "--no-verify"]:
        assert flag in conf
    for key in ["rollout_is", "rollout_is_threshold", "rollout_is_batch_normalize", "bypass_mode",
                "use_policy_gradient", "calculate_log_probs", "actor_rollout_ref.rollout.mode"]:
        assert key in conf


def test_referenced_repository_files_exist():
    text = all_docs()
    refs = set(re.findall(r"\b((?:scripts|docker|tests/verl_examples|npu_flashrl)/[\w./-]+\.(?:sh|py|yaml|md))", text))
    assert refs
    missing = sorted(r for r in refs if "{" not in r and not (ROOT / r).exists())
    assert not missing, missing
    for link in re.findall(r"\]\(([\w_]+\.md)(?:#[\w-]+)?\)", text):
        assert (DOCS / link).exists(), link


def test_required_topics():
    q = doc("quickstart_a2.md")
    steps = re.findall(r"^(\d+)\. \*\*", q, re.M)
    assert [int(s) for s in steps] == list(range(1, len(steps) + 1)) and len(steps) >= 8
    for needed in ["install_pinned.sh", "prepare_data.sh", "--dry-run", "NNODES", "RAY_ADDRESS", "ray start",
                   "docker/run.sh", "npu_flashrl: patched"]:
        assert needed in q, needed
    how = doc("how_it_works.md")
    for needed in ["load_weights", "W8A8_DYNAMIC", "in place", "min( exp(logp_old - logp_rollout), C )",
                   "rollout_is_threshold", "mode=sync"]:
        assert needed in how, needed
    t = doc("troubleshooting.md")
    for needed in ["q_proj.weight", "aclnnQuantMatmulWeightNz", "async", "HCCL_CONNECT_TIMEOUT", "KeyError"]:
        assert needed in t, needed
    m = doc("metrics.md")
    for needed in ["token_mult_prob_error", "1.03-1.05", "> 1.05", "k1", "k3", "exp(d) - 1 - d"]:
        assert needed in m, needed
    c = doc("compatibility.md")
    for needed in ["vllm 0.11.0", "vllm-ascend 0.11.0", "no wheel", "Not verified on hardware", "8.2.rc1",
                   "ALLOW_MISMATCH"]:
        assert needed in c, needed
    qc = doc("quickstart_current.md")
    steps = re.findall(r"^(\d+)\. \*\*", qc, re.M)
    assert [int(s) for s in steps] == list(range(1, len(steps) + 1)) and len(steps) >= 8
    for needed in ["Which line to choose", "why the pinned line still exists", "install_pinned.sh --line current",
                   "grpo_qwen25_7b_fsdp_int8_A2_verl09.sh", "grpo_qwen25_7b_fsdp_bf16_A2_verl09.sh", "--dry-run",
                   "lint_overrides.py", "UPDATE_WEIGHTS_BUCKET_MB", "update_weights_bucket_megabytes",
                   "+ray_kwargs.ray_init.runtime_env.env_vars.FLASHRL_CONFIG", "NNODES", "RAY_ADDRESS",
                   "ray start", "patched verl_server_sync_end", "LINE=current", "Not verified on hardware"]:
        assert needed in qc, needed
    assert "quickstart_current.md" in doc("README.md") and "quickstart_current.md" in q  # next to each other
    for needed in ["Rollout mode 'sync' has been removed", "VLLM_ASCEND_ENABLE_NZ", "weight_nz_mode",
                   "only when the variable is unset", "actor_rollout_ref.rollout.quantization", "Drop one",
                   "HDK >= 25.3.rc1", "CANN >= 8.3.RC1", "/dev/shm", "is too large to fit in the bucket",
                   "UPDATE_WEIGHTS_BUCKET_MB", "NPU out of memory"]:
        assert needed in t, needed
    for needed in ["*_A2_verl09.sh", "verl 0.9.1's schema", "verl 51d2104's schema", "HDK >= 25.3.rc1",
                   "grpo_qwen25_7b_fsdp_int8_A2_verl09.sh"]:
        assert needed in c, needed
    mf = doc("megatron_vs_fsdp.md")
    assert "override_transformer_config" in mf and "mindspeed.megatron_adaptor" in mf


@pytest.mark.parametrize("name", ["README.md", "quickstart_a2.md", "quickstart_current.md", "how_it_works.md", "configuration.md",
                                  "compatibility.md", "troubleshooting.md", "metrics.md", "megatron_vs_fsdp.md"])
def test_doc_exists(name):
    assert (DOCS / name).stat().st_size > 500


def test_docs_index_lists_every_page():
    """docs/README.md is the way in: every page of docs/ has its row there."""
    index = doc("README.md")
    missing = [p.name for p in sorted(DOCS.glob("*.md"))
               if p.name != "README.md" and f"]({p.name})" not in index]
    assert not missing, f"docs/README.md does not index {missing}"
