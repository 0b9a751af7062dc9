"""The sandbox's closed-resolver check (procs.dns_port_closed): another sandbox's probe, which
holds :53 for microseconds, is not a DNS server; a server that keeps the port is."""

from __future__ import annotations

import socket

import pytest

from slurm_idle.testing import procs

HOST = "127.255.53.54"  # beside the sandbox's resolver address: this test never takes that


def test_a_probe_that_held_the_port_once_is_not_a_server(monkeypatch: pytest.MonkeyPatch) -> None:
    answers = iter([False, True])
    monkeypatch.setattr(procs, "_binds", lambda host, port: next(answers))
    assert procs.dns_port_closed(HOST, pause_s=0.0)


def test_a_server_that_keeps_the_port_is_found() -> None:
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as server:
        try:
            server.bind((HOST, 53))
        except OSError:
            pytest.skip(f"cannot bind {HOST}:53 here (needs root)")
        assert not procs.dns_port_closed(HOST, tries=3, pause_s=0.0)
    assert procs.dns_port_closed(HOST, tries=1)
