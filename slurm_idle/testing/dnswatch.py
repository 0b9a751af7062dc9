"""Watch the machine's network interfaces for DNS queries (a test helper; needs root).

A sandbox must not send traffic off loopback: a job whose image was missing once made the
sandbox's dockerd ask the host's resolver for `registry-1.docker.io`. The e2e tests prove the
opposite by watching: a packet socket (AF_PACKET, cooked: no link header) sees every packet
each interface sends, loopback included; `DnsWatch` keeps the question name of each outgoing
DNS query (UDP or TCP to port 53) with its interface, so a test can say "no query left `lo`
while the job ran" and, for a positive control, "a query sent to a closed loopback port was
seen on `lo`". The parser is pure (`dns_query`); the socket and its thread are thin.
"""

from __future__ import annotations

import socket
import struct
import threading
import time
from dataclasses import dataclass

ETH_P_ALL = 0x0003
ETH_P_IP = 0x0800
ETH_P_IPV6 = 0x86DD
PACKET_OUTGOING = 4  # sll_pkttype of a packet this host sends
DNS_PORT = 53


@dataclass(frozen=True)
class Query:
    interface: str
    name: str
    t: float  # time.time() when seen


def dns_query(ethertype: int, packet: bytes) -> str | None:
    """The question name of a DNS query to port 53 in an IPv4/IPv6 packet, else None (pure).

    Only the first question is read (resolvers send one); a packet too short or malformed
    for any layer is None, never an exception.
    """
    try:
        if ethertype == ETH_P_IP and packet[:1] and packet[0] >> 4 == 4:
            proto, payload = packet[9], packet[(packet[0] & 0x0F) * 4:]
        elif ethertype == ETH_P_IPV6 and packet[:1] and packet[0] >> 4 == 6:
            proto, payload = packet[6], packet[40:]  # extension headers: not used by resolvers
        else:
            return None
        if proto == socket.IPPROTO_UDP:
            dport, dns = struct.unpack("!H", payload[2:4])[0], payload[8:]
        elif proto == socket.IPPROTO_TCP:
            dport = struct.unpack("!H", payload[2:4])[0]
            dns = payload[(payload[12] >> 4) * 4 + 2:]  # past the header and the length prefix
        else:
            return None
        if dport != DNS_PORT or len(dns) < 13 or dns[2] & 0x80:  # QR set: an answer
            return None
        return _qname(dns, 12)
    except (IndexError, struct.error):
        return None


def _qname(dns: bytes, at: int) -> str | None:
    labels: list[str] = []
    while True:
        length = dns[at]
        if length == 0:
            return ".".join(labels) if labels else None
        if length & 0xC0:  # a pointer never appears in a query's question
            return None
        label = dns[at + 1:at + 1 + length]
        if len(label) != length:
            return None
        labels.append(label.decode("ascii", errors="replace").lower())
        at += 1 + length


def dns_query_packet(name: str, query_id: int = 0x5151) -> bytes:
    """A minimal DNS query for `name` (type A): what a test sends to a closed loopback port
    to show the watch sees queries at all."""
    question = b"".join(bytes([len(p)]) + p.encode() for p in name.split(".")) + b"\0"
    return struct.pack("!HHHHHH", query_id, 0x0100, 1, 0, 0, 0) + question + b"\0\1\0\1"


class DnsWatch:
    """Every outgoing DNS query on every interface, from start() to stop()."""

    def __init__(self) -> None:
        # PermissionError without CAP_NET_RAW: callers skip, saying so.
        self._sock = socket.socket(socket.AF_PACKET, socket.SOCK_DGRAM, socket.htons(ETH_P_ALL))
        self._sock.settimeout(0.2)
        self._stop = threading.Event()
        self._lock = threading.Lock()
        self._seen: list[Query] = []
        self._thread = threading.Thread(target=self._run, name="dnswatch", daemon=True)

    def start(self) -> DnsWatch:
        self._thread.start()
        return self

    def _run(self) -> None:
        while not self._stop.is_set():
            try:
                packet, addr = self._sock.recvfrom(65535)
            except (TimeoutError, OSError):
                continue
            interface, ethertype, pkttype = addr[0], addr[1], addr[2]
            if pkttype != PACKET_OUTGOING:
                continue  # on lo each packet shows twice: outgoing, then received
            name = dns_query(ethertype, packet)
            if name is not None:
                with self._lock:
                    self._seen.append(Query(interface, name, time.time()))

    def queries(self, since: float = 0.0) -> list[Query]:
        with self._lock:
            return [q for q in self._seen if q.t >= since]

    def off_loopback(self, since: float = 0.0) -> list[Query]:
        """Queries that left the machine's loopback (any interface but `lo`) since `since`."""
        return [q for q in self.queries(since) if q.interface != "lo"]

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(timeout=5)
        self._sock.close()
