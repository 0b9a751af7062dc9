"""The replica forms of a model's config, expanded to one mapping per replica. Pure text work.

A replica is one vLLM endpoint on a set of GPUs: a whole node (today's `nodes: gpu[1-4]`),
part of a node (`replicas_per_node: 2`, or `{node: gpu09, gpus: "0-3"}`), or several nodes
(`{nodes: "gpu[11-12]", url: ...}`, the url being its head's). Everything here turns those
forms into the explicit `replicas:` list `ReplicaConfig` validates; errors are ValueErrors so
pydantic reports them as `models.N...: message` (exit 2).
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from typing import Any
from urllib.parse import urlsplit

from slurm_idle.hostlist import expand_hostlist

DEFAULT_REPLICA_URL = "http://{node}:8000"
#: A Slurm node name (config.NODE_NAME_RE: what hostlist.expand_hostlist accepts, not empty).
_NODE_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,127}$")
_PLACEHOLDERS = ("node", "port", "index")


def node_names(nodes: Any, field: str = "nodes") -> list[str]:
    """A Slurm hostlist (`gpu[1-4]`) or a non-empty list of names, as node names."""
    if isinstance(nodes, str) and nodes.strip():
        return expand_hostlist(nodes, strict=True)
    if isinstance(nodes, list | tuple) and nodes and all(isinstance(n, str) and n for n in nodes):
        bad = next((n for n in nodes if not _NODE_NAME.match(n)), None)
        if bad is not None:
            raise ValueError(f"{field}: {bad!r} is not a Slurm node name")
        return list(nodes)
    raise ValueError(
        f"{field} must be a Slurm hostlist like gpu[1-4] or a non-empty list of node names "
        f"(got {nodes!r})"
    )


def parse_gpus(value: Any) -> tuple[int, ...]:
    """GPU indexes: `"0-3"`, `"0,2,4-5"`, `[0, 1]` or one number, as a sorted tuple."""
    if isinstance(value, bool):
        raise ValueError(f"gpus must be GPU indexes like \"0-3\" (got {value!r})")  # noqa: TRY004
    if isinstance(value, int):
        items: list[int] = [value]
    elif isinstance(value, list | tuple) and all(isinstance(v, int) and not isinstance(v, bool)
                                                for v in value):
        items = list(value)
    elif isinstance(value, str) and re.fullmatch(r"\s*\d+(-\d+)?(\s*,\s*\d+(-\d+)?)*\s*", value):
        items = []
        for part in value.split(","):
            lo, _, hi = part.strip().partition("-")
            if hi and int(hi) < int(lo):
                raise ValueError(f"gpus range {part.strip()!r} must be low-high")
            items.extend(range(int(lo), int(hi or lo) + 1))
    else:
        raise ValueError(f"gpus must be GPU indexes like \"0-3\" or [0, 1] (got {value!r})")
    if not items or any(i < 0 for i in items) or len(set(items)) != len(items):
        raise ValueError(f"gpus must list distinct GPU indexes >= 0 (got {value!r})")
    return tuple(sorted(items))


def format_gpus(gpus: tuple[int, ...] | None) -> str:
    """`(0, 1, 2, 3)` -> "0-3"; None (the whole node) -> "all"."""
    if gpus is None:
        return "all"
    parts: list[str] = []
    start = prev = gpus[0]
    for g in (*gpus[1:], None):
        if g is not None and g == prev + 1:
            prev = g
            continue
        parts.append(str(start) if start == prev else f"{start}-{prev}")
        if g is not None:
            start = prev = g
    return ",".join(parts)


def fill_url(template: Any, node: str, port: int | None, index: int) -> str:
    """One replica's URL from the `url:` template: `{node}`, `{port}`, `{index}`."""
    if not isinstance(template, str):  # ValueError: pydantic turns only that into a field error
        raise ValueError(  # noqa: TRY004
            f"url must be a text template like {DEFAULT_REPLICA_URL!r} (got {template!r})"
        )
    if "{port}" in template and port is None:
        raise ValueError(f"url template {template!r} uses {{port}}: give `ports: [8000, 8001]`")
    try:
        return template.format(node=node, port=port, index=index)
    except (KeyError, IndexError, ValueError) as exc:
        detail = f"unknown placeholder {{{exc.args[0]}}}" if isinstance(exc, KeyError) else str(exc)
        raise ValueError(
            f"url template {template!r}: {detail}; the placeholders are {{node}}, {{port}} and "
            "{index} (or write the port itself, e.g. http://{node}:8000)"
        ) from None


def url_port(url: str) -> int | None:
    """The port a URL names (or its scheme's), None when it cannot be read."""
    try:
        parts = urlsplit(url)
        return parts.port or {"http": 80, "https": 443}.get(parts.scheme)
    except ValueError:
        return None


def expand_model(data: dict[str, Any]) -> dict[str, Any]:
    """A model mapping with `nodes:`/`url:`/`ports:`/`replicas_per_node:` turned into `replicas:`.

    `nodes: gpu[01-08]`, `replicas_per_node: 2`, `gpus_per_replica: 4` is 16 replicas on 8 nodes,
    replica i of a node on GPUs i*4..i*4+3 and port `ports[i]` (or whatever `{index}` makes of
    the url). Explicit `replicas:` entries get their index on their head node in list order.
    """
    data = dict(data)
    per_node = data.pop("replicas_per_node", None)
    ports = data.pop("ports", None)
    if per_node is not None and (isinstance(per_node, bool) or not isinstance(per_node, int)
                                 or per_node < 1):
        raise ValueError(f"replicas_per_node must be a whole number >= 1 (got {per_node!r})")
    if ports is not None:
        if not (isinstance(ports, list | tuple) and ports
                and all(isinstance(p, int) and not isinstance(p, bool) and 0 < p < 65536
                        for p in ports)):
            raise ValueError(f"ports must be a list of port numbers like [8000, 8001] (got {ports!r})")
        if len(set(ports)) != len(ports):
            raise ValueError(f"ports lists a port twice: {list(ports)}")
    if "nodes" not in data:
        if per_node is not None or ports is not None:
            raise ValueError("replicas_per_node and ports go with `nodes:` (a hostlist)")
        replicas = data.get("replicas")
        if isinstance(replicas, list | tuple):
            data["replicas"] = _index_explicit(list(replicas))
        return data
    names = node_names(data.pop("nodes"))
    count = per_node or 1
    if ports is not None and len(ports) != count:
        raise ValueError(f"ports has {len(ports)} port(s) for replicas_per_node {count}: give one each")
    template = data.pop("url", DEFAULT_REPLICA_URL)
    if count > 1 and isinstance(template, str) and not ("{port}" in template or "{index}" in template):
        raise ValueError(
            f"url {template!r} is the same for the {count} replicas of a node: use {{port}} with "
            "`ports: [...]`, or {index}"
        )
    gpus_per = data.get("gpus_per_replica", 4)
    out = []
    for node in names:
        for i in range(count):
            port = ports[i] if ports is not None else None
            replica: dict[str, Any] = {"node": node, "url": fill_url(template, node, port, i),
                                       "index": i}
            if port is not None:
                replica["port"] = port
            if count > 1 and isinstance(gpus_per, int):
                replica["gpus"] = list(range(i * gpus_per, (i + 1) * gpus_per))
            out.append(replica)
    data["replicas"] = out
    return data


def _index_explicit(replicas: list[Any]) -> list[Any]:
    """Give explicit replicas without an `index` their position among the model's replicas on
    the same head node."""
    seen: dict[str, int] = {}
    out = []
    for item in replicas:
        if isinstance(item, dict) and "index" not in item:
            head = item.get("node")
            if head is None and isinstance(item.get("nodes"), str | list | tuple):
                try:
                    head = node_names(item["nodes"])[0]
                except ValueError:
                    head = None
            if isinstance(head, str):
                item = {**item, "index": seen.get(head, 0)}
                seen[head] = seen.get(head, 0) + 1
        out.append(item)
    return out


def replica_fields(data: Any) -> Any:
    """One `replicas:` entry normalised: `nodes` expanded (head = first), `node` filled, `gpus`
    parsed, `port` read from the url, `name` defaulted (the node for a whole-node replica, else
    `node:port`)."""
    if not isinstance(data, dict):
        return data
    data = dict(data)
    if "nodes" in data:
        names = node_names(data["nodes"])
        if "node" in data and data["node"] != names[0]:
            raise ValueError(f"node {data['node']!r} must be the first of nodes {names} (the head)")
        if len(set(names)) != len(names):
            raise ValueError(f"nodes lists a node twice: {names}")
        data["nodes"] = names
        data["node"] = names[0]
    elif isinstance(data.get("node"), str):
        data["nodes"] = [data["node"]]
    if data.get("gpus") is not None:
        data["gpus"] = parse_gpus(data["gpus"])
    if data.get("port") is None and isinstance(data.get("url"), str):
        data["port"] = url_port(data["url"])
    if not data.get("name") and isinstance(data.get("node"), str):
        whole = data.get("gpus") is None
        data["name"] = data["node"] if whole else f"{data['node']}:{data.get('port') or data.get('index', 0)}"
    return data


def check_topology(models: Sequence[Any], engine: Any) -> None:
    """Refuse a fleet that cannot exist or cannot be lent (`models`: ModelConfigs, `engine`: the
    top-level EngineConfig or None); the message names the field."""
    where: dict[str, str] = {}  # replica name -> field path
    urls: dict[str, str] = {}
    on_node: dict[str, list[tuple[str, tuple[int, ...] | None, str]]] = {}
    spans: dict[str, tuple[str, str]] = {}  # node -> (model, field) of a multi-node replica on it
    for i, m in enumerate(models):
        for j, r in enumerate(m.replicas):
            field = f"models.{i}.replicas.{j}"
            for n in r.nodes:
                for other_field, other_gpus, other_model in on_node.get(n, []):
                    if r.gpus is None or other_gpus is None:
                        if r.gpus is None and other_gpus is None and other_model != m.name:
                            raise ValueError(
                                f"node {n!r} is listed under both {other_model!r} and {m.name!r} "
                                f"({other_field} and {field} each take the whole node; give each "
                                "its `gpus:`)")
                        raise ValueError(
                            f"{field}.gpus: node {n} is wholly given to {other_field if other_gpus is None else field} "
                            f"but also carries {field if other_gpus is None else other_field}: a GPU "
                            "in two replicas (give each replica its `gpus:`)")
                    shared = sorted(set(r.gpus) & set(other_gpus))
                    if shared:
                        raise ValueError(
                            f"{field}.gpus: GPU {shared[0]} of {n} is also in {other_field}: a GPU "
                            "in two replicas")
                on_node.setdefault(n, []).append((field, r.gpus, m.name))
                if len(r.nodes) > 1:
                    seen = spans.get(n)
                    if seen is not None and seen[0] != m.name:
                        raise ValueError(
                            f"{field}.nodes: {n} carries multi-node replicas of both {seen[0]!r} "
                            f"({seen[1]}) and {m.name!r}: their nodes would be lendable only "
                            "together, across models; keep multi-node replicas of a model on "
                            "nodes of their own")
                    spans.setdefault(n, (m.name, field))
    for i, m in enumerate(models):
        for j, r in enumerate(m.replicas):
            field = f"models.{i}.replicas.{j}"
            if r.name in where:
                raise ValueError(
                    f"{field}.name: replica name {r.name!r} is also {where[r.name]}'s; names must be "
                    "unique (set `name:`)")
            where[r.name] = field
            if r.url in urls:
                raise ValueError(f"{field}.url: {r.url} is also the url of {urls[r.url]}")
            urls[r.url] = field
    _check_containers(models, engine)


def _check_containers(models: Sequence[Any], default_engine: Any) -> None:
    """With `docker`, replicas sharing a head node need container names that tell them apart."""
    heads: dict[tuple[str, str], int] = {}
    for m in models:
        engine = m.engine or default_engine
        if engine is None or engine.kind != "docker":
            continue
        template = engine.container
        for r in m.replicas:
            key = (template, r.node)
            heads[key] = heads.get(key, 0) + 1
            if heads[key] > 1 and not any(p in template for p in ("{index}", "{port}", "{name}")):
                raise ValueError(
                    f"engine.container {template!r} names one container per node, but {r.node} "
                    "runs several replicas: add {index} or {port} (e.g. vllm-{node}-{index})")
