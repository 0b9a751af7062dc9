"""Port blocks for sandboxes, handed out under a lease so that two sandboxes never share a port.

Why a lease and not just "pick a block that looks free": a block can look free while its owner
is still coming up (not bound yet), or while one of its emulators is stopped for a lend
(minutes at a time), and two pickers checking at the same instant both see it free. Either way
two sandboxes (the two CI lanes, parallel shards, two contributors' runs) were handed the same
ports (issue 36). A lease makes the choice exclusive by construction: a picker owns a block
only once it holds the lease, and nobody else can take it until the lease is let go.

The lease is a name in Linux's abstract unix-socket namespace, `@slurm-idle-ports/<port>`, one
per 32-port slot that a block touches. Binding such a name is atomic
(exactly one binder wins, the others get EADDRINUSE); the name is scoped to the network
namespace, which is exactly the scope of the ports it guards (the Debian 13 lane's chroot shares
the host's network namespace, so both lanes see each other's leases); and the kernel drops it
when the last descriptor closes, so a killed sandbox can never leave a stale lease behind. No
lock files, no shared directory, nothing to clean up. `ss -xlp | grep slurm-idle-ports` shows
who holds what.

A sandbox keeps its lease for its whole life: the picking process holds it until `up()` hands
the descriptor to a tiny holder process (`python -m slurm_idle.testing.ports hold`, one of the
sandbox's daemons, stopped by pid at `down()`).

A block also has to be free of other programs' sockets, and it is checked the way its servers
will bind it: `port_bindable` binds *without* SO_REUSEADDR, so a port left in TIME_WAIT by a
server that closed connections first (for ~60 s after it stops) counts as taken; a server that
binds without SO_REUSEADDR would fail on it.
"""

from __future__ import annotations

import errno
import random
import signal
import socket
import sys
from collections.abc import Callable
from pathlib import Path

LEASE_PREFIX = "slurm-idle-ports/"
LEASE_SLOT = 32  # ports per lease name
_held: dict[int, Lease] = {}  # base -> the lease this process holds on it


def slot_size(span: int) -> int:
    """Blocks are aligned to a multiple of 32 no smaller than the span: a block picked while
    another sandbox's last ports (bound late, by replica jobs) were still unbound cannot
    take them."""
    return -(-span // 32) * 32


def ephemeral_port_floor(path: Path = Path("/proc/sys/net/ipv4/ip_local_port_range")) -> int:
    """The lowest port the kernel hands to outgoing connections (32768 by default)."""
    try:
        return int(path.read_text().split()[0])
    except (OSError, ValueError, IndexError):
        return 32768


def port_bindable(port: int, host: str = "127.0.0.1") -> bool:
    """A server binding without SO_REUSEADDR could bind this port now (no listener, no
    connection on it, not even one in TIME_WAIT)."""
    with socket.socket() as s:
        try:
            s.bind((host, port))
        except OSError:
            return False
    return True


def _slots(base: int, span: int) -> list[int]:
    """The LEASE_SLOT-aligned slots ports base..base+span-1 touch: one name per 32 ports
    whatever the block's span, so blocks of different spans exclude each other too."""
    return list(range(base // LEASE_SLOT * LEASE_SLOT, base + span, LEASE_SLOT))


def _bind_lease(slot: int) -> socket.socket | None:
    s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        s.bind(f"\0{LEASE_PREFIX}{slot}")
    except OSError as e:
        s.close()
        if e.errno == errno.EADDRINUSE:
            return None
        raise
    return s


class Lease:
    """The lease on one block: every slot it touches, held until `release()`."""

    def __init__(self, base: int, span: int, sockets: list[socket.socket]) -> None:
        self.base = base
        self.span = span
        self._sockets = sockets

    def fds(self) -> list[int]:
        """The descriptors to hand to a process that keeps the lease after this one lets go."""
        return [s.fileno() for s in self._sockets]

    def release(self) -> None:
        for s in self._sockets:
            s.close()
        self._sockets = []


def try_lease(base: int, span: int) -> Lease | None:
    """The lease on ports base..base+span-1, or None when another holder has any part of it."""
    taken: list[socket.socket] = []
    for slot in _slots(base, span):
        s = _bind_lease(slot)
        if s is None:
            for t in taken:
                t.close()
            return None
        taken.append(s)
    return Lease(base, span, taken)


def leased_by_anyone(base: int, span: int) -> bool:
    """Some process (this one included) holds a lease on part of the block."""
    lease = try_lease(base, span)
    if lease is None:
        return True
    lease.release()
    return False


def block_range(span: int) -> tuple[int, int, int]:
    """(low, top, step): the bases a block is chosen among, `range(low, top, step)`; each a
    multiple of the step, so that a chosen block is exactly one slot, one lease."""
    step = slot_size(span)
    top = min(ephemeral_port_floor(), 60000) - span
    low = 20000 if top - 20000 >= 16 * step else 10000
    return -(-low // step) * step, top, step


def lease_free_block(span: int, rng: random.Random | None = None,
                     bindable: Callable[[int], bool] | None = None) -> Lease:
    """Lease a block of `span` ports nobody else leases and nothing else uses, below the
    kernel's ephemeral range (an emulator restarted after a lend rebinds its port; an outgoing
    connection may hold it by then as its local port, or connect to itself on it)."""
    pick = rng or random.Random()
    free = port_bindable if bindable is None else bindable
    low, top, step = block_range(span)
    for _ in range(200):
        base = pick.randrange(low, top, step)
        lease = try_lease(base, span)
        if lease is None:
            continue  # another sandbox's, whether or not its daemons are bound right now
        if all(free(base + i) for i in range(span)):
            return lease
        lease.release()
    raise RuntimeError("sandbox: no free block of ports found (200 tries)")


def free_port() -> int:
    """One port for a test's own server (Prometheus, HAProxy, nginx, the web view), leased to
    this process until it ends: below the ephemeral range, so no outgoing connection takes it
    between this call and the server's bind, and never inside a sandbox's block."""
    lease = lease_free_block(1)
    hold(lease)
    return lease.base


def hold(lease: Lease) -> None:
    """Keep `lease` in this process until it ends or `release_held(lease.base)`."""
    release_held(lease.base)
    _held[lease.base] = lease


def held(base: int) -> Lease | None:
    """The lease this process holds on the block at `base`, if any."""
    return _held.get(base)


def release_held(base: int) -> None:
    lease = _held.pop(base, None)
    if lease is not None:
        lease.release()


def main(argv: list[str]) -> int:
    """`python -m slurm_idle.testing.ports hold BASE`: keep the inherited lease descriptors
    open until SIGTERM (a sandbox's holder process; BASE is only there for `ps`)."""
    if argv[:1] != ["hold"]:
        print("usage: python -m slurm_idle.testing.ports hold BASE", file=sys.stderr)
        return 2
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(0))
    while True:
        signal.pause()


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
