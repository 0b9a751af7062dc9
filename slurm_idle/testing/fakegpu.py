"""The sandbox's fake GPUs: a device file per GPU per node, held open by whoever "uses" it.

On a real node a GPU's memory is held by the processes that have its device file open (a CUDA
context, a model's weights, a leftover container). The sandbox keeps that shape so that what
the GPU exporter (gpu_exporter.py) reports is found, not declared: node N's GPU i is the
character device `{dev}/N/nvidiaI`, and a process holds it while it has that file open. How
many MiB it holds there is what it wrote in `{dev}/N/held/{pid}.json`
(`{"pid": P, "job": "123" or null, "mib": {"0": 20000}}`); a process with the file open and no
record holds a bare CUDA context (CONTEXT_MIB), and a record without an open file counts for
nothing (a holder killed before it could remove it).

The device nodes have no driver behind them (open(2) fails with ENXIO), so a holder opens them
with O_PATH: the descriptor shows in /proc/PID/fd like any other, and nothing else is needed.
Descriptors are close-on-exec, so a holder's children hold nothing.

CLI (the sandbox's Prolog and `scripts/sandbox gpu-hold` run it):
    python -m slurm_idle.testing.fakegpu hold (--gpu-device PATH ... | --gpu-dir D --gpus 0,1)
        [--mib N] [--job ID] [--pidfile F] [--detach]   hold until SIGTERM, then let go
    python -m slurm_idle.testing.fakegpu release --pidfile F    end that holder, wait for it
    python -m slurm_idle.testing.fakegpu nvidia-smi --dev D [--node N] --query-gpu=index,memory.used
        --format=csv,noheader,nounits [-i 0,1]   nvidia-smi's answer for node N's GPUs (default:
        $SLURMD_NODENAME, the node a job step runs on), from the same scan the exporter makes
"""

from __future__ import annotations

import argparse
import json
import os
import re
import signal
import sys
import threading
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Protocol

#: What one fake GPU has: an H100 80GB HBM3's framebuffer as nvidia-smi and DCGM report it.
TOTAL_MIB = 81559
MODEL_NAME = "NVIDIA H100 80GB HBM3"
#: What an open device without a record holds: a CUDA context and little else.
CONTEXT_MIB = 500
#: What `hold` takes per GPU unless told (a leftover container's worth).
DEFAULT_HOLD_MIB = 20000
_DEVICE = re.compile(r"nvidia(\d+)")


def device_path(node_dir: Path, index: int) -> Path:
    return node_dir / f"nvidia{index}"


def gpu_of(device: Path | str) -> tuple[str, int]:
    """`{dev}/gpu2/nvidia3` -> ("gpu2", 3); ValueError for a path that is no fake GPU."""
    path = Path(device)
    m = _DEVICE.fullmatch(path.name)
    if m is None:
        raise ValueError(f"{device} is not a fake GPU device (NODE/nvidiaN)")
    return path.parent.name, int(m.group(1))


def held_dir(node_dir: Path) -> Path:
    return node_dir / "held"


def node_indexes(node_dir: Path) -> list[int]:
    """The GPU indexes of a node: its device files, in order."""
    found = []
    try:
        for p in node_dir.iterdir():
            m = _DEVICE.fullmatch(p.name)
            if m:
                found.append(int(m.group(1)))
    except OSError:
        return []
    return sorted(found)


def parse_indexes(text: str) -> list[int]:
    """'0,1,2' (SLURM_JOB_GPUS) or '0-3' or '4-7,9' -> [0, 1, ...]; '' -> []."""
    out: list[int] = []
    for part in (p.strip() for p in text.split(",")):
        if not part:
            continue
        first, _, last = part.partition("-")
        if not first.isdigit() or (last and not last.isdigit()):
            raise ValueError(f"not a GPU index list: {text!r} (e.g. 0,1 or 0-3)")
        out += range(int(first), int(last or first) + 1)
    return out


class ProcReader(Protocol):
    """What the scan reads of /proc (injected: tests give a table instead)."""

    def pids(self) -> Iterable[int]: ...

    def fd_targets(self, pid: int) -> list[str]: ...

    def environ(self, pid: int) -> Mapping[str, str]: ...


class LiveProc:
    """This machine's /proc."""

    def pids(self) -> Iterable[int]:
        return [int(d) for d in os.listdir("/proc") if d.isdigit()]

    def fd_targets(self, pid: int) -> list[str]:
        out = []
        try:
            fds = os.listdir(f"/proc/{pid}/fd")
        except OSError:
            return []
        for fd in fds:
            try:
                out.append(os.readlink(f"/proc/{pid}/fd/{fd}"))
            except OSError:
                continue
        return out

    def environ(self, pid: int) -> Mapping[str, str]:
        try:
            raw = Path(f"/proc/{pid}/environ").read_bytes()
        except OSError:
            return {}
        pairs = (item.partition(b"=") for item in raw.split(b"\0"))
        return {k.decode(errors="replace"): v.decode(errors="replace") for k, sep, v in pairs if sep}


@dataclass(frozen=True)
class Holding:
    """One process holding one GPU of one node."""

    node: str
    index: int
    pid: int
    mib: int
    job: str | None  # its Slurm job, when it runs in (or for) one


def read_record(node_dir: Path, pid: int) -> dict[str, object]:
    try:
        doc = json.loads((held_dir(node_dir) / f"{pid}.json").read_text())
    except (OSError, ValueError):
        return {}
    return doc if isinstance(doc, dict) else {}


def scan(dev: Path, proc: ProcReader | None = None) -> list[Holding]:
    """Every (node, GPU, process) under `dev` where a process has the device file open, with
    the MiB its record gives (CONTEXT_MIB without one) and its job: the record's, else the
    SLURM_JOB_ID of its environment."""
    proc = proc or LiveProc()
    prefix = str(dev.resolve()) + "/"
    out = []
    for pid in proc.pids():
        held: dict[str, set[int]] = {}
        for target in proc.fd_targets(pid):
            if target.startswith(prefix) and target.count("/", len(prefix)) == 1:
                try:
                    node, index = gpu_of(target)
                except ValueError:
                    continue
                held.setdefault(node, set()).add(index)
        for node, indexes in sorted(held.items()):
            record = read_record(dev / node, pid)
            raw_mib = record.get("mib")
            mib = raw_mib if isinstance(raw_mib, dict) else {}
            job = record.get("job") or proc.environ(pid).get("SLURM_JOB_ID") or None
            for index in sorted(indexes):
                out.append(Holding(node, index, pid, int(mib.get(str(index), CONTEXT_MIB)),
                                   str(job) if job else None))
    return out


def used_by_others(dev: Path, devices: Sequence[Path], pid: int,
                   proc: ProcReader | None = None) -> dict[Path, int]:
    """MiB that processes other than `pid` hold on each of `devices`."""
    want = {gpu_of(d): d for d in devices}
    used = dict.fromkeys(devices, 0)
    for h in scan(dev, proc):
        d = want.get((h.node, h.index))
        if d is not None and h.pid != pid:
            used[d] += h.mib
    return used


#: What vLLM's memory pool says when a GPU cannot take what it maps (vLLM #13941; a wake_up
#: answers it as "Call to wake_up method failed: " + this).
CUDA_OOM = "CUDA Error: out of memory at /workspace/csrc/cumem_allocator.cpp:62"


def crowded(dev: Path, devices: Sequence[Path], need_mib: int, pid: int,
            proc: ProcReader | None = None) -> list[str]:
    """The devices where `need_mib` more does not fit beside what processes other than `pid`
    hold, each said as "gpu2/nvidia0: 20000 MiB held by others" ([] when all fit)."""
    return [f"{d.parent.name}/{d.name}: {used} MiB held by others"
            for d, used in used_by_others(dev, devices, pid, proc).items()
            if used + need_mib > TOTAL_MIB]


class Holder:
    """This process holding `devices` (paths `{dev}/{node}/nvidiaI`) with `mib` on each."""

    def __init__(self, devices: Sequence[Path], mib: int, job: str | None = None) -> None:
        self.devices = list(devices)
        self.job = job
        self.mib = mib
        self._fds = [os.open(d, os.O_PATH | os.O_CLOEXEC) for d in self.devices]
        self._write()

    def _by_node(self) -> dict[Path, list[int]]:
        nodes: dict[Path, list[int]] = {}
        for d in self.devices:
            nodes.setdefault(d.parent, []).append(gpu_of(d)[1])
        return nodes

    def _write(self) -> None:
        for node_dir, indexes in self._by_node().items():
            held_dir(node_dir).mkdir(exist_ok=True)
            path = held_dir(node_dir) / f"{os.getpid()}.json"
            tmp = path.with_suffix(".tmp")
            tmp.write_text(json.dumps({"pid": os.getpid(), "job": self.job,
                                       "mib": {str(i): self.mib for i in indexes}}))
            tmp.replace(path)

    def set_mib(self, mib: int) -> None:
        """Hold `mib` on each device from now on (an engine going to sleep or waking)."""
        self.mib = mib
        if self._fds:
            self._write()

    def close(self) -> None:
        """Let go: the record first, then the devices."""
        for node_dir in self._by_node():
            (held_dir(node_dir) / f"{os.getpid()}.json").unlink(missing_ok=True)
        for fd in self._fds:
            os.close(fd)
        self._fds = []


def add_device_args(p: argparse.ArgumentParser) -> None:
    """The flags naming a process's fake GPUs (fakegpu hold, the emulator)."""
    p.add_argument("--gpu-device", type=Path, action="append", default=[], metavar="PATH",
                   help="a fake GPU's device file to hold ({dev}/NODE/nvidiaI); repeatable")
    p.add_argument("--gpu-dir", type=Path, default=None, metavar="DIR",
                   help="a node's fake GPU directory ({dev}/NODE), with --gpus")
    p.add_argument("--gpus", default=None, metavar="LIST",
                   help="GPU indexes in --gpu-dir (0,1 as SLURM_JOB_GPUS, or 0-3; default: "
                   "all of them; '' none)")


def devices_from_args(args: argparse.Namespace) -> list[Path]:
    devices = list(args.gpu_device)
    if args.gpu_dir is not None:
        indexes = node_indexes(args.gpu_dir) if args.gpus is None else parse_indexes(args.gpus)
        devices += [device_path(args.gpu_dir, i) for i in indexes]
    return devices


def _hold(args: argparse.Namespace) -> int:
    from slurm_idle.testing.procs import PidFile

    devices = devices_from_args(args)
    if not devices:
        print("fakegpu: no GPU to hold", file=sys.stderr)
        return 0
    ready = _detach() if args.detach else None
    stop = threading.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda *_: stop.set())
    holder = Holder(devices, args.mib, args.job)
    if args.pidfile is not None:  # last: a pid file means the holding shows
        PidFile(args.pidfile).write(os.getpid())
    if ready is not None:
        os.write(ready, b"1")
        os.close(ready)
    try:
        stop.wait()
    finally:
        holder.close()
        if args.pidfile is not None:
            PidFile(args.pidfile).clear()
    return 0


def _detach() -> int:
    """Go on in a child of a session of its own (a Prolog's caller neither waits for it nor
    kills its process group); this process exits once the child says it holds: 0, or 1 when
    the child died first. Returns, in the child, the pipe to say it on."""
    r, w = os.pipe()
    if os.fork() > 0:
        os.close(w)
        with os.fdopen(r, "rb") as said:
            os._exit(0 if said.read(1) == b"1" else 1)
    os.close(r)
    os.setsid()
    return w


def _release(args: argparse.Namespace) -> int:
    from slurm_idle.testing.procs import PidFile, terminate

    pf = PidFile(args.pidfile)
    pid = pf.read()
    if pid is not None:
        terminate([pid], timeout_s=5)
    pf.clear()
    return 0


#: nvidia-smi --query-gpu fields the fake answers, with their header.
_HEADERS = {"index": "index", "memory.used": "memory.used [MiB]",
            "memory.total": "memory.total [MiB]", "name": "name"}


def _value(field: str, index: int, used_mib: int, units: bool) -> str:
    mib = {"memory.used": used_mib, "memory.total": TOTAL_MIB}.get(field)
    if mib is not None:
        return f"{mib} MiB" if units else str(mib)
    return str(index) if field == "index" else MODEL_NAME


def nvidia_smi(dev: Path, node: str, fields: Sequence[str], indexes: Sequence[int] | None,
               fmt: Sequence[str], proc: ProcReader | None = None) -> tuple[str, int]:
    """(stdout, exit code) of `nvidia-smi --query-gpu=FIELDS --format=csv[,noheader][,nounits]
    [-i INDEXES]` on `node`: every process's MiB on each GPU summed, as the exporter does."""
    known = node_indexes(dev / node)
    unknown = [f for f in fields if f not in _HEADERS]
    if unknown or "csv" not in fmt:
        return f"Field \"{(unknown or ['format'])[0]}\" is not a valid field to query.\n", 2
    wanted = known if indexes is None else list(indexes)
    if not known or any(i not in known for i in wanted):
        return "No devices were found\n", 6
    used = dict.fromkeys(known, 0)
    for h in scan(dev, proc):
        if h.node == node:
            used[h.index] = used.get(h.index, 0) + h.mib
    units = "nounits" not in fmt
    lines = [] if "noheader" in fmt else [", ".join(_HEADERS[f] for f in fields)]
    lines += [", ".join(_value(f, i, used[i], units) for f in fields) for i in wanted]
    return "".join(f"{line}\n" for line in lines), 0


def _nvidia_smi(args: argparse.Namespace) -> int:
    node = args.node or os.environ.get("SLURMD_NODENAME", "")
    if not node:
        print("fake nvidia-smi: no node (--node, or SLURMD_NODENAME in a job)", file=sys.stderr)
        return 9
    indexes = None if args.id is None else parse_indexes(args.id)
    out, rc = nvidia_smi(args.dev, node, args.query_gpu.split(","), indexes, args.format.split(","))
    (sys.stdout if rc == 0 else sys.stderr).write(out)
    return rc


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m slurm_idle.testing.fakegpu",
                                description=(__doc__ or "").splitlines()[0])
    sub = p.add_subparsers(dest="cmd", required=True)
    h = sub.add_parser("hold", help="hold fake GPUs until SIGTERM")
    add_device_args(h)
    h.add_argument("--mib", type=int, default=DEFAULT_HOLD_MIB, help="MiB held on each GPU")
    h.add_argument("--job", default=None, help="the Slurm job it holds them for")
    h.add_argument("--pidfile", type=Path, default=None,
                   help="written once the GPUs are held, removed when let go")
    h.add_argument("--detach", action="store_true",
                   help="hold from a process of a session of its own; return once it holds")
    r = sub.add_parser("release", help="end the holder of a pid file and wait for it")
    r.add_argument("--pidfile", type=Path, required=True)
    n = sub.add_parser("nvidia-smi", help="answer nvidia-smi --query-gpu for a node's fake GPUs")
    n.add_argument("--dev", type=Path, required=True, help="the sandbox's fake GPU directory")
    n.add_argument("--node", default=None, help="the node (default: $SLURMD_NODENAME)")
    n.add_argument("--query-gpu", required=True, help="index,memory.used,memory.total,name")
    n.add_argument("--format", default="csv", help="csv[,noheader][,nounits]")
    n.add_argument("-i", "--id", default=None, help="GPU indexes, e.g. 0,1")
    args = p.parse_args(argv)
    run = {"hold": _hold, "release": _release, "nvidia-smi": _nvidia_smi}[args.cmd]
    return run(args)


if __name__ == "__main__":
    sys.exit(main())
