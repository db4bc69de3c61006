"""`npu_flashrl.lines.current()` decides the vllm-ascend line once: from the distribution's version, else from the
quantization layout of a source tree (more than one file per layout), refusing anything else by
name with the supported list. Runs on every line: the installed line must be recognised too.

The trees below are empty files laid out like each upstream release's `vllm_ascend/quantization/`
(file names read from the tags v0.10.1rc1, v0.11.0, v0.13.0, v0.18.0, v0.23.0)."""
import pytest

from npu_flashrl import lines
pytestmark = pytest.mark.every_line

LAYOUTS = {
    "0.10.1rc1": ["quantizer.py", "quant_config.py", "w8a8.py", "w8a8_dynamic.py",
                  "func_wrapper.py"],
    "0.11.0": ["quant_config.py", "utils.py", "w8a8.py", "w8a8_dynamic.py", "w4a8_dynamic.py"],
    "0.23.0": ["modelslim_config.py", "compressed_tensors_config.py", "method_adapters.py",
               "utils.py", "quant_parser.py", "methods/registry.py", "methods/base.py",
               "methods/w8a8_dynamic.py", "methods/w8a8_static.py"],
}


def _tree(tmp_path, files):
    pkg = tmp_path / "vllm_ascend"
    for f in files:
        p = pkg / "quantization" / f
        p.parent.mkdir(parents=True, exist_ok=True)
        p.write_text("")
    return str(pkg)


@pytest.mark.parametrize("name", sorted(LAYOUTS))
def test_source_tree_layout_decides_the_line(tmp_path, name):
    ln = lines.line_for_tree(_tree(tmp_path, LAYOUTS[name]))
    assert ln.name == name
    assert ln.layout == ("023" if name == "0.23.0" else "011")


def test_one_file_alone_does_not_decide(tmp_path):
    # a 0.23 tree still has quantization/utils.py; registry.py alone is no 0.23 layout either
    with pytest.raises(lines.UnsupportedVersion, match="no known layout"):
        lines.line_for_tree(_tree(tmp_path / "a", ["utils.py"]))
    with pytest.raises(lines.UnsupportedVersion, match="no known layout"):
        lines.line_for_tree(_tree(tmp_path / "b", ["methods/registry.py"]))
    # both layouts' files at once (a half-upgraded tree) is refused, not guessed
    with pytest.raises(lines.UnsupportedVersion, match="0.10.1rc1, 0.11.0, 0.23.0"):
        lines.line_for_tree(_tree(tmp_path / "c", LAYOUTS["0.11.0"] + LAYOUTS["0.23.0"]))


def test_a_0_13_tree_is_not_taken_for_0_11(tmp_path):
    # 0.13.0 still has quant_config.py / utils.py / w8a8_dynamic.py, plus compressed_tensors/
    files = LAYOUTS["0.11.0"] + ["compressed_tensors/compressed_tensors.py"]
    with pytest.raises(lines.UnsupportedVersion, match="no known layout"):
        lines.line_for_tree(_tree(tmp_path, files))


@pytest.mark.parametrize("version,name", [("0.10.1rc1", "0.10.1rc1"), ("0.11.0", "0.11.0"),
                                          ("0.23.0", "0.23.0"), ("0.23.0+empty", "0.23.0")])
def test_distribution_version_decides_the_line(version, name):
    assert lines.line_for_version(version).name == name


@pytest.mark.parametrize("version", ["0.13.0", "0.18.0", "0.24.0rc1", "0.9.2"])
def test_unsupported_version_is_refused_by_name(version):
    with pytest.raises(lines.UnsupportedVersion,
                       match=rf"vllm-ascend {version} is not supported.*0\.10\.1rc1, 0\.11\.0, 0\.23\.0"):
        lines.line_for_version(version)


def test_installed_line_is_decided_once_and_frozen():
    ln = lines.current()
    assert ln is lines.current()
    assert ln.name in lines.SUPPORTED_VLLM_ASCEND
    with pytest.raises(Exception):
        ln.layout = "x"  # frozen
    # the classes it names exist in the installed vllm-ascend (the emulation lets it import)
    from npu_flashrl.sim import cpu_vllm

    cpu_vllm.prepare_process()
    ln = lines.current()
    linear, static, dynamic = (ln.linear_wrapper_class(), ln.method_class("W8A8", "linear"),
                               ln.method_class("W8A8_DYNAMIC", "linear"))
    assert {static.__name__, dynamic.__name__} == {"AscendW8A8LinearMethod",
                                                   "AscendW8A8DynamicLinearMethod"}
    assert lines.current().quant_config_class().get_name() == "ascend"


def test_installed_unsupported_release_is_refused_by_name(monkeypatch):
    # what `lines.current()` says when the installed distribution is another release (here the
    # installed vllm_ascend package reports 0.13.0 and sits in site-packages)
    import importlib.util

    spec = importlib.util.find_spec("vllm_ascend")
    if "site-packages" not in list(spec.submodule_search_locations)[0]:
        pytest.skip("vllm_ascend is a source tree on this line (no distribution to report)")
    from npu_flashrl.lines import detect

    monkeypatch.setattr(detect, "_dist_version", lambda name: "0.13.0")
    lines.current.cache_clear()
    try:
        with pytest.raises(lines.UnsupportedVersion,
                           match=r"vllm-ascend 0\.13\.0 is not supported.*0\.10\.1rc1, 0\.11\.0, 0\.23\.0"):
            lines.current()
    finally:
        monkeypatch.undo()
        lines.current.cache_clear()
    assert lines.current().name in lines.SUPPORTED_VLLM_ASCEND
