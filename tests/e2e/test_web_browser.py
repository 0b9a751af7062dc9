"""`slurm-idle web` in a real headless Chromium (Debian's /usr/bin/chromium + chromedriver).

With the sandbox up and gpu1 lent: the pool view shows every node and its phase, the jobs
view shows a running demo job and a pipeline's DAG; `slurm-idle reclaim gpu1` then shows
the job requeued with preemptions 1, failures 0, in the page and in /api/jobs. Both pages fit
a 1280 px viewport with no cell overflowing (the live pages, after the made-up ones of
test_web_layout.py). Screenshots
go to the test's tmp_path. The layout at 1280 px, times, who sees what and the README's
screenshots: test_web_layout.py, over made-up data.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import yaml

from slurm_idle.config import load_config
from slurm_idle.testing import browser as br
from slurm_idle.testing.demo import DEMO_SPEC, reset_cluster
from slurm_idle.testing.images import BUSYBOX_IMAGE
from slurm_idle.testing.waiting import poll

pytestmark = pytest.mark.sandbox


def free_port() -> int:
    """A port for this test's own server, leased (ports.free_port): an ephemeral port found
    free could be taken by an outgoing connection before the server binds it."""
    from slurm_idle.testing import ports

    return ports.free_port()


def cli(sb: Any, env: dict[str, str], *args: str) -> Any:
    proc = sb.run([sys.executable, "-m", "slurm_idle.cli", *args], env=env, timeout=180)
    assert proc.returncode == 0, (args, proc.stderr)
    return proc


@pytest.fixture
def browser(tmp_path: Path) -> Iterator[Any]:
    if reason := br.missing():
        pytest.skip(reason)
    with br.chromium(tmp_path / "chromium") as driver:
        yield driver


@pytest.fixture
def web(sandbox: Any, tmp_path: Path) -> Iterator[tuple[str, dict[str, str]]]:
    env = {"SLURM_IDLE_STATE_DIR": str(tmp_path / "state")}
    port = free_port()
    proc = subprocess.Popen(
        [sys.executable, "-m", "slurm_idle.cli", "web", "--port", str(port), "--cache-s", "0"],
        env={**os.environ, **sandbox.env(), **env}, stdout=subprocess.DEVNULL,
        stderr=open(tmp_path / "web.log", "wb"),  # noqa: SIM115 - closed with the process
    )
    url = f"http://127.0.0.1:{port}"

    def up() -> bool:
        try:
            with urllib.request.urlopen(f"{url}/healthz", timeout=2) as r:
                return bool(r.status == 200)
        except OSError:
            return False

    try:
        poll(up, 30, "slurm-idle web answering")
        yield url, env
    finally:
        proc.terminate()
        proc.wait(10)


def fits_1280(browser: Any, url: str) -> list[str]:
    """What overflows the page at `url` at a 1280 px viewport (the live pages, real data)."""
    br.set_viewport(browser, 1280, 1100)
    try:
        browser.get(url)
        width, found = br.overflows(browser)
        assert width == 1280
        return found
    finally:
        browser.execute_cdp_cmd("Emulation.clearDeviceMetricsOverride", {})


def get_json(url: str) -> Any:
    with urllib.request.urlopen(url, timeout=60) as r:
        return json.loads(r.read())


@pytest.mark.slow
def test_pool_jobs_and_a_reclaim_in_the_browser(
    sandbox: Any, web: tuple[str, dict[str, str]], browser: Any, tmp_path: Path
) -> None:
    """Pool view: gpu1 lent, the others serving. Jobs view: the demo job RUNNING, the
    pipeline's DAG drawn. After a reclaim: the job requeued, preemptions 1, failures 0."""
    from selenium.webdriver.common.by import By

    url, env = web
    sb = sandbox
    reset_cluster(sb, load_config(sb.config_path).paths.journal)
    subprocess.run([sys.executable, "-m", "slurm_idle.testing.images"], env=sb.env(),
                   check=True, capture_output=True)
    cli(sb, env, "tick")
    for node in ("gpu2", "gpu3", "gpu4"):
        cli(sb, env, "pin", node)
    # The job must run on gpu1 (the node the reclaim takes back), not on the 8-GPU topology
    # nodes, plain idle nodes outside this config's pool: on 24.11 it ran to completion on gpu5
    # (sacct), their higher Weight notwithstanding. Closed for the test, as in test_reclaim_cli.
    closed = ",".join(getattr(sb, "all_nodes", sb.nodes)[len(sb.nodes):])
    if closed:
        sb.run(["scontrol", "update", f"nodename={closed}", "state=DRAIN",
                "reason=test_web_browser: the job stays on gpu1"])
    cli(sb, env, "lend", "gpu1")
    spec = yaml.safe_load(DEMO_SPEC.read_text())
    spec["params"]["steps"] = 60
    spec["log"] = str(tmp_path / "demo-%j.out")
    spec["mounts"]["checkpoint"]["source"] = str(tmp_path / "checkpoint-{job_id}")
    (tmp_path / "job.yaml").write_text(yaml.safe_dump(spec))
    job_id = int(json.loads(cli(sb, env, "submit", "--json", str(tmp_path / "job.yaml")).stdout)
                 ["job_id"])
    pipe = {"name": "webdag", "defaults": {"image": BUSYBOX_IMAGE, "grace_s": 5,
                                           "log": f"{tmp_path}/{{step}}-%j.out"},
            "steps": [{"name": "prep", "job": {"command": ["/bin/sh", "-c", "sleep 120"]}},
                      {"name": "train", "depends_on": ["prep"], "matrix": {"seed": [1, 2]},
                       "job": {"command": ["/bin/sh", "-c", "echo {matrix.seed}"]}},
                      {"name": "eval", "depends_on": ["train"],
                       "job": {"command": ["/bin/true"]}}]}
    (tmp_path / "p.yaml").write_text(yaml.safe_dump(pipe))
    cli(sb, env, "pipeline", "run", "--json", str(tmp_path / "p.yaml"))
    log = tmp_path / f"demo-{job_id}.out"
    try:
        poll(lambda: log.exists() and "step=3\n" in log.read_text(), 120, "demo job at step 3")

        browser.get(url + "/")
        phases = {r.get_attribute("data-node"): r.get_attribute("data-phase")
                  for r in browser.find_elements(By.CSS_SELECTOR, "#nodes tr[data-node]")}
        assert phases == {"gpu1": "lent", "gpu2": "serving", "gpu3": "serving",
                          "gpu4": "serving"}, phases
        assert browser.find_element(By.ID, "plot-24h").get_attribute("naturalWidth") != "0"
        browser.save_screenshot(str(tmp_path / "pool.png"))
        assert fits_1280(browser, url + "/") == []

        browser.get(url + "/jobs")
        row = browser.find_element(By.CSS_SELECTOR, f'#jobs tr[data-job="{job_id}"]')
        assert row.get_attribute("data-state") == "RUNNING"
        assert row.get_attribute("data-preemptions") == "0"
        dag = browser.find_element(By.CSS_SELECTOR, 'section[data-pipeline="webdag"] svg.dag')
        steps = {g.get_attribute("data-step"): g.get_attribute("data-state")
                 for g in dag.find_elements(By.CSS_SELECTOR, "g.step")}
        assert set(steps) == {"prep", "train-0", "train-1", "eval"}, steps
        assert steps["prep"] in {"RUNNING", "PENDING"} and steps["eval"] == "PENDING"
        browser.save_screenshot(str(tmp_path / "jobs.png"))
        assert fits_1280(browser, url + "/jobs") == []

        cli(sb, env, "reclaim", "gpu1", "--json")

        def requeued() -> Any:
            browser.get(url + "/jobs")
            rows = browser.find_elements(By.CSS_SELECTOR, f'#jobs tr[data-job="{job_id}"]')
            if not rows:  # between Slurm's requeue and the job's next listing (seen on 24.11)
                return False
            r = rows[0]
            got = (r.get_attribute("data-preemptions"), r.get_attribute("data-failures"))
            return got == ("1", "0") and r.get_attribute("data-state")

        try:
            state = poll(requeued, 120, "the job shown requeued with preemptions 1", interval_s=1.0)
        except AssertionError as exc:  # say what the API and Slurm saw
            seen = [j for j in get_json(url + "/api/jobs")["jobs"] if j["job_id"] == job_id]
            sacct = sb.run(["sacct", "-j", str(job_id), "-D", "-X", "-n", "-o",
                            "JobID,State,Restarts,NodeList"]).stdout
            raise AssertionError(f"{exc}; /api/jobs: {seen}; sacct: {sacct!r}") from None
        assert state in {"PENDING", "REQUEUED", "RUNNING"}
        browser.save_screenshot(str(tmp_path / "jobs-after-reclaim.png"))
        api = next(j for j in get_json(url + "/api/jobs")["jobs"] if j["job_id"] == job_id)
        assert (api["preemptions"], api["failures"], api["restarts"]) == (1, 0, 1)
        pool = get_json(url + "/api/pool")
        assert {"nodes", "models", "lent_gpu_hours", "gpu_hours_used", "timeline", "outlook",
                "best_time_to_submit", "errors", "generated_at"} <= set(pool)
        assert {n["name"]: n["phase"] for n in pool["nodes"]}["gpu1"] == "serving"
        assert pool["lent_gpu_hours"]["week"] is not None
    finally:
        if closed:
            sb.run(["scontrol", "update", f"nodename={closed}", "state=RESUME"])
        sb.run(["scancel", str(job_id)])
        cli(sb, env, "pipeline", "cancel", "--json", "webdag")
        for node in ("gpu2", "gpu3", "gpu4"):
            sb.run([sys.executable, "-m", "slurm_idle.cli", "unpin", node])
    for name in ("pool.png", "jobs.png", "jobs-after-reclaim.png"):
        assert (tmp_path / name).stat().st_size > 10_000
