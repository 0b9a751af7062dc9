"""Contract tests of the sandbox's GPUs: what its DCGM-named exporter reports is what holds them.

A process outside Slurm (`gpu-hold`), a running idle-partition job (the Prolog's holder) and
the emulators (weights awake, residue asleep) each show on their own node's GPUs only, in the
exporter and in Prometheus; an emulator cannot wake on a GPU another process holds.
"""

from __future__ import annotations

import json
import urllib.error
import urllib.parse
import urllib.request
from typing import Any

import pytest
from prometheus_client.parser import text_string_to_metric_families

from slurm_idle.testing import fakegpu, sandboxconf
from slurm_idle.testing.demo import reset_cluster
from slurm_idle.testing.sandbox import Sandbox
from slurm_idle.testing.waiting import poll

pytestmark = pytest.mark.sandbox
USED = "DCGM_FI_DEV_FB_USED"
WEIGHTS, RESIDUE = 70000, 1024  # the emulator's defaults

#: (GPU index, hpc_job or None) -> MiB used, of one node
Page = dict[tuple[str, str | None], float]


@pytest.fixture(autouse=True)
def clean_cluster(sandbox: Sandbox) -> None:
    """Every emulator up and awake, no job, no hold: what a module run before this one on the
    same sandbox left (a lent node's engine asleep, a job) would show on the GPUs too. Waited
    for in the exporter: a restarted emulator opens its GPUs a moment after it answers."""
    reset_cluster(sandbox)

    def clean() -> bool:
        return all(set(exporter(sandbox, n).values()) == ({0.0} if n == sandboxconf.JOBS_NODE
                                                          else {float(WEIGHTS)})
                   for n in sandboxconf.GPU_NODES)

    poll(clean, 30, "every emulator's weights on its GPUs, nothing else held", interval_s=0.5)


def _get(url: str) -> bytes:
    with urllib.request.urlopen(url, timeout=5) as r:
        return bytes(r.read())


def _post(url: str) -> tuple[int, bytes]:
    try:
        with urllib.request.urlopen(urllib.request.Request(url, data=b"", method="POST"),
                                    timeout=10) as r:
            return r.status, r.read()
    except urllib.error.HTTPError as e:
        return e.code, e.read()


def exporter(sb: Sandbox, node: str) -> Page:
    """FB_USED of `node` as its exporter says it now."""
    text = _get(f"http://127.0.0.1:{sb.layout.gpu_exporter_port(node)}/metrics").decode()
    return {(s.labels["gpu"], s.labels.get("hpc_job")): s.value
            for f in text_string_to_metric_families(text) for s in f.samples if s.name == USED}


def prometheus(sb: Sandbox, query: str) -> list[dict[str, Any]]:
    url = f"{sb.prometheus_url}/api/v1/query?" + urllib.parse.urlencode({"query": query})
    return list(json.loads(_get(url))["data"]["result"])


def prometheus_page(sb: Sandbox, node: str) -> Page:
    return {(r["metric"]["gpu"], r["metric"].get("hpc_job")): float(r["value"][1])
            for r in prometheus(sb, f'{USED}{{Hostname="{node}"}}')}


def test_every_node_has_a_series_per_gpu_in_prometheus(sandbox: Sandbox) -> None:
    """Prometheus has FB_USED and FB_FREE of every GPU of every node, gpu1-gpu8, labelled as
    dcgm-exporter labels them; a serving emulator's GPUs hold its weights, gpu8's nothing."""
    def counts() -> dict[str, dict[str, int]] | None:
        got = {name: {r["metric"]["Hostname"]: int(r["value"][1])
                      for r in prometheus(sandbox, f"count by (Hostname) ({name})")}
               for name in (USED, "DCGM_FI_DEV_FB_FREE")}
        return got if all(len(c) == len(sandboxconf.GPU_NODES) for c in got.values()) else None

    got = poll(counts, 30, "GPU series of every node", interval_s=1)
    expect = {n: sandboxconf.node_gpus(n) for n in sandboxconf.GPU_NODES}
    assert got == {USED: expect, "DCGM_FI_DEV_FB_FREE": expect}
    (one,) = prometheus(sandbox, f'{USED}{{Hostname="gpu1",gpu="0"}}')
    assert {"UUID", "device", "modelName", "job", "instance"} <= set(one["metric"])
    assert exporter(sandbox, "gpu1") == {(str(i), None): WEIGHTS for i in range(4)}
    assert exporter(sandbox, "gpu7") == {(str(i), None): WEIGHTS for i in range(8)}  # gpu6-0's
    assert exporter(sandbox, "gpu8") == {(str(i), None): 0 for i in range(8)}


def test_a_hold_outside_slurm_shows_on_its_gpu_only(sandbox: Sandbox) -> None:
    """`gpu_hold(gpu2, 1)` raises FB_USED of gpu2's GPU 1 by its MiB, with no hpc_job, in
    Prometheus too; no other GPU of any node moves; gpu_release takes it back."""
    before = {n: exporter(sandbox, n) for n in sandboxconf.GPU_NODES}
    sandbox.gpu_hold("gpu2", 1, mib=5000)
    try:
        expect = {**before["gpu2"], ("1", None): WEIGHTS + 5000}
        poll(lambda: prometheus_page(sandbox, "gpu2") == expect, 15,
             "gpu2's GPU 1 raised in Prometheus", interval_s=0.5)
        assert {n: exporter(sandbox, n) for n in sandboxconf.GPU_NODES} == {
            **before, "gpu2": expect}
    finally:
        assert sandbox.gpu_release("gpu2") == ["gpuhold-gpu2-1"]
    poll(lambda: exporter(sandbox, "gpu2") == before["gpu2"], 5, "gpu2 back")


def test_a_running_idle_job_holds_its_gpus_until_it_ends(sandbox: Sandbox) -> None:
    """An idle-partition job's GPUs hold JOB_HOLD_MIB each, labelled hpc_job = its id, while it
    runs (the Prolog's holder); its end frees them (the Epilog)."""
    sandbox.jobs_node(True)  # gpu8: no engine of its own, so the job's MiB read plainly
    job = ""
    try:
        r = sandbox.run(["sbatch", "--parsable", "-p", "idle", "-w", "gpu8", "--gres=gpu:2",
                         "-o", "/dev/null", "--wrap", "sleep 300"])
        assert r.returncode == 0, r.stderr
        job = r.stdout.strip().split(";")[0]
        held = {(str(i), job): float(sandboxconf.JOB_HOLD_MIB) for i in (0, 1)}
        expect = {**held, **{(str(i), None): 0.0 for i in range(2, 8)}}
        poll(lambda: exporter(sandbox, "gpu8") == expect, 30, f"job {job}'s GPUs held")
        poll(lambda: prometheus_page(sandbox, "gpu8") == expect, 15, "the same in Prometheus")
        assert sandbox.run(["scancel", job]).returncode == 0
        poll(lambda: exporter(sandbox, "gpu8") == {(str(i), None): 0 for i in range(8)}, 30,
             f"job {job}'s GPUs freed")
    finally:
        if job:
            sandbox.run(["scancel", job])
        sandbox.jobs_node(False)


def test_an_emulator_holds_weights_awake_residue_asleep_and_cannot_wake_on_a_held_gpu(
        sandbox: Sandbox) -> None:
    """gpu4's emulator holds its weights awake and its residue asleep; while 20000 MiB of its
    GPU 3 are held outside Slurm, /wake_up answers 500 with vLLM's CUDA error and it sleeps on;
    released, it wakes and holds its weights again."""
    url = sandbox.emulator_url("gpu4")
    awake = {(str(i), None): WEIGHTS for i in range(4)}
    try:
        assert _post(f"{url}/sleep?level=1")[0] == 200
        poll(lambda: exporter(sandbox, "gpu4") == {(str(i), None): RESIDUE for i in range(4)},
             5, "gpu4 holding its residue")
        sandbox.gpu_hold("gpu4", 3, mib=20000)
        code, body = _post(f"{url}/wake_up")
        assert code == 500, body
        assert json.loads(body)["error"] == {
            "message": f"Call to wake_up method failed: {fakegpu.CUDA_OOM}",
            "type": "InternalServerError", "param": None, "code": 500}
        assert json.loads(_get(f"{url}/is_sleeping")) == {"is_sleeping": True}
        sandbox.gpu_release("gpu4")
        assert _post(f"{url}/wake_up")[0] == 200
        poll(lambda: exporter(sandbox, "gpu4") == awake, 5, "gpu4 holding its weights")
    finally:
        sandbox.gpu_release("gpu4")
        _post(f"{url}/wake_up")
