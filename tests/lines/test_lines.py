"""npu_flashrl.lines: one object per stack line, detection of the installed vllm-ascend from its
distribution (post / local releases, unverified patch releases, refusals), and the line's
patches as objects (a second declaration of a name is an error).

Stand-in: a fake vllm-ascend distribution (an empty package laid out like 0.23.0's
`quantization/`, and a dist-info naming the version) first on sys.path, so detection reads it
through importlib.metadata as it reads a real install."""
import importlib
import logging
import sys

import pytest

from npu_flashrl import lines, patches
from npu_flashrl.lines import base, v0_10_1rc1, v0_11_0, v0_23_0

from helpers import LogRecords

pytestmark = pytest.mark.every_line  # the installed line's detection and patches, on each line

QUANT_023 = ["modelslim_config.py", "method_adapters.py", "utils.py", "methods/registry.py",
             "methods/w8a8_dynamic.py", "methods/w8a8_static.py"]


@pytest.fixture
def warnings_of_lines():
    handler, logger = LogRecords(logging.DEBUG), logging.getLogger("npu_flashrl.lines")
    logger.addHandler(handler)
    try:
        yield handler.records
    finally:
        logger.removeHandler(handler)


def _fake_distribution(tmp_path, version):
    site = tmp_path / "site-packages"  # detection trusts metadata only next to an installed package
    for f in ["__init__.py"] + [f"quantization/{q}" for q in QUANT_023]:
        p = site / "vllm_ascend" / f
        p.parent.mkdir(parents=True, exist_ok=True)
        p.write_text("")
    info = site / f"vllm_ascend-{version}.dist-info"
    info.mkdir()
    info.joinpath("METADATA").write_text(f"Metadata-Version: 2.1\nName: vllm-ascend\nVersion: {version}\n")
    return str(site)


def _detect_installed(tmp_path, monkeypatch, version):
    monkeypatch.syspath_prepend(_fake_distribution(tmp_path, version))
    monkeypatch.delitem(sys.modules, "vllm_ascend", raising=False)
    importlib.invalidate_caches()
    lines.current.cache_clear()
    try:
        return lines.current()
    finally:
        lines.current.cache_clear()


@pytest.fixture
def restore_installed(monkeypatch):
    yield
    monkeypatch.undo()
    lines.current.cache_clear()
    importlib.invalidate_caches()


@pytest.mark.parametrize("version", ["0.23.0.post1", "0.23.0+local"])
def test_post_and_local_release_of_a_verified_release_is_its_line(tmp_path, monkeypatch,
                                                                   warnings_of_lines,
                                                                   restore_installed, version):
    ln = _detect_installed(tmp_path, monkeypatch, version)
    assert ln.name == "0.23.0" and isinstance(ln, v0_23_0.SchemeRegistryLine)
    assert ln.source == f"distribution {version}"
    assert not [r for r in warnings_of_lines if r.levelno >= logging.WARNING]


def test_unverified_patch_release_gets_its_minors_rules_with_a_warning(tmp_path, monkeypatch,
                                                                       warnings_of_lines,
                                                                       restore_installed):
    ln = _detect_installed(tmp_path, monkeypatch, "0.23.1")
    assert ln.name == "0.23.0"
    assert "unverified" in ln.source
    warned = [r.getMessage() for r in warnings_of_lines if r.levelno == logging.WARNING]
    assert len(warned) == 1
    assert "vllm-ascend 0.23.1 is not a verified release" in warned[0]
    assert "rules of the vllm-ascend 0.23.0 line" in warned[0]


def test_other_release_is_refused_with_the_supported_list(tmp_path, monkeypatch, restore_installed):
    with pytest.raises(lines.UnsupportedVersion,
                       match=r"vllm-ascend 0\.24\.0 is not supported.*0\.10\.1rc1, 0\.11\.0, 0\.23\.0"):
        _detect_installed(tmp_path, monkeypatch, "0.24.0")


@pytest.mark.parametrize("version,name,warns", [
    ("0.10.1rc1", "0.10.1rc1", False), ("0.11.0.post2", "0.11.0", False),
    ("0.11.3", "0.11.0", True), ("0.10.1", "0.10.1rc1", True), ("0.10.1rc2", "0.10.1rc1", True),
    ("0.23.0+cpu.post", "0.23.0", False)])
def test_version_rules(version, name, warns, warnings_of_lines):
    assert lines.line_for_version(version).name == name
    assert bool([r for r in warnings_of_lines if r.levelno == logging.WARNING]) is warns


@pytest.mark.parametrize("version", ["0.23.0rc1", "0.23.0.dev3", "0.11.0rc2", "0.12.0", "1.23.0",
                                     "garbage", "0.23"])
def test_earlier_or_unknown_releases_are_refused(version):
    # a pre-release or dev build BEFORE a verified release may lack what it has: refused
    with pytest.raises(lines.UnsupportedVersion, match="is not supported"):
        lines.line_for_version(version)


def test_lines_share_behaviour_by_inheritance():
    assert type(v0_10_1rc1.LINE) is type(v0_11_0.LINE)  # one layout class, two lines
    assert isinstance(v0_23_0.LINE, base.StackLine)
    assert lines.SUPPORTED_VLLM_ASCEND == ("0.10.1rc1", "0.11.0", "0.23.0")
    classes = {type(ln) for ln in lines.LINES}
    # the rules every line shares are written once, in the base; a layout overrides what differs
    for name in ("commit_extras", "import_quantization", "method_class", "once_patch", "patches"):
        assert not [c.__name__ for c in classes if name in vars(c)], name
    assert {c.__name__ for c in classes if "is_processed" in vars(c)} == {"SchemeRegistryLine"}
    assert lines.by_name("0.11.0") is v0_11_0.LINE
    with pytest.raises(lines.UnsupportedVersion, match="0.10.1rc1, 0.11.0, 0.23.0"):
        lines.by_name("0.13.0")


class _Bodies:
    def redirect(self, original, quant_config_class):
        return original

    def override(self, original):
        return original

    def attach_on_init(self, original):
        return original


@pytest.mark.parametrize("ln", lines.LINES, ids=lambda ln: ln.name)
def test_each_line_returns_its_patches_as_objects(ln):
    got = ln.patches(_Bodies())
    assert tuple(p.name for p in got) == ln.PATCHES
    assert all(isinstance(p, patches.Patch) and p.lines == (ln.name,) and p.doc for p in got)
    once = {p.name: p.target for p in got}
    assert once[ln.PATCH_OVERRIDE] == ln.quant_config + ".override_quantization_method"
    assert not any(p.applied for p in got)


def test_a_second_declaration_of_a_patch_name_is_an_error(monkeypatch):
    # two lines declaring the same names (what layout_011 / layout_023 did at import: the first
    # silently won) is refused; the same declaration again is a no-op
    monkeypatch.setattr(patches, "_REGISTRY", {})
    first = v0_11_0.LINE.patches(_Bodies())
    patches.declare(first)
    patches.declare(v0_11_0.LINE.patches(_Bodies()))  # same targets, same origin: kept
    assert patches.get(v0_11_0.LINE.PATCH_OVERRIDE) is first[1]
    with pytest.raises(patches.DuplicatePatch, match="ascend_quant_description.*declared twice"):
        patches.declare(v0_23_0.LINE.patches(_Bodies()))

    @patches.register("npu_flashrl_test_patch", "a.b:c", why="a test")
    def _apply():
        pass

    with pytest.raises(patches.DuplicatePatch, match="npu_flashrl_test_patch"):
        @patches.register("npu_flashrl_test_patch", "a.b:other", why="another")
        def _apply_other():
            pass


def test_only_the_installed_lines_patches_are_declared():
    from npu_flashrl.adapters import vllm_ascend  # noqa: F401  (declares the line's patches)

    ln = lines.current()
    declared = {p["name"]: p for p in patches.status()}
    for name in ln.PATCHES:
        assert declared[name]["lines"] == [ln.name]
    for other in lines.LINES:
        if other.name != ln.name:
            assert not any(other.name in p["lines"] for p in declared.values())


def test_one_table_names_the_lines():
    """The stack lines' labels are the one vocabulary: pins.yaml's lines, the CPU test stack's
    requirements files and verl's accepted spellings all use them."""
    import os

    from npu_flashrl import lines
    from npu_flashrl.pins import line_names

    labels = [ln.label for ln in lines.LINES]
    assert len(set(labels)) == len(labels)
    root = os.path.abspath(os.path.join(os.path.dirname(__file__), "..", ".."))
    for label in labels:
        assert os.path.isfile(os.path.join(root, "requirements", f"cpu-stack-{label}.txt")), label
        assert lines.by_label(label).label == label
        assert lines.verl_line(label) == ("0.9" if lines.by_label(label).verl_mode == "server" else "51d2104")
    assert set(line_names()) <= set(labels), line_names()  # pins.yaml's lines are stack lines
    with pytest.raises(lines.UnsupportedVersion, match="pinned, 0.11, current"):
        lines.by_label("0.7+")


class _W8A8Dynamic:
    pass


class _W8A8DynamicMoE:
    pass


class _Quantizer:
    """v0.10.1rc1's shape: a quantizer class whose static build_<layer>_method builds the scheme."""

    @staticmethod
    def build_linear_method():
        return _W8A8Dynamic()

    @staticmethod
    def build_moe_method():
        return _W8A8DynamicMoE()

    @staticmethod
    def build_attention_method():
        raise NotImplementedError("no attention method")


@pytest.mark.parametrize("table", [
    {("W8A8_DYNAMIC", "linear"): _W8A8Dynamic, ("W8A8_DYNAMIC", "moe"): _W8A8DynamicMoE},  # 0.23
    {"W8A8_DYNAMIC": {"linear": _W8A8Dynamic, "moe": _W8A8DynamicMoE}},                   # 0.11
    {"W8A8_DYNAMIC": _Quantizer},                                                          # pinned
], ids=["scheme-registry", "method-map", "quantizer-map"])
def test_a_scheme_class_is_read_by_key_from_each_table_shape(table):
    """Every line's vllm-ascend keeps its scheme classes in a table (`quant_method_map`); the
    reload asks by (quant type, layer type), whatever the table's shape, and a key the release
    lacks is None (the scheme then claims nothing), not a guess."""
    assert base.table_entry(table, "W8A8_DYNAMIC", "linear") is _W8A8Dynamic
    assert base.table_entry(table, "W8A8_DYNAMIC", "moe") is _W8A8DynamicMoE
    assert base.table_entry(table, "W8A8_DYNAMIC", "attention") is None
    assert base.table_entry(table, "W4A8_DYNAMIC", "linear") is None


def test_the_installed_lines_table_holds_the_schemes_classes():
    from npu_flashrl.sim import cpu_vllm

    cpu_vllm.prepare_process()
    ln = lines.current()
    table = base.resolve(ln.quant_method_map)
    dyn = ln.method_class("W8A8_DYNAMIC", "linear")
    assert dyn.__name__ == "AscendW8A8DynamicLinearMethod"
    assert ln.method_class("W8A8_DYNAMIC", "moe").__name__ == "AscendW8A8DynamicFusedMoEMethod"
    assert ln.method_class("W8A8", "linear").__name__ == "AscendW8A8LinearMethod"
    assert ln.method_class("NO_SUCH_TYPE", "linear") is None
    assert base.table_entry(table, "W8A8_DYNAMIC", "linear") is dyn


def test_the_simulations_line_facts_are_one_sub_object_read_only_by_the_simulation():
    """The facts only the CPU simulation needs (NZ switch, MoE layer classes, comm selection, ...)
    are `StackLine.sim` (a `SimFacts`), and no runtime module reads it."""
    import dataclasses
    from pathlib import Path

    sim_fields = {f.name for f in dataclasses.fields(base.SimFacts)}
    assert not sim_fields & {f.name for f in dataclasses.fields(base.StackLine)}
    assert all(isinstance(ln.sim, base.SimFacts) for ln in lines.LINES)
    root = Path(base.__file__).resolve().parents[1]
    readers = [p.relative_to(root).as_posix() for p in root.rglob("*.py")
               if ".sim." in p.read_text(encoding="utf-8").replace("npu_flashrl.sim.", "")
               and not p.relative_to(root).as_posix().startswith(("sim/", "rehearsal/", "lines/"))]
    assert readers == []
