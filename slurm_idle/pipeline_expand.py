"""Pipeline parameters, fan-out and data flow: what turns one step of the YAML into its jobs.

- `params:` of the pipeline are its parameters (with defaults); `pipeline run -p lr=3e-4`
  overrides one (typed like its default). Any string of a step may say `{params.lr}`.
- `matrix: {seed: [1, 2, 3]}` fans a step out into one job per value (the product when there
  are several keys): `train-0`, `train-1`, `train-2`, each with `{matrix.seed}` set. A step
  that depends on `train` waits for all of them (the join).
- `outputs: true` (or a container path, default `/outputs`) gives a step a writable output
  dir at `<data_dir>/<step>` (`<data_dir>/<step>/<index>` per matrix job). Every dependent
  gets it read-only at `/inputs/<step>`: a join sees one subdirectory per matrix job.

A string that is exactly one placeholder keeps the value's type (`lr: "{params.lr}"` stays a
float); inside longer text it is formatted. Unknown placeholders are errors. All pure.
"""

from __future__ import annotations

import itertools
import re
from collections.abc import Mapping, Sequence
from typing import Any

from slurm_idle.errors import ConfigError

ParamValue = str | int | float | bool
PLACEHOLDER = re.compile(r"\{(params|matrix)\.([A-Za-z_][A-Za-z0-9_]*)\}")
INPUTS_ROOT = "/inputs"
DEFAULT_OUTPUTS = "/outputs"


def parse_overrides(pairs: Sequence[str]) -> dict[str, str]:
    """`-p KEY=VALUE` words to a mapping (ConfigError on a word without `=`)."""
    out = {}
    for pair in pairs:
        key, sep, value = pair.partition("=")
        if not sep or not key:
            raise ConfigError(f"-p {pair!r}: write -p NAME=VALUE")
        out[key.strip()] = value
    return out


def _typed(text: str, like: ParamValue, name: str) -> ParamValue:
    try:
        if isinstance(like, bool):
            if text.lower() in {"true", "1", "yes"}:
                return True
            if text.lower() in {"false", "0", "no"}:
                return False
            raise ValueError(text)
        if isinstance(like, int):
            return int(text)
        if isinstance(like, float):
            return float(text)
    except ValueError:
        raise ConfigError(
            f"-p {name}={text}: parameter {name!r} is a {type(like).__name__} "
            f"(default {like!r})"
        ) from None
    return text


def resolve_params(
    declared: Mapping[str, ParamValue], overrides: Mapping[str, str]
) -> dict[str, ParamValue]:
    """The pipeline's parameters: defaults, with -p overrides typed like their default."""
    unknown = sorted(set(overrides) - set(declared))
    if unknown:
        known = ", ".join(sorted(declared)) or "none"
        raise ConfigError(
            f"unknown pipeline parameter(s) {', '.join(unknown)}: declare them under `params:` "
            f"(declared: {known})"
        )
    return {k: _typed(overrides[k], v, k) if k in overrides else v for k, v in declared.items()}


def template(value: Any, scopes: Mapping[str, Mapping[str, Any]]) -> Any:
    """Replace `{params.X}` / `{matrix.X}` in every string of a nested value."""
    if isinstance(value, str):
        whole = PLACEHOLDER.fullmatch(value)
        if whole:
            return _lookup(scopes, whole.group(1), whole.group(2))
        return PLACEHOLDER.sub(lambda m: _text(_lookup(scopes, m.group(1), m.group(2))), value)
    if isinstance(value, Mapping):
        return {k: template(v, scopes) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [template(v, scopes) for v in value]
    return value


def _text(value: Any) -> str:
    return str(value).lower() if isinstance(value, bool) else str(value)


def _lookup(scopes: Mapping[str, Mapping[str, Any]], scope: str, name: str) -> Any:
    values = scopes.get(scope, {})
    if name not in values:
        where = "the pipeline's params" if scope == "params" else "this step's matrix"
        raise ConfigError(f"{{{scope}.{name}}}: no {name!r} in {where}")
    return values[name]


def matrix_rows(matrix: Mapping[str, Sequence[ParamValue]] | None) -> list[dict[str, ParamValue]]:
    """One mapping per job of a fan-out ([{}] for a plain step): the product of the lists."""
    if not matrix:
        return [{}]
    for key, values in matrix.items():
        if not values:
            raise ConfigError(f"matrix {key!r} has no values")
    keys = list(matrix)
    return [dict(zip(keys, combo, strict=True)) for combo in itertools.product(*matrix.values())]


def instance_names(step: str, rows: Sequence[Mapping[str, Any]]) -> list[str]:
    """`step` for a plain step, `step-0`, `step-1`, ... for a fan-out."""
    if len(rows) == 1 and not rows[0]:
        return [step]
    return [f"{step}-{i}" for i in range(len(rows))]


def outputs_target(outputs: bool | str) -> str | None:
    if outputs is False:
        return None
    return DEFAULT_OUTPUTS if outputs is True else outputs


def data_mounts(
    fields: Mapping[str, Any],
    *,
    data_dir: str | None,
    step: str,
    index: int | None,
    outputs: str | None,
    upstream_outputs: Sequence[str],
) -> dict[str, Any]:
    """The job fields with the derived output and input mounts added to `mounts`."""
    if not outputs and not upstream_outputs:
        return dict(fields)
    if data_dir is None:
        raise ConfigError("steps with `outputs:` need the pipeline's `data_dir` (shared storage)")
    mounts = dict(fields.get("mounts") or {})
    if outputs:
        source = f"{data_dir}/{step}" + (f"/{index}" if index is not None else "")
        mounts["outputs"] = [*mounts.get("outputs", ()), {"source": source, "target": outputs}]
    if upstream_outputs:
        derived = [{"source": f"{data_dir}/{up}", "target": f"{INPUTS_ROOT}/{up}"}
                   for up in upstream_outputs]
        mounts["inputs"] = [*mounts.get("inputs", ()), *derived]
    return {**fields, "mounts": mounts}
