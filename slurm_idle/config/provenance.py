"""The effective config, key by key, with where each value came from (`slurm-idle config show`).

Like `scontrol show config`: an admin asking "what grace does the agent use, and why?" gets the
value in force and its source, the file's line or the built-in default, without reading the
models. A value a shorthand expanded (`nodes: gpu[1-4]` into `replicas`) is reported at the
line of the nearest key the file does have.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

from pydantic import BaseModel

from slurm_idle.config.problems import locate
from slurm_idle.yamlfile import Positions

DEFAULT = "default"
VALUE_WIDTH = 40


@dataclass(frozen=True)
class Setting:
    """One leaf of the effective config: dotted key, JSON value, and `file:LINE` or `default`."""

    key: str
    value: Any
    source: str


def settings(config: BaseModel, positions: Positions) -> list[Setting]:
    """Every leaf of `config` (in model order) with its value and source."""
    out: list[Setting] = []
    _walk(config, config.model_dump(mode="json"), (), positions, out)
    return out


def _walk(model: BaseModel, dumped: dict[str, Any], path: tuple[str | int, ...],
          positions: Positions, out: list[Setting]) -> None:
    for name in type(model).model_fields:
        here = (*path, name)
        value = getattr(model, name)
        if isinstance(value, BaseModel):
            _walk(value, dumped[name], here, positions, out)
        elif isinstance(value, tuple) and value and all(isinstance(v, BaseModel) for v in value):
            for i, item in enumerate(value):
                _walk(item, dumped[name][i], (*here, i), positions, out)
        else:
            out.append(Setting(".".join(str(p) for p in here), dumped[name],
                               _source(here, name in model.model_fields_set, positions)))


def _source(path: tuple[str | int, ...], was_set: bool, positions: Positions) -> str:
    if path in positions:
        return f"file:{positions[path][0]}"
    if was_set:  # not written as such: derived from a shorthand in the file
        line, _ = locate(_shorthand_origin(path, positions) or path, positions)
        if line is not None:
            return f"file:{line}"
    return DEFAULT


def _shorthand_origin(path: tuple[str | int, ...], positions: Positions) -> tuple[str | int, ...] | None:
    """The model key a replica's field was expanded from (`models.N.nodes: gpu[1-8]`, `url`,
    `ports`; fleetspec.expand_model), when the file has it: its line says more than the
    model's first line does."""
    if len(path) != 5 or path[0] != "models" or path[2] != "replicas":
        return None
    model, field = path[:2], path[4]
    candidates = {"url": ("url",), "port": ("ports", "url")}.get(str(field), ()) + ("nodes",)
    return next(((*model, key) for key in candidates if (*model, key) in positions), None)


def format_settings(rows: list[Setting]) -> list[str]:
    """Aligned `key = value  (source)` lines; plain strings bare, everything else as JSON. Values are
    padded to at most VALUE_WIDTH: one long command must not push every source off screen."""
    texts = [(r.key, r.value if _bare(r.value) else json.dumps(r.value), r.source) for r in rows]
    kw = max((len(k) for k, _, _ in texts), default=0)
    vw = min(max((len(v) for _, v, _ in texts), default=0), VALUE_WIDTH)
    return [f"{k:<{kw}} = {v:<{vw}}  ({s})" for k, v, s in texts]


def _bare(value: Any) -> bool:
    """A string that reads unambiguously without quotes (one line, not empty, no edge spaces)."""
    return (isinstance(value, str) and value != "" and value == value.strip()
            and value.isprintable() and value != "null")
