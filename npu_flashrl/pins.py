"""Read the production stacks (``npu_flashrl/pins.yaml``), the single source of truth of pins.

The file holds one entry per stack line under ``lines:`` (``pinned``: the published procedure,
``current``: what installing verl gives today); every reader picks one line (default: the file's
``default_line``), and sees that line's mapping (``python``, ``cann``, ``packages``, ``docker``).
A file without ``lines:`` (the older layout) is one line named ``pinned``.

Pure Python + PyYAML, importable without torch, and runnable as a plain script on a bare machine
(``python3 npu_flashrl/pins.py get packages.vllm.commit``) before npu_flashrl is installed.

Environment:
    NPU_FLASHRL_PINS  path of another pins file (tests, mirrors, experiments); default: pins.yaml
                      next to this module.

Command line::

    python -m npu_flashrl.pins get packages.vllm.commit   # one value (exit 2 when the key is missing)
    python -m npu_flashrl.pins --line current get packages.vllm.version
    python -m npu_flashrl.pins sh                         # every scalar as PIN_<PATH>='value' lines
    python -m npu_flashrl.pins table                      # the Markdown table used in the docs
    python -m npu_flashrl.pins lines                      # the line names, default first
    python -m npu_flashrl.pins match                      # which line the installed stack matches
"""

from __future__ import annotations

import os
import shlex
import sys
from pathlib import Path
from typing import Any, Dict, Iterator, Optional, Tuple

DEFAULT_PINS_PATH = Path(__file__).resolve().with_name("pins.yaml")
PINS_ENV = "NPU_FLASHRL_PINS"

_MISSING = object()


def pins_path(path: Optional[os.PathLike] = None) -> Path:
    """The pins file in use: ``path``, else ``$NPU_FLASHRL_PINS``, else the packaged pins.yaml."""
    if path is not None:
        return Path(path)
    env = os.environ.get(PINS_ENV)
    return Path(env) if env else DEFAULT_PINS_PATH


def load_document(path: Optional[os.PathLike] = None) -> Dict[str, Any]:
    """The whole pins file, normalised to ``{"default_line": name, "lines": {name: line mapping}}``.

    Raises FileNotFoundError / ValueError with the path (and the offending line) in the message."""
    try:
        import yaml
    except ImportError as exc:  # pragma: no cover - pyyaml is a hard dependency
        raise ImportError("npu_flashrl.pins needs PyYAML: pip install pyyaml") from exc
    p = pins_path(path)
    if not p.is_file():
        raise FileNotFoundError(f"pins file not found: {p}")
    with open(p, encoding="utf-8") as fh:
        data = yaml.safe_load(fh)
    if isinstance(data, dict) and "lines" not in data and "packages" in data:
        data = {"default_line": "pinned", "lines": {"pinned": data}}  # the one-line layout
    if not isinstance(data, dict) or not isinstance(data.get("lines"), dict) or not data["lines"]:
        raise ValueError(f"{p}: not a pins file (expected a mapping with 'lines: {{name: {{packages: ...}}}}')")
    for name, line in data["lines"].items():
        if not isinstance(line, dict) or not isinstance(line.get("packages"), dict):
            raise ValueError(f"{p}: line '{name}' has no 'packages' mapping")
    default = data.setdefault("default_line", next(iter(data["lines"])))
    if default not in data["lines"]:
        raise ValueError(f"{p}: default_line '{default}' is not one of the lines {sorted(data['lines'])}")
    return data


def line_names(path: Optional[os.PathLike] = None) -> list:
    """The lines of the pins file, the default one first."""
    doc = load_document(path)
    return [doc["default_line"]] + [n for n in doc["lines"] if n != doc["default_line"]]


def load_pins(path: Optional[os.PathLike] = None, line: Optional[str] = None) -> Dict[str, Any]:
    """The pins of one line (default: the file's ``default_line``) as a dict with ``packages``.

    ValueError names the file and the known lines when ``line`` is not one of them."""
    doc = load_document(path)
    name = line or doc["default_line"]
    if name not in doc["lines"]:
        raise ValueError(f"unknown line '{name}' in {pins_path(path)} (known: {', '.join(line_names(path))})")
    return doc["lines"][name]


def get(key: str, pins: Optional[Dict[str, Any]] = None, default: Any = _MISSING,
        line: Optional[str] = None) -> Any:
    """Dotted lookup in one line, e.g. ``get("packages.vllm.commit", line="pinned")``.
    KeyError names the missing key."""
    node: Any = load_pins(line=line) if pins is None else pins
    for part in key.split("."):
        if isinstance(node, dict) and part in node:
            node = node[part]
        else:
            if default is not _MISSING:
                return default
            raise KeyError(f"pin '{key}' not found (missing '{part}') in {pins_path()}")
    return node


def flatten(node: Any, prefix: str = "") -> Iterator[Tuple[str, Any]]:
    """Yield (dotted key, scalar value) for every scalar in the pins tree."""
    if isinstance(node, dict):
        for k, v in node.items():
            yield from flatten(v, f"{prefix}.{k}" if prefix else str(k))
    else:
        yield prefix, node


def _scalar_str(value: Any) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    return "" if value is None else str(value)


def shell_assignments(pins: Optional[Dict[str, Any]] = None) -> str:
    """``PIN_PACKAGES_VLLM_COMMIT='e039...'`` lines, safe to ``eval`` in bash."""
    pins = load_pins() if pins is None else pins
    lines = []
    for key, value in flatten(pins):
        name = "PIN_" + "".join(c if c.isalnum() else "_" for c in key).upper()
        lines.append(f"{name}={shlex.quote(_scalar_str(value))}")
    return "\n".join(lines) + "\n"


def markdown_table(pins: Optional[Dict[str, Any]] = None) -> str:
    """The pinned-stack table embedded in docs/compatibility.md (a test checks it never drifts)."""
    pins = load_pins() if pins is None else pins
    rows = [("Python", pins.get("python", "")), ("CANN", pins.get("cann", "")),
            ("SoC (A2 build)", pins.get("soc_version", ""))]
    for name, spec in pins["packages"].items():
        dist = spec.get("dist", name.replace("_", "-"))
        parts = []
        if "version" in spec:
            parts.append(str(spec["version"]))
        if "commit" in spec:
            parts.append(f"commit `{spec['commit']}`")
        if "ref" in spec:
            parts.append(f"ref `{spec['ref']}`")
        for k, v in (spec.get("env") or {}).items():
            parts.append(f"`{k}={v}`")
        if spec.get("editable"):
            parts.append("editable")
        if spec.get("source_only"):
            parts.append("from source only")
        rows.append((dist, ", ".join(parts)))
    out = ["| component | pin |", "|---|---|"]
    out += [f"| {a} | {b} |" for a, b in rows]
    return "\n".join(out) + "\n"


def installed_version(dist_names) -> Tuple[Optional[str], Optional[str]]:
    """(version, git commit or None) of the first installed distribution of ``dist_names``."""
    import importlib.metadata as md
    import json

    for name in dist_names:
        try:
            dist = md.distribution(name)
        except md.PackageNotFoundError:
            continue
        commit = None
        try:
            raw = dist.read_text("direct_url.json")
            if raw:
                commit = (json.loads(raw).get("vcs_info") or {}).get("commit_id")
        except (OSError, ValueError):
            pass
        return dist.version, commit
    return None, None


def line_differences(line_pins: Dict[str, Any], installed=installed_version) -> list:
    """Packages of one line whose installed version (importlib.metadata) differs from its pin:
    ``[(dist, installed or "absent", wanted)]``, empty when the installed stack is that line.

    A version pin compares the release (a local ``+cpu`` / ``+empty`` suffix ignored); a commit pin
    the recorded git commit when there is one (else the version in the pin, when it has one); a ref
    pin (a branch/tag like ``core_r0.16.0``) wants the installed version inside the ref's name."""
    out = []
    for key, spec in line_pins["packages"].items():
        spec = spec or {}
        dist = spec.get("dist") or key.replace("_", "-")
        version, commit = installed([dist, key, dist.replace("-", "_")])
        want_v, want_c, ref = spec.get("version"), spec.get("commit"), spec.get("ref")
        wanted = " ".join(x for x in (want_v and f"=={want_v}", (want_c or ref) and f"@{str(want_c or ref)[:12]}")
                          if x) or "any"
        if version is None:
            out.append((dist, "absent", wanted))
            continue
        release = version.split("+")[0]
        have = version + (f"@{commit[:12]}" if commit else "")
        if want_v and release != str(want_v):
            out.append((dist, have, wanted))
        elif want_c and commit and not (commit.startswith(str(want_c)) or str(want_c).startswith(commit)):
            out.append((dist, have, wanted))
        elif ref and not want_c and not want_v and release not in str(ref):
            out.append((dist, have, wanted))
    return out


def match_line(path: Optional[os.PathLike] = None, installed=installed_version) -> Tuple[Optional[str], Dict[str, list]]:
    """Which line the installed stack is: ``(name or None, {line: line_differences})``."""
    doc = load_document(path)
    diffs = {name: line_differences(line, installed) for name, line in doc["lines"].items()}
    matching = [name for name in line_names(path) if not diffs[name]]
    return (matching[0] if matching else None), diffs


def closest_line(diffs: Dict[str, list], order: Optional[list] = None) -> str:
    """The line with the fewest differing packages (ties: the earlier one of ``order``)."""
    names = order or list(diffs)
    return min(names, key=lambda n: (len(diffs[n]), names.index(n)))


def describe_match(name: Optional[str], diffs: Dict[str, list], order: Optional[list] = None) -> str:
    """One sentence for ``npu-flashrl verify``: the matched line, or every line's differing packages."""
    if name:
        return f"installed stack matches line '{name}' (every pin of it)"
    parts = []
    for line in sorted(diffs, key=lambda n: (len(diffs[n]), (order or list(diffs)).index(n))):
        listed = ", ".join(f"{d} {have} (pins {want})" for d, have, want in diffs[line])
        parts.append(f"{line}: {len(diffs[line])} differ: {listed}")
    return "installed stack matches no line; " + "; ".join(parts)


def main(argv: Optional[list] = None) -> int:
    import argparse

    parser = argparse.ArgumentParser(prog="python -m npu_flashrl.pins", description=__doc__.split("\n")[0])
    parser.add_argument("--pins", help=f"pins file (default: ${PINS_ENV} or the packaged pins.yaml)")
    parser.add_argument("--line", help="stack line to read (default: the file's default_line, 'pinned')")
    sub = parser.add_subparsers(dest="cmd", required=True)
    g = sub.add_parser("get", help="print one pin by dotted key")
    g.add_argument("key")
    g.add_argument("--default", default=None, help="printed instead of failing when the key is missing")
    sub.add_parser("sh", help="print every pin as shell assignments PIN_<PATH>=...")
    sub.add_parser("table", help="print the Markdown table of the pinned stack")
    sub.add_parser("path", help="print the pins file in use")
    sub.add_parser("lines", help="print the line names, the default first")
    sub.add_parser("match", help="print which line the installed stack matches (exit 1: none)")
    args = parser.parse_args(argv)
    try:
        pins = load_pins(args.pins, line=args.line)
        if args.cmd == "get":
            if args.default is not None:
                value = get(args.key, pins, default=args.default)
            else:
                value = get(args.key, pins)
            if isinstance(value, (dict, list)):
                import json

                print(json.dumps(value))
            else:
                print(_scalar_str(value))
        elif args.cmd == "sh":
            sys.stdout.write(shell_assignments(pins))
        elif args.cmd == "table":
            sys.stdout.write(markdown_table(pins))
        elif args.cmd == "path":
            print(pins_path(args.pins))
        elif args.cmd == "lines":
            print("\n".join(line_names(args.pins)))
        elif args.cmd == "match":
            name, diffs = match_line(args.pins)
            print(describe_match(name, diffs, line_names(args.pins)))
            return 0 if name else 1
    except (KeyError, FileNotFoundError, ValueError) as exc:
        print(f"npu_flashrl.pins: {exc.args[0] if exc.args else exc}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
