"""The DNS watch's parser reads the question name of a query to port 53 in IPv4 and IPv6,
over UDP and TCP, and nothing else (answers, other ports, broken packets); the watch itself
sees a query sent to a closed loopback port, on `lo`."""

from __future__ import annotations

import os
import socket
import struct
import time

import pytest

from slurm_idle.testing.dnswatch import (
    ETH_P_IP,
    ETH_P_IPV6,
    DnsWatch,
    dns_query,
    dns_query_packet,
)

QUERY = dns_query_packet("registry-1.docker.io")


def udp(dport: int, payload: bytes) -> bytes:
    return struct.pack("!HHHH", 40000, dport, 8 + len(payload), 0) + payload


def tcp(dport: int, payload: bytes) -> bytes:
    header = struct.pack("!HHIIBBHHH", 40000, dport, 1, 0, 5 << 4, 0x18, 512, 0, 0)
    return header + struct.pack("!H", len(payload)) + payload


def ipv4(proto: int, segment: bytes) -> bytes:
    return struct.pack("!BBHHHBBH4s4s", 0x45, 0, 20 + len(segment), 0, 0, 64, proto, 0,
                       bytes([192, 0, 2, 2]), bytes([10, 255, 255, 53])) + segment


def ipv6(proto: int, segment: bytes) -> bytes:
    return struct.pack("!IHBB16s16s", 6 << 28, len(segment), proto, 64, b"\0" * 16,
                       b"\0" * 15 + b"\1") + segment


@pytest.mark.parametrize("ethertype, packet", [
    (ETH_P_IP, ipv4(socket.IPPROTO_UDP, udp(53, QUERY))),
    (ETH_P_IP, ipv4(socket.IPPROTO_TCP, tcp(53, QUERY))),
    (ETH_P_IPV6, ipv6(socket.IPPROTO_UDP, udp(53, QUERY))),
])
def test_a_query_to_port_53_gives_its_name(ethertype: int, packet: bytes) -> None:
    """UDP or TCP (past the length prefix), IPv4 or IPv6: the question's name, lower case."""
    assert dns_query(ethertype, packet) == "registry-1.docker.io"


def test_answers_other_ports_and_broken_packets_are_not_queries() -> None:
    """An answer (QR bit), another port, another protocol, a cut packet: None, no exception."""
    answer = QUERY[:2] + bytes([QUERY[2] | 0x80]) + QUERY[3:]
    full = ipv4(socket.IPPROTO_UDP, udp(53, QUERY))
    assert dns_query(ETH_P_IP, ipv4(socket.IPPROTO_UDP, udp(53, answer))) is None
    assert dns_query(ETH_P_IP, ipv4(socket.IPPROTO_UDP, udp(5353, QUERY))) is None
    assert dns_query(ETH_P_IP, ipv4(socket.IPPROTO_ICMP, udp(53, QUERY))) is None
    assert dns_query(0x0806, full) is None  # ARP
    # cut anywhere before the name's end (its type and class, 4 bytes, follow it)
    assert all(dns_query(ETH_P_IP, full[:n]) is None for n in range(len(full) - 4))


@pytest.mark.skipif(os.geteuid() != 0, reason="a packet socket needs root (CAP_NET_RAW)")
def test_the_watch_sees_a_query_to_a_closed_loopback_port_on_lo() -> None:
    """The positive control the e2e tests use: a query nobody answers, seen leaving on `lo`
    only (so it does not count as off loopback)."""
    watch = DnsWatch().start()
    try:
        t0 = time.time()
        with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
            s.sendto(dns_query_packet("probe.slurm-idle.invalid"), ("127.0.0.1", 53))
        deadline = time.monotonic() + 5
        while time.monotonic() < deadline and not watch.queries(t0):
            time.sleep(0.05)
        seen = [(q.interface, q.name) for q in watch.queries(t0)]
        assert ("lo", "probe.slurm-idle.invalid") in seen
        assert not [q for q in watch.off_loopback(t0) if q.name == "probe.slurm-idle.invalid"]
    finally:
        watch.stop()
