"""Reading YAML files people write (the config, job specs, pipelines) with one-line errors.

A file read by cron every minute or handed to `submit` must fail precisely: the message names
the file and, for a syntax error, the line and column, and never shows a traceback.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import yaml

from slurm_idle.errors import ConfigError


def read_text(path: str | os.PathLike[str], what: str = "file", hint: str = "") -> str:
    """The file's text, or a ConfigError naming it (`hint` is appended to "not found")."""
    p = Path(path)
    try:
        return p.read_text()
    except FileNotFoundError:
        raise ConfigError(f"{p}: {what} not found{hint}") from None
    except UnicodeDecodeError as exc:
        raise ConfigError(f"{p}: not a UTF-8 text file (byte {exc.start})") from None
    except OSError as exc:
        raise ConfigError(f"{p}: cannot read {what}: {exc.strerror}") from None


def parse_yaml(text: str, source: str, what: str = "file") -> Any:
    """The YAML document in `text`; a syntax error names its line, an empty file says so."""
    try:
        data = yaml.safe_load(text)
    except yaml.YAMLError as exc:
        mark = getattr(exc, "problem_mark", None)
        where = f"line {mark.line + 1}, column {mark.column + 1}" if mark else "unknown place"
        problem = getattr(exc, "problem", None) or str(exc).splitlines()[0]
        raise ConfigError(f"{source}: YAML syntax error at {where}: {problem}") from None
    if data is None:
        raise ConfigError(f"{source}: {what} is empty")
    return data
