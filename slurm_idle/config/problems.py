"""Every problem of an invalid config file, each with its dotted path, line and a suggestion.

An admin fixing a config wants the whole list at once, each entry pointing at the line to edit,
and a typo answered with the key that was meant (`lend_partiton` -> `lend_partition`): one
round of edits, not one `config check` per mistake. `ConfigInvalid` carries the problems; its
text is one line per problem (`file:LINE:COL: message`), which the CLI prints on stderr.
"""

from __future__ import annotations

import difflib
import types
import typing
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from pydantic import BaseModel, ValidationError
from pydantic_core import ErrorDetails

from slurm_idle.errors import ConfigError
from slurm_idle.yamlfile import Positions

Loc = tuple[str | int, ...]


@dataclass(frozen=True)
class ConfigProblem:
    """One thing to fix: where (dotted path, 1-based line and column if known) and what."""

    path: str | None  # None: a problem of the whole file (not found, YAML syntax)
    message: str
    line: int | None = None
    column: int | None = None
    suggestion: str | None = None  # the valid key closest to an unknown one

    def text(self, source: str) -> str:
        """`file:LINE:COL: message (did you mean 'x'?)`, the form editors and grep know."""
        where = source + (f":{self.line}" if self.line else "") + (
            f":{self.column}" if self.line and self.column else "")
        hint = f" (did you mean {self.suggestion!r}?)" if self.suggestion else ""
        return f"{where}: {self.message}{hint}"

    def as_json(self) -> dict[str, Any]:
        return {"path": self.path, "line": self.line, "column": self.column,
                "message": self.message, "suggestion": self.suggestion}


class ConfigInvalid(ConfigError):
    """The config file parsed but does not validate: every problem, not just the first."""

    def __init__(self, source: str, problems: Sequence[ConfigProblem]) -> None:
        self.source = source
        self.problems = list(problems)
        super().__init__("\n".join(p.text(source) for p in self.problems))


def problems_of(exc: ValidationError, root: type[BaseModel], positions: Positions,
                extra_keys: dict[type[BaseModel], tuple[str, ...]] | None = None) -> list[ConfigProblem]:
    """Each error of `exc` (validating `root`) as a ConfigProblem located in the file.

    `extra_keys` names keys a model accepts beyond its fields (a shorthand its before-validator
    expands), so they are suggested too.
    """
    problems = []
    for error in significant_errors(exc):
        loc: Loc = tuple(error["loc"])
        line, column = locate(loc, positions)
        suggestion = None
        if error["type"] == "extra_forbidden" and loc and isinstance(loc[-1], str):
            model = model_at(root, loc[:-1])
            if model is not None:
                valid = [*model.model_fields, *(extra_keys or {}).get(model, ())]
                close = difflib.get_close_matches(loc[-1], valid, n=1, cutoff=0.6)
                suggestion = close[0] if close else None
        problems.append(ConfigProblem(dotted(loc), describe_error(error), line, column, suggestion))
    problems = _without_echoed_missing(problems)
    # In file order, as an editor walks it (pydantic reports unknown keys after the fields).
    return sorted(problems, key=lambda p: (p.line is None, p.line or 0, p.column or 0))


def _without_echoed_missing(problems: list[ConfigProblem]) -> list[ConfigProblem]:
    """A misspelled required key (`ulr`) is one mistake, not two: drop the `missing 'url'`
    when its unknown sibling's suggestion is that key (the suggestion already says it)."""
    meant = {p.path.rsplit(".", 1)[0] + "." + p.suggestion if "." in p.path else p.suggestion
             for p in problems if p.suggestion and p.path}
    return [p for p in problems
            if not (p.message.startswith("missing required key") and p.path in meant)]


def significant_errors(exc: ValidationError) -> list[ErrorDetails]:
    """The errors of `exc` minus those on a container that only echo an error inside it
    (`models` too short because its one item failed): the admin has one thing to fix, not two."""
    all_errors = exc.errors()
    locs = [tuple(e["loc"]) for e in all_errors]
    return [
        e for e in all_errors
        if not any(len(loc) > len(e["loc"]) and loc[: len(e["loc"])] == tuple(e["loc"]) for loc in locs)
    ] or all_errors


def describe_error(error: ErrorDetails) -> str:
    """One pydantic error as a short sentence that names its dotted path."""
    path = dotted(tuple(error["loc"]))
    kind = error["type"]
    if kind == "extra_forbidden":
        return f"unknown key {path!r}"
    if kind == "missing":
        return f"missing required key {path!r}"
    if kind == "value_error":  # our own validators: their message is the whole story
        text = error["msg"].removeprefix("Value error, ")
        # ...unless it quotes a hostile value at length: one line stays a readable line.
        return f"{path}: {text if len(text) <= 300 else text[:150] + ' ... ' + text[-100:]}"
    message = f"{path}: {error['msg']}"
    if "input" in error:
        got = repr(error["input"])  # bounded: the input may be any (large) structure
        message += f" (got {got if len(got) <= 80 else got[:80] + '...'})"
    return message


def dotted(loc: Loc) -> str:
    return ".".join(str(part) for part in loc) or "(top level)"


def locate(loc: Loc, positions: Positions) -> tuple[int | None, int | None]:
    """Line and column of `loc`, else of its nearest enclosing key that is in the file (a
    missing key, or a value a shorthand expanded into, is reported where its parent is)."""
    for end in range(len(loc), 0, -1):
        if loc[:end] in positions:
            return positions[loc[:end]]
    return None, None


def model_at(root: type[BaseModel], loc: Loc) -> type[BaseModel] | None:
    """The model class that validates the mapping at `loc` under `root`, if it is one."""
    current: Any = root
    for part in loc:
        current = _model_or_items(current)
        if isinstance(part, int):
            if not (isinstance(current, tuple) and current[0] == "items"):
                return None
            current = current[1]
        else:
            if not (isinstance(current, type) and issubclass(current, BaseModel)):
                return None
            field = current.model_fields.get(part)
            if field is None:
                return None
            current = field.annotation
    found = _model_or_items(current)
    return found if isinstance(found, type) and issubclass(found, BaseModel) else None


def _model_or_items(annotation: Any) -> Any:
    """A model class, ("items", element annotation) for a tuple/list, or None: what a YAML
    mapping or list at this place is validated as (`X | None` unwrapped)."""
    if isinstance(annotation, type) and issubclass(annotation, BaseModel):
        return annotation
    origin = typing.get_origin(annotation)
    args = typing.get_args(annotation)
    if origin in (typing.Union, types.UnionType):
        for arg in args:
            found = _model_or_items(arg)
            if found is not None:
                return found
        return None
    if origin in (tuple, list) and args:
        return ("items", args[0])
    return None
