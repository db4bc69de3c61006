"""Lint the Hydra overrides of a verl launch command against verl's own config schema.

The lint itself is npu_flashrl's (npu_flashrl/recipes/lint.py; the recipes run it in their
preflight whenever the installed verl is the recipe's line); this is its command line, for a
command from elsewhere or against a verl source tree: the pinned recipes against verl 51d2104,
the ``*_verl09`` ones against verl 0.9.1 (which line a schema is, is read from it).

Usage: bash recipe.sh --dry-run 2>/dev/null | python lint_overrides.py [--verl-dir DIR]
Exit status 0 when clean, 1 with one line per problem otherwise.
"""

from __future__ import annotations

import argparse
import sys
from typing import List, Optional

from npu_flashrl.recipes import lint
from npu_flashrl.recipes.command import read_command


def main(argv: Optional[List[str]] = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--verl-dir", help="verl source tree or package dir (default: the installed verl)")
    ap.add_argument("file", nargs="?", help="command text (default: stdin)")
    args = ap.parse_args(argv)
    if args.file:
        try:
            with open(args.file, encoding="utf-8") as fh:
                text = fh.read()
        except (OSError, UnicodeDecodeError) as exc:
            print(f"lint_overrides.py: error: {args.file}: cannot read the command text: "
                  f"{getattr(exc, 'strerror', None) or exc}", file=sys.stderr)
            return 2
    else:
        text = sys.stdin.read()
    cmd = read_command(text)
    if not cmd.overrides:  # e.g. a recipe that refused: its --dry-run printed no command
        where = args.file or "stdin"
        print(f"no verl command with Hydra overrides in {where} (a recipe that refused prints none on stdout: "
              "run it without 2>/dev/null to see why)")
        return 1
    try:
        schema = lint.load_schema(cmd.config_name, args.verl_dir, cmd.entry or lint.ENTRY_MODULE)
    except FileNotFoundError as exc:  # a missing --verl-dir / schema, named; not a traceback
        print(f"lint_overrides.py: error: {exc}", file=sys.stderr)
        return 2
    problems = lint.lint(cmd.overrides, schema)
    for p in problems:
        print(p)
    if not problems:
        print(f"ok: {len(cmd.overrides)} overrides match verl's {cmd.config_name} schema "
              f"({lint.schema_line(schema)})")
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main())
