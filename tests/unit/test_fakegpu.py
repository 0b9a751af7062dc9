"""The sandbox's fake GPUs: holding a device file is holding the GPU; the Prolog's holder."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import pytest

import slurm_idle
from slurm_idle.testing import fakegpu, procs, sandboxconf
from slurm_idle.testing.emulator import Emulator, GpuMemory
from slurm_idle.testing.emulator_http import serve_in_thread
from slurm_idle.testing.engine_model import EngineModel
from slurm_idle.testing.fakegpu import Holder, Holding
from slurm_idle.testing.sandboxconf import Layout

REPO = str(Path(slurm_idle.__file__).resolve().parents[1])


def node(dev: Path, name: str = "gpu2", gpus: int = 4) -> Path:
    """A node's fake GPUs as plain files (a holder opens them with O_PATH, as the devices)."""
    d = dev / name
    d.mkdir(parents=True)
    for i in range(gpus):
        fakegpu.device_path(d, i).touch()
    return d


def mine(dev: Path) -> list[Holding]:
    return [h for h in fakegpu.scan(dev) if h.pid == os.getpid()]


@pytest.fixture(autouse=True)
def _no_holder_left() -> Iterator[None]:
    """Every holder a test started ends with it, the test passing or not."""
    yield
    for p in _started:
        p.kill()
        p.wait(5)
    _started.clear()


_started: list[subprocess.Popen[bytes]] = []


def hold_process(tmp_path: Path, *args: str) -> tuple[subprocess.Popen[bytes], procs.PidFile]:
    """`fakegpu hold ARGS` in a process of its own, returned once it holds (ended after the
    test at the latest)."""
    pf = procs.PidFile(tmp_path / f"hold-{len(list(tmp_path.glob('hold-*')))}.pidj")
    p = subprocess.Popen([sys.executable, "-m", "slurm_idle.testing.fakegpu", "hold", *args,
                          f"--pidfile={pf.path}"], env={**os.environ, "PYTHONPATH": REPO})
    _started.append(p)
    deadline = time.monotonic() + 20
    while pf.read() is None:
        assert p.poll() is None and time.monotonic() < deadline, "fakegpu hold did not hold"
        time.sleep(0.05)
    return p, pf


def test_parse_indexes() -> None:
    """SLURM_JOB_GPUS' lists and the sandbox's ranges; nonsense is refused."""
    assert fakegpu.parse_indexes("0,1,3") == [0, 1, 3]
    assert fakegpu.parse_indexes("4-7") == [4, 5, 6, 7]
    assert fakegpu.parse_indexes("") == []
    with pytest.raises(ValueError):
        fakegpu.parse_indexes("gpu0")


def test_a_holder_shows_while_it_holds_and_not_after(tmp_path: Path) -> None:
    """A Holder's MiB show in the scan of this very process (its open files, its record), change
    with set_mib, and are gone, record and all, after close."""
    dev = tmp_path / "dev"
    d = node(dev)
    holder = Holder([fakegpu.device_path(d, 1), fakegpu.device_path(d, 2)], 70000, job="4")
    try:
        assert mine(dev) == [Holding("gpu2", 1, os.getpid(), 70000, "4"),
                             Holding("gpu2", 2, os.getpid(), 70000, "4")]
        holder.set_mib(1024)
        assert {h.mib for h in mine(dev)} == {1024}
    finally:
        holder.close()
    assert mine(dev) == [] and list(fakegpu.held_dir(d).iterdir()) == []


def test_hold_and_release_commands(tmp_path: Path) -> None:
    """`hold` holds from its own process until `release` ends it and removes its pid file;
    its children inherit nothing (close-on-exec)."""
    dev = tmp_path / "dev"
    d = node(dev)
    p, pf = hold_process(tmp_path, f"--gpu-dir={d}", "--gpus=0,3", "--mib=5000")
    assert sorted((h.index, h.mib, h.pid) for h in fakegpu.scan(dev)) == [
        (0, 5000, p.pid), (3, 5000, p.pid)]
    fd_dir = f"/proc/{p.pid}/fd"
    assert not any(os.readlink(f"{fd_dir}/{fd}").endswith("held") for fd in os.listdir(fd_dir))
    subprocess.run([sys.executable, "-m", "slurm_idle.testing.fakegpu", "release",
                    f"--pidfile={pf.path}"], env={**os.environ, "PYTHONPATH": REPO}, check=True)
    assert p.wait(5) == 0 and not pf.path.exists() and fakegpu.scan(dev) == []


def test_fake_nvidia_smi_answers_for_its_node_from_the_scan(tmp_path: Path) -> None:
    """`fakegpu nvidia-smi` answers the replica job script's query for the node it runs on
    (SLURMD_NODENAME): each GPU asked for, with what every holder there holds; another
    node's holds and GPUs not asked for are not in it; an unknown GPU fails as nvidia-smi."""
    dev = tmp_path / "dev"
    d = node(dev)
    node(dev, "gpu3")
    holder = Holder([fakegpu.device_path(d, 1)], 20000)
    other = Holder([fakegpu.device_path(dev / "gpu3", 2)], 30000)
    try:
        query = ["nvidia-smi", f"--dev={dev}", "--query-gpu=index,memory.used",
                 "--format=csv,noheader,nounits", "-i", "1,2"]
        env = {**os.environ, "PYTHONPATH": REPO, "SLURMD_NODENAME": "gpu2"}
        out = subprocess.run([sys.executable, "-m", "slurm_idle.testing.fakegpu", *query],
                             env=env, capture_output=True, text=True, check=True).stdout
        assert out == "1, 20000\n2, 0\n"
        full = fakegpu.nvidia_smi(dev, "gpu3", ["index", "memory.used"], None, ["csv"])
        assert full == ("index, memory.used [MiB]\n0, 0 MiB\n1, 0 MiB\n2, 30000 MiB\n3, 0 MiB\n", 0)
        assert fakegpu.nvidia_smi(dev, "gpu2", ["index"], [7], ["csv"])[1] == 6
    finally:
        holder.close()
        other.close()


def test_others_crowd_a_gpu_only_beyond_its_total(tmp_path: Path) -> None:
    """crowded(): what other processes hold plus what is asked must fit the GPU's total."""
    dev = tmp_path / "dev"
    d = node(dev)
    p, _ = hold_process(tmp_path, f"--gpu-dir={d}", "--gpus=0", "--mib=20000")
    try:
        devices = [fakegpu.device_path(d, 0), fakegpu.device_path(d, 1)]
        assert fakegpu.crowded(dev, devices, 70000, os.getpid()) == [
            "gpu2/nvidia0: 20000 MiB held by others"]
        assert fakegpu.crowded(dev, devices, fakegpu.TOTAL_MIB - 20000, os.getpid()) == []
        assert fakegpu.crowded(dev, devices, 70000, p.pid) == []  # its own MiB never count
    finally:
        p.terminate()
        p.wait(5)


def _post(url: str) -> tuple[int, bytes]:
    try:
        with urllib.request.urlopen(urllib.request.Request(url, data=b"", method="POST"),
                                    timeout=10) as r:
            return r.status, r.read()
    except urllib.error.HTTPError as e:
        return e.code, e.read()


def test_the_emulator_holds_weights_awake_residue_asleep_and_cannot_wake_on_a_held_gpu(
        tmp_path: Path) -> None:
    """Awake it holds its weights, asleep its residue; while another process holds 20000 MiB of
    one of its GPUs, /wake_up answers 500 with vLLM's error and it stays asleep; once that
    process is gone it wakes."""
    dev = tmp_path / "dev"
    d = node(dev)
    emu = Emulator(EngineModel("m"), "gpu2", None, None)
    emu.gpus = GpuMemory([fakegpu.device_path(d, i) for i in range(4)], 70000, 1024, True)
    emu.gpus.take()
    port, stop = serve_in_thread(emu)
    url = f"http://127.0.0.1:{port}"
    try:
        assert {h.mib for h in mine(dev)} == {70000} and len(mine(dev)) == 4
        assert _post(f"{url}/sleep?level=1")[0] == 200
        assert {h.mib for h in mine(dev)} == {1024}
        p, _ = hold_process(tmp_path, f"--gpu-dir={d}", "--gpus=2", "--mib=20000")
        code, body = _post(f"{url}/wake_up")
        assert (code, json.loads(body)) == (500, {"error": {
            "message": "Call to wake_up method failed: " + fakegpu.CUDA_OOM,
            "type": "InternalServerError", "param": None, "code": 500}})
        assert not emu.model.awake and {h.mib for h in mine(dev)} == {1024}
        p.terminate()
        p.wait(5)
        assert _post(f"{url}/wake_up")[0] == 200
        assert emu.model.awake and {h.mib for h in mine(dev)} == {70000}
    finally:
        stop()
        emu.gpus.release()


def test_the_emulator_does_not_start_on_a_held_gpu(tmp_path: Path) -> None:
    """A cold start whose weights do not fit beside another holder exits 1 with the CUDA error,
    never listening."""
    dev = tmp_path / "dev"
    d = node(dev)
    p, _ = hold_process(tmp_path, f"--gpu-dir={d}", "--gpus=1", "--mib=20000")
    try:
        r = subprocess.run([sys.executable, "-m", "slurm_idle.testing.emulator", "--port", "0",
                            f"--gpu-dir={d}", "--gpus=0-3"], capture_output=True, text=True,
                           env={**os.environ, "PYTHONPATH": REPO}, timeout=30, check=False)
    finally:
        p.terminate()
        p.wait(5)
    assert r.returncode == 1 and fakegpu.CUDA_OOM in r.stderr and "listening" not in r.stdout
    assert "gpu2/nvidia1: 20000 MiB held by others" in r.stderr


def _run_script(text: str, tmp_path: Path, env: dict[str, str]) -> subprocess.CompletedProcess[str]:
    script = tmp_path / "script.sh"
    script.write_text(text)
    script.chmod(0o755)
    return subprocess.run([str(script)], env={"PATH": os.environ["PATH"], **env},
                          capture_output=True, text=True, timeout=30, check=False)


def test_prolog_holds_a_jobs_gpus_until_the_epilog(tmp_path: Path) -> None:
    """The Prolog leaves a holder of the job's GPUs (JOB_HOLD_MIB each, its job id) running
    after it exits 0; the Epilog ends it; a serve-partition job is left to its emulator."""
    lay = Layout(root=tmp_path, base_port=30000, slurm_version="22.05.8", hostname="vm",
                 python=sys.executable, pythonpath=REPO)
    lay.run.mkdir()
    lay.log.mkdir()
    node(lay.dev, "gpu3")
    env = {"SLURM_JOB_ID": "41", "SLURMD_NODENAME": "gpu3", "SLURM_JOB_GPUS": "1,2",
           "SLURM_JOB_PARTITION": "idle"}
    assert _run_script(sandboxconf.prolog_sh(lay), tmp_path, env).returncode == 0
    try:
        assert sorted((h.index, h.mib, h.job) for h in fakegpu.scan(lay.dev)) == [
            (1, sandboxconf.JOB_HOLD_MIB, "41"), (2, sandboxconf.JOB_HOLD_MIB, "41")]
    finally:
        assert _run_script(sandboxconf.epilog_sh(lay), tmp_path, env).returncode == 0
    assert fakegpu.scan(lay.dev) == []
    assert list(lay.run.iterdir()) == []
    serve = {**env, "SLURM_JOB_PARTITION": sandboxconf.JOBS_PARTITION}
    try:
        assert _run_script(sandboxconf.prolog_sh(lay), tmp_path, serve).returncode == 0
        assert fakegpu.scan(lay.dev) == [] and list(lay.run.iterdir()) == []
    finally:
        _run_script(sandboxconf.epilog_sh(lay), tmp_path, serve)


def test_a_failing_prolog_still_exits_0(tmp_path: Path) -> None:
    """A Prolog whose holder cannot start (no python there) exits 0 anyway: a failing Prolog
    drains the node."""
    lay = Layout(root=tmp_path, base_port=30000, slurm_version="22.05.8", hostname="vm",
                 python=str(tmp_path / "no-python"), pythonpath=REPO)
    lay.log.mkdir()
    env = {"SLURM_JOB_ID": "1", "SLURMD_NODENAME": "gpu1", "SLURM_JOB_GPUS": "0",
           "SLURM_JOB_PARTITION": "idle"}
    assert _run_script(sandboxconf.prolog_sh(lay), tmp_path, env).returncode == 0
    assert _run_script(sandboxconf.epilog_sh(lay), tmp_path, env).returncode == 0
