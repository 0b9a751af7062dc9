"""Two sandboxes on one machine are never handed overlapping ports (issue 36), against the real
kernel: separate processes choosing at the same instant, and a sandbox whose emulator is
stopped as for a lend. Each scenario also runs with the lease removed, to show it then fails."""

from __future__ import annotations

import itertools
import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from slurm_idle.testing import ports, procs, sandboxconf
from slurm_idle.testing.procs import PidFile

ROOT = Path(__file__).resolve().parents[2]
SPAN = sandboxconf.PORT_SPAN

# One sandbox's port choice in its own process: wait for the start signal (a file), choose
# with the shared seed (so every chooser tries the same blocks in the same order: the worst
# case), print the base, hold the lease until stdin closes. `nolease` removes the isolation.
CHOOSER = """
import os, random, sys, time
from slurm_idle.testing import ports, sandbox
go, seed, mode = sys.argv[1], int(sys.argv[2]), sys.argv[3]
if mode == "nolease":
    ports.try_lease = lambda base, span: ports.Lease(base, span, [])
while not os.path.exists(go):
    time.sleep(0.0005)
print(sandbox.pick_base_port(rng=random.Random(seed)), flush=True)
sys.stdin.read()
"""


def choose_at_once(tmp_path: Path, n: int, seed: int, mode: str) -> list[int]:
    """Start `n` choosers, release them together, return their bases (while they hold them)."""
    go = tmp_path / f"go-{mode}-{seed}"
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    kids = [subprocess.Popen([sys.executable, "-c", CHOOSER, str(go), str(seed), mode],
                             stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, env=env)
            for _ in range(n)]
    try:
        time.sleep(1.0)  # every chooser imported and spinning on the start signal
        go.touch()
        bases = []
        for k in kids:
            assert k.stdout is not None
            bases.append(int(k.stdout.readline()))
        return bases
    finally:
        for k in kids:
            k.communicate(timeout=30)


def overlapping(bases: list[int]) -> bool:
    spans = sorted((b, b + SPAN) for b in bases)
    return any(nxt[0] < cur[1] for cur, nxt in itertools.pairwise(spans))


@pytest.mark.parametrize("seed", [1, 2, 3])
def test_sandboxes_choosing_at_the_same_instant_never_overlap(tmp_path: Path, seed: int) -> None:
    """Four processes choose at the same instant, all trying the same blocks first: four
    disjoint blocks. With the lease removed the same race hands them the same block."""
    assert not overlapping(choose_at_once(tmp_path, 4, seed, "lease"))
    assert overlapping(choose_at_once(tmp_path, 4, seed, "nolease"))


@pytest.fixture
def first_sandbox(tmp_path: Path) -> Iterator[tuple[int, socket.socket]]:
    """Sandbox A as a sandbox holds its block: the lease in a holder process (as `up()` hands
    it over) and a listener on each of its ports except the emulators', stopped for a lend."""
    lease = ports.lease_free_block(SPAN)
    pf = PidFile(tmp_path / "portlease.pidj")
    procs.spawn([sys.executable, "-m", "slurm_idle.testing.ports", "hold", str(lease.base)],
                tmp_path / "portlease.out", {**os.environ, "PYTHONPATH": str(ROOT)}, pf,
                pass_fds=lease.fds())
    lease.release()  # from now on only the holder keeps it, as in a running sandbox
    layout = sandboxconf.Layout(root=tmp_path, base_port=lease.base, slurm_version="22.05",
                                hostname="h", python=sys.executable)
    emulators = {layout.emulator_port(r.name) for r in sandboxconf.REPLICAS}
    listeners = []
    for port in range(lease.base, lease.base + SPAN):
        if port not in emulators:
            s = socket.socket()
            s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            s.bind(("127.0.0.1", port))
            s.listen()
            listeners.append(s)
    pid = pf.read()
    assert pid is not None
    try:
        yield lease.base, listeners[0]
    finally:
        for s in listeners:
            s.close()
        procs.terminate([pid], timeout_s=5)


def test_a_block_whose_emulator_is_stopped_is_not_handed_out(
        tmp_path: Path, first_sandbox: tuple[int, socket.socket]) -> None:
    """Sandbox A's emulators stopped as for a lend, its other ports bound: two choosers that
    try A's block first, at the same instant, get other blocks (A's bound ports alone would
    also keep them off: the next test takes those away); asked for A's block outright (a
    saved sandbox.json), the lease is refused, which without the lease it is not."""
    base_a, _ = first_sandbox
    seed = seed_trying_first(base_a)
    bases = choose_at_once(tmp_path, 2, seed, "lease")
    assert not overlapping([base_a, *bases]), (base_a, bases)
    assert ports.try_lease(base_a, SPAN) is None


def test_with_every_port_of_a_block_unbound_only_the_lease_keeps_it(tmp_path: Path) -> None:
    """A sandbox between its pick and its daemons' bind (or stopped for a lend with nothing
    else bound): the block looks free to a port check; the lease alone keeps it. Removed, the
    chooser is handed the same block."""
    lease = ports.lease_free_block(SPAN)
    try:
        seed = seed_trying_first(lease.base)
        assert choose_at_once(tmp_path, 1, seed, "lease") != [lease.base]
        assert choose_at_once(tmp_path, 1, seed, "nolease") == [lease.base]
    finally:
        lease.release()


def test_a_killed_holder_leaves_no_stale_lease(tmp_path: Path) -> None:
    """SIGKILL of a sandbox's lease holder frees its block at once: no stale lease."""
    lease = ports.lease_free_block(SPAN)
    pf = PidFile(tmp_path / "portlease.pidj")
    pid = procs.spawn([sys.executable, "-m", "slurm_idle.testing.ports", "hold", str(lease.base)],
                      tmp_path / "portlease.out", {**os.environ, "PYTHONPATH": str(ROOT)}, pf,
                      pass_fds=lease.fds())
    lease.release()
    assert ports.leased_by_anyone(lease.base, SPAN)
    os.kill(pid, signal.SIGKILL)
    procs.wait_for(lambda: not procs.alive(pid), 10.0, "the killed holder to go")
    assert not ports.leased_by_anyone(lease.base, SPAN)


def seed_trying_first(base: int) -> int:
    """A seed whose chooser tries the block at `base` first."""
    import random

    low, top, step = ports.block_range(SPAN)
    for seed in range(200_000):
        if random.Random(seed).randrange(low, top, step) == base:
            return seed
    raise AssertionError(f"no seed tries {base} first")
