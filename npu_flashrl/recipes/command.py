"""One reading of a verl launch command, for the recipes' preflight, its schema lint and
`npu-flashrl verify --verl-overrides`: whatever the entry point (verl's PPO trainer, its
experimental ones, any other `verl.*` module or a `.../verl/...py` file) and whatever comes before
it (`VAR=... python3 -m`, `env [-u NAME] VAR=...`, a recipe's --dry-run output with its other
commands and comments), the same environment, config name and Hydra overrides.
"""
from __future__ import annotations

import dataclasses
import re
import shlex
from typing import Dict, List, Optional

from npu_flashrl.lines import verl as verl_lines

_ASSIGN = re.compile(r"[A-Za-z_][A-Za-z0-9_]*=")
# env(1) options that take a value (GNU coreutils: -u NAME, -C DIR, -S STRING)
_ENV_VALUE_OPTS = ("-u", "--unset", "-C", "--chdir", "-S", "--split-string")


@dataclasses.dataclass
class Command:
    entry: Optional[str]  # the verl module (or file) run; None for a plain list of overrides
    env: Dict[str, str]  # assignments before the interpreter (VAR=... or env VAR=...)
    config_name: str
    overrides: List[str]

    @property
    def experimental(self) -> bool:
        return self.entry in verl_lines.ENTRY_EXPERIMENTAL


def _logical_lines(text: str) -> List[str]:
    return text.replace("\\\r\n", " ").replace("\\\n", " ").splitlines()


def _entry_index(words: List[str]) -> Optional[int]:
    """Where the verl entry point is in one command's words: `-m verl.<...>`, a known entry module
    anywhere, or a python file inside a verl tree."""
    for i, w in enumerate(words):
        if w in (verl_lines.ENTRY_MAIN, *verl_lines.ENTRY_EXPERIMENTAL):
            return i
        if i and words[i - 1] == "-m" and (w == "verl" or w.startswith("verl.")):
            return i
        if w.endswith(".py") and re.search(r"(^|/)verl/", w):
            return i
    return None


def _env_of(words: List[str]) -> Dict[str, str]:
    """The assignments a shell and env(1) make before the interpreter word."""
    env: Dict[str, str] = {}
    i = 0
    while i < len(words):
        w = words[i]
        if _ASSIGN.match(w):
            k, _, v = w.partition("=")
            env[k] = v
        elif w == "env" or w.endswith("/env"):
            pass
        elif w in _ENV_VALUE_OPTS:
            i += 1
        elif w.startswith("-") and w != "-m":  # env -i, --, ...
            pass
        else:
            break  # the interpreter
        i += 1
    return env


def _after_entry(rest: List[str]):
    config_name = "ppo_trainer"
    overrides: List[str] = []
    i = 0
    while i < len(rest):
        w = rest[i]
        if w.startswith("--config-name=") or w.startswith("-cn="):
            config_name = w.split("=", 1)[1]
        elif w in ("--config-name", "-cn") and i + 1 < len(rest):
            config_name = rest[i + 1]
            i += 1
        elif w in ("--config-path", "-cp", "--config-dir", "-cd") and i + 1 < len(rest):
            i += 1
        elif w.startswith("-"):
            pass
        elif "=" in w or w.startswith("~"):
            overrides.append(w)
        i += 1
    return config_name, overrides


def read_command(text: str) -> Command:
    """A verl command (or a recipe's --dry-run output, or one override per line). ValueError
    when the text does not split into shell words (an unclosed quote)."""
    lines = _logical_lines(text)
    for n, line in enumerate(lines):
        words = shlex.split(line, comments=True)
        at = _entry_index(words)
        if at is not None:
            rest = words[at + 1:]
            for more in lines[n + 1:]:  # overrides listed on the lines below the command
                extra = shlex.split(more, comments=True)
                if not all("=" in w or w.startswith(("-", "~")) for w in extra):
                    break  # another command
                rest += extra
            config_name, overrides = _after_entry(rest)
            return Command(words[at], _env_of(words[:at]), config_name, overrides)
    words = [w for line in _logical_lines(text) for w in shlex.split(line, comments=True)]
    overrides = [w for w in words if ("=" in w or w.startswith("~")) and not w.startswith("-")]
    return Command(None, {}, "ppo_trainer", overrides)


def read_words(words: List[str]) -> Command:
    """The same reading of a command given as argv words (the recipes pass theirs)."""
    at = _entry_index(words)
    if at is None:
        return Command(None, {}, "ppo_trainer",
                       [w for w in words if ("=" in w or w.startswith("~")) and not w.startswith("-")])
    config_name, overrides = _after_entry(words[at + 1:])
    return Command(words[at], _env_of(words[:at]), config_name, overrides)
