"""Only `npu_flashrl/lines/` (and pins.yaml) name vllm-ascend, vLLM or verl versions.

The rule, applied to every module of the package outside `lines/`: no such version in its code
(string constants, f-strings, user messages), its docstrings or its comments, no version
comparison (`__version__` / `version(...)` against a literal, `>= (0, 9)`), and no version in a
module's file name. A fact about one release belongs on that release's line object; prose
elsewhere says what a line does ("on server-mode verl lines", "where vLLM takes `mode=`") and
names the line module when it must point at one. pins.py only reads pins.yaml and is held to the
same rule.

What counts as a version: the releases and their minor series that the lines name (read from
`npu_flashrl.lines`, so a new line is covered without editing this test), the verl commit pin,
and any `N.N[.N]` written right after the name vllm / vLLM / vllm-ascend / verl.

`PENDING`: modules that were being rewritten when this test landed (their owners
clear them; a listed file that is clean fails, so the list only shrinks)."""
import ast
import io
import re
import tokenize
from pathlib import Path

import pytest

from npu_flashrl import lines

ROOT = Path(__file__).resolve().parents[2] / "npu_flashrl"
EXEMPT = ("lines/",)

PENDING = {
    # verl's adapter: prose and messages about the verl lines (config_check's messages should
    # take their release names from npu_flashrl.lines.verl)
    "adapters/verl/__init__.py": "engine",
    "adapters/verl/config_check.py": "engine", "adapters/verl/moe_names.py": "engine",
    "sim/sync.py": "sim move",  # its test-only helpers move to tests/ (the simulation is fenced off from runtime code)
    "rehearsal/transport.py": "rehearsal",
}


def _release_words():
    words = {lines.SYNC_PIN[:7]}
    for ln in lines.LINES:
        for v in (ln.vllm_ascend, ln.vllm, ln.verl):
            words.add(v)
            parts = v.split(".")
            if len(parts) >= 2 and parts[0].isdigit():
                words.add(".".join(parts[:2]))  # the minor series, e.g. 0.23
    words |= {k for k in lines.VERL_ALIASES if k[:1].isdigit()}
    return words


_NUM = r"v?\d+\.\d+(?:\.\d+)?(?:rc\d+|\.post\d+|\.x)?"
VERSION = re.compile(
    re.escape(lines.SYNC_PIN[:7]) + r"[0-9a-f]*"  # the verl commit, short or full
    + r"|(?<![\w.])v?(?:" + "|".join(re.escape(w) for w in sorted(_release_words(), key=len, reverse=True))
    + r")(?:\.\d+|\.x|rc\d+|\.post\d+|\.dev\d+|\+)*(?![\w.]*\d)"
    + r"|(?i:\b(?:vllm|vllm-ascend|vllm_ascend|verl)\b)[ =<>~^-]{1,4}" + _NUM)
URL = re.compile(r"https?://\S+")  # a cited page at an upstream tag is a citation, not a version rule
NAME = re.compile(r"_0\d\d\b|51d2104")  # a release spelled into a module name: server_091, ...


def _comparisons(tree) -> list:
    out = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Compare) and any(isinstance(op, (ast.Lt, ast.LtE, ast.Gt, ast.GtE))
                                                 for op in node.ops):
            text = ast.unparse(node)
            if re.search(r"version", text, re.I) or re.search(r"\(\s*0\s*,\s*\d+", text):
                out.append((node.lineno, text))
    return out


def findings(path: Path) -> list:
    src = path.read_text(encoding="utf-8")
    rel = path.relative_to(ROOT).as_posix()
    out = []
    if NAME.search(path.stem):
        out.append((0, f"module name {path.name}"))
    tree = ast.parse(src)
    for node in ast.walk(tree):
        if isinstance(node, ast.Constant) and isinstance(node.value, str):
            for m in VERSION.finditer(URL.sub("", node.value)):  # a citation names its tag
                out.append((node.lineno, f"string/docstring: ...{m.group(0)}..."))
        elif isinstance(node, (ast.Import, ast.ImportFrom)):
            names = [a.name for a in node.names] + [getattr(node, "module", None) or ""]
            for n in names:
                if NAME.search(n.rsplit(".", 1)[-1]):
                    out.append((node.lineno, f"import of {n}"))
    for tok in tokenize.generate_tokens(io.StringIO(src).readline):
        if tok.type == tokenize.COMMENT:
            for m in VERSION.finditer(URL.sub("", tok.string)):
                out.append((tok.start[0], f"comment: ...{m.group(0)}..."))
    out += [(n, f"version comparison: {t}") for n, t in _comparisons(tree)]
    return [(rel, n, what) for n, what in out]


def _modules():
    return sorted(p for p in ROOT.rglob("*.py")
                  if not any(p.relative_to(ROOT).as_posix().startswith(e) for e in EXEMPT))


def test_no_version_literals_outside_lines():
    bad = []
    for path in _modules():
        if path.relative_to(ROOT).as_posix() not in PENDING:
            bad += findings(path)
    assert not bad, "versions belong in npu_flashrl/lines/ (or pins.yaml):\n" + "\n".join(
        f"npu_flashrl/{f}:{n}: {w}" for f, n, w in bad)


def test_pending_list_only_shrinks():
    clean = [f for f in PENDING if not (ROOT / f).exists() or not findings(ROOT / f)]
    assert not clean, f"no version literal left in {clean}: remove them from PENDING"


@pytest.mark.parametrize("text,hit", [
    ("on vllm-ascend 0.23.0 the scheme ...", True), ("verl 0.7.1 .. 0.9.1", True),
    ("vLLM < 0.9", True), ("0.23", True), ("51d2104", True), ("v0.10.1rc1", True),
    ("verl " + lines.SYNC_PIN, True), ("0.23.0.post1", True), ("vllm-ascend 0.18.0", True),
    ("smooth_alpha 0.5", False), ("a 0.9 threshold", True), ("1.05 limit", False),
    ("torch 2.7.1", False), ("transformers 5.5.4", False), ("core_r0.16.0", False),
])
def test_the_pattern(text, hit):
    assert bool(VERSION.search(text)) is hit
