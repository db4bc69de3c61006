"""Read the pinned production stack (``npu_flashrl/pins.yaml``), the single source of truth of pins.

Pure Python + PyYAML, importable without torch, and runnable as a plain script on a bare machine
(``python3 npu_flashrl/pins.py get packages.vllm.commit``) before npu_flashrl is installed.

Environment:
    NPU_FLASHRL_PINS  path of another pins file (tests, mirrors, experiments); default: pins.yaml
                      next to this module.

Command line::

    python -m npu_flashrl.pins get packages.vllm.commit   # one value (exit 2 when the key is missing)
    python -m npu_flashrl.pins sh                         # every scalar as PIN_<PATH>='value' lines
    python -m npu_flashrl.pins table                      # the Markdown table used in the docs
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


def load_pins(path: Optional[os.PathLike] = None) -> Dict[str, Any]:
    """Load the pins file as a dict. Raises FileNotFoundError / ValueError with the path in the message."""
    try:
        import yaml
    except ImportError as exc:  # pragma: no cover - pyyaml is a hard dependency
        raise ImportError("npu_flashrl.pins needs PyYAML: pip install pyyaml") from exc
    p = pins_path(path)
    if not p.is_file():
        raise FileNotFoundError(f"pins file not found: {p}")
    with open(p, encoding="utf-8") as fh:
        data = yaml.safe_load(fh)
    if not isinstance(data, dict) or "packages" not in data:
        raise ValueError(f"{p}: not a pins file (expected a mapping with a 'packages' key)")
    return data


def get(key: str, pins: Optional[Dict[str, Any]] = None, default: Any = _MISSING) -> Any:
    """Dotted lookup, e.g. ``get("packages.vllm.commit")``. KeyError names the missing key."""
    node: Any = load_pins() if pins is None else pins
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


def main(argv: Optional[list] = None) -> int:
    import argparse

    parser = argparse.ArgumentParser(prog="python -m npu_flashrl.pins", description=__doc__.split("\n")[0])
    parser.add_argument("--pins", help=f"pins file (default: ${PINS_ENV} or the packaged pins.yaml)")
    sub = parser.add_subparsers(dest="cmd", required=True)
    g = sub.add_parser("get", help="print one pin by dotted key")
    g.add_argument("key")
    g.add_argument("--default", default=None, help="printed instead of failing when the key is missing")
    sub.add_parser("sh", help="print every pin as shell assignments PIN_<PATH>=...")
    sub.add_parser("table", help="print the Markdown table of the pinned stack")
    sub.add_parser("path", help="print the pins file in use")
    args = parser.parse_args(argv)
    try:
        pins = load_pins(args.pins)
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
    except (KeyError, FileNotFoundError, ValueError) as exc:
        print(f"npu_flashrl.pins: {exc.args[0] if exc.args else exc}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
