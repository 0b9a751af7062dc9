"""Mapping Prometheus series back to replicas by their scrape target (`instance`, or a label
holding the node name): which label values name which replica, exactly, never another vLLM on
another port of the same node."""

from __future__ import annotations

import re
from collections.abc import Mapping, Sequence
from urllib.parse import urlsplit

from slurm_idle.config import ReplicaConfig

#: `scheme://host[:port]` followed by a path, query, fragment or nothing: the shape of nearly
#: every replica URL, read without urlsplit (10,000 replicas per tick); anything else -> urlsplit.
_SIMPLE_URL = re.compile(r"([A-Za-z][A-Za-z0-9+.-]*)://([A-Za-z0-9._-]+)(?::([0-9]{1,5}))?(?:[/?#]|$)")


def _host_port(url: str) -> tuple[str, int, bool]:
    """(lower-case host, port or the scheme's default, whether the URL names its port), exactly
    as urlsplit reads them."""
    simple = _SIMPLE_URL.match(url)
    if simple is not None:
        scheme, host, port_text = simple.groups()
        port = int(port_text) if port_text else 0
        if port <= 65535:
            return host.lower(), port or (443 if scheme.lower() == "https" else 80), bool(port_text)
    parts = urlsplit(url)
    named = parts.port
    default = 443 if parts.scheme == "https" else 80
    return (parts.hostname or "").lower(), named or default, named is not None


def target_keys(replica: ReplicaConfig) -> list[str]:
    """The label values that identify a replica's series: host:port of its URL, its node name
    (an `instance` relabelled to it), the short host:port; and, only for a URL without a port
    (a proxy on the scheme's port, say), `host:*`: its host on any port.

    A URL with an explicit port matches no other port: gpu01:8001 may be another vLLM on the
    same node (another model, someone's test), whose load is not this replica's. Sites whose
    Prometheus scrapes the replica on another port than its URL's relabel `instance` to the node
    name (or set metrics.instance_label to a label holding it).
    """
    host, port, explicit = _host_port(replica.url)
    keys = [f"{host}:{port}", replica.node.lower()]
    short = host.split(".")[0]
    named = short != host and not host.replace(".", "").isdigit()
    if named:
        keys.append(f"{short}:{port}")
    if not explicit:
        keys.append(f"{host}:*")
        if named:
            keys.append(f"{short}:*")
    return keys


def target_index(replicas: Sequence[tuple[str, ReplicaConfig]]) -> dict[str, str]:
    """label value -> replica url (a replica's key: unique, where a node may run several);
    earlier (more exact) keys win over later ones. A node name heading several replicas is
    no replica's key: a series labelled only with it could be either's (it matches none, so
    both read unknown and nothing is lent on it, rather than one's load counted as the other's)."""
    index: dict[str, str] = {}
    heads: dict[str, int] = {}
    for _, replica in replicas:
        heads[replica.node.lower()] = heads.get(replica.node.lower(), 0) + 1
    all_keys = [
        ([k for k in target_keys(replica) if heads.get(k, 0) < 2], replica.url)
        for _, replica in replicas
    ]
    for rank in range(max((len(keys) for keys, _ in all_keys), default=0)):
        for keys, node in all_keys:
            if rank < len(keys):
                index.setdefault(keys[rank], node)
    return index


def match_target(index: Mapping[str, str], value: str) -> str | None:
    """The node whose replica a label value names (target_keys), or None."""
    v = value.lower()
    if v in index:
        return index[v]
    host, _, port = v.rpartition(":")
    if host and port.isdigit():
        short = host.split(".")[0]
        return index.get(f"{short}:{port}") or index.get(f"{host}:*") or index.get(f"{short}:*")
    return None
