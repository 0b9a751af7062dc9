"""Reading YAML files people write (the config, job specs, pipelines) with one-line errors.

A file read by cron every minute or handed to `submit` must fail precisely: the message names
the file and, for a syntax error, the line and column, and never shows a traceback.

It must also fail *cheaply*. PyYAML shares an anchored node between its aliases, so a 400-byte
"billion laughs" document composes instantly but expands into billions of values for whoever
walks it next (pydantic, json.dumps, an error message); 50,000 nested brackets exhaust the
composer's recursion. The loader here bounds the text (MAX_BYTES), the nesting (MAX_DEPTH) and
the size of the document *as expanded through its aliases* (MAX_NODES), and says which one.

`parse_yaml_located` also says where each key and list item starts (`Positions`), so a
validation error can name the line of the value it is about, not just its dotted path.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import yaml

from slurm_idle.errors import ConfigError

#: Far above any real config, job spec or pipeline, far below what hurts.
MAX_BYTES = 1 << 20
MAX_DEPTH = 64
MAX_NODES = 100_000

#: Where each key / list item of a document starts: its path (mapping keys as text, list
#: indexes as ints, the way pydantic's error `loc` spells them) -> (line, column), both 1-based.
Positions = dict[tuple[str | int, ...], tuple[int, int]]


class _Bounded(yaml.SafeLoader):  # type: ignore[misc]  # untyped base (no stubs)
    """SafeLoader that counts every node as if aliases were copies, and the nesting depth."""

    def __init__(self, stream: str) -> None:
        super().__init__(stream)
        self._depth = 0
        self._expanded: dict[int, int] = {}  # id(node) -> its size with aliases expanded
        self._total = 0

    def compose_node(self, parent: Any, index: Any) -> Any:
        is_alias = self.check_event(yaml.AliasEvent)
        self._depth += 1
        if self._depth > MAX_DEPTH:
            raise _TooBig(f"nested deeper than {MAX_DEPTH} levels")
        try:
            node = super().compose_node(parent, index)
        finally:
            self._depth -= 1
        if is_alias:
            size = self._expanded.get(id(node), 1)
        else:
            size = 1 + sum(self._size(child) for child in _children(node))
            self._expanded[id(node)] = size
        self._total += size if is_alias else 1
        if self._total > MAX_NODES or size > MAX_NODES:
            raise _TooBig(f"more than {MAX_NODES} values once its aliases (*name) are expanded")
        return node

    def _size(self, node: Any) -> int:
        return self._expanded.get(id(node), 1)


def _children(node: Any) -> list[Any]:
    if isinstance(node, yaml.SequenceNode):
        return list(node.value)
    if isinstance(node, yaml.MappingNode):
        return [part for pair in node.value for part in pair]
    return []


class _TooBig(Exception):
    """The document exceeds one of the bounds above."""


def read_text(path: str | os.PathLike[str], what: str = "file", hint: str = "") -> str:
    """The file's text, or a ConfigError naming it (`hint` is appended to "not found")."""
    p = Path(path)
    try:
        with p.open("rb") as fh:
            raw = fh.read(MAX_BYTES + 1)
    except FileNotFoundError:
        raise ConfigError(f"{p}: {what} not found{hint}") from None
    except OSError as exc:
        raise ConfigError(f"{p}: cannot read {what}: {exc.strerror}") from None
    if len(raw) > MAX_BYTES:
        raise ConfigError(f"{p}: {what} is larger than {MAX_BYTES} bytes: not a file to read")
    try:
        return raw.decode()
    except UnicodeDecodeError as exc:
        raise ConfigError(f"{p}: not a UTF-8 text file (byte {exc.start})") from None


def parse_yaml(text: str, source: str, what: str = "file") -> Any:
    """The YAML document in `text`; a syntax error names its line, an empty file says so."""
    return _load(text, source, what)[0]


def parse_yaml_located(text: str, source: str, what: str = "file") -> tuple[Any, Positions]:
    """The document in `text` and where each of its keys and list items starts (same errors)."""
    data, root = _load(text, source, what)
    positions: Positions = {}
    _locate(root, (), positions, set())
    return data, positions


def _load(text: str, source: str, what: str) -> tuple[Any, Any]:
    """The document and its node tree, within the bounds above, or a one-line ConfigError."""
    if len(text) > MAX_BYTES:
        raise ConfigError(f"{source}: {what} is larger than {MAX_BYTES} bytes")
    loader = _Bounded(text)
    try:
        root = loader.get_single_node()
        data = loader.construct_document(root) if root is not None else None
    except _TooBig as exc:
        raise ConfigError(f"{source}: {what} refused: {exc}") from None
    except RecursionError:  # a bound above should stop it first; never a traceback anyway
        raise ConfigError(f"{source}: {what} refused: nested too deeply") from None
    except yaml.YAMLError as exc:
        mark = getattr(exc, "problem_mark", None)
        where = f"line {mark.line + 1}, column {mark.column + 1}" if mark else "unknown place"
        problem = getattr(exc, "problem", None) or str(exc).splitlines()[0]
        raise ConfigError(f"{source}: YAML syntax error at {where}: {_short(problem)}") from None
    finally:
        loader.dispose()
    if data is None:
        raise ConfigError(f"{source}: {what} is empty")
    return data, root


def _locate(node: Any, path: tuple[str | int, ...], out: Positions, above: set[int]) -> None:
    """Record where every key / item under `node` starts. Run after construction, so merge
    keys (`<<: *base`) are already flattened into the mappings that use them; a node that
    contains itself (`&a [*a]`) is not walked twice. MAX_NODES bounds the walk."""
    if id(node) in above:
        return
    above = above | {id(node)}
    if isinstance(node, yaml.MappingNode):
        for key, value in node.value:
            if isinstance(key, yaml.ScalarNode):
                here = (*path, str(key.value))
                # Assigned, not setdefault: of a key given twice (or merged, then given) the
                # last one is the value in force, so it is the line to point at.
                out[here] = (key.start_mark.line + 1, key.start_mark.column + 1)
                _locate(value, here, out, above)
    elif isinstance(node, yaml.SequenceNode):
        for index, item in enumerate(node.value):
            here = (*path, index)
            out[here] = (item.start_mark.line + 1, item.start_mark.column + 1)
            _locate(item, here, out, above)


def _short(text: str, limit: int = 200) -> str:
    return text if len(text) <= limit else text[:limit] + "..."
