"""The sandbox's `up` says as each part is ready, with the seconds since it began (no daemons:
the start and wait steps are stubbed on the instance)."""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

from slurm_idle.testing.sandbox import Sandbox


def test_up_prints_one_line_per_part_as_it_is_ready(tmp_path: Path) -> None:
    """Every part up() times gets one progress line, in order, `[  Ns] PART ready`."""
    sb = Sandbox(tmp_path, 30000, job_submit_lua=None)
    noop: Any = lambda *a, **k: None
    for name in ("_check_ports", "_write_files", "_keep_lease", "_spawn", "_wait",
                 "engine_start", "jobs_node", "_build_images"):
        setattr(sb, name, noop)
    sb._start_mariadb = lambda ready: ready("mariadb")  # type: ignore[method-assign]
    lines: list[str] = []
    timings = sb._up(1.0, progress=lines.append)
    assert all(re.fullmatch(r"\[ +\d+s\] [a-z]+ ready", ln) for ln in lines), lines
    assert [ln.split("] ")[1].split()[0] for ln in lines] == [k for k in timings if k != "total"]
    assert len(lines) == len(timings) - 1 > 5


def test_up_ends_with_the_demo_images_built_on_a_dockerd_that_cannot_reach_a_registry(
        tmp_path: Path) -> None:
    """The sandbox never pulls (job_policy.pull: never), so `up` builds the demo's images once
    dockerd answers: the README's `slurm-idle submit etc/examples/demo-job.yaml` runs next.
    dockerd itself starts with its proxy at the sandbox's loopback trap."""
    sb = Sandbox(tmp_path, 30000, job_submit_lua=None)
    noop: Any = lambda *a, **k: None
    for name in ("_check_ports", "_write_files", "_keep_lease", "engine_start", "jobs_node"):
        setattr(sb, name, noop)
    envs: dict[str, Any] = {}
    argvs: dict[str, list[str]] = {}

    def spawn(name: str, argv: list[str], env: dict[str, str] | None = None) -> bool:
        envs[name], argvs[name] = env, argv
        return True

    sb._spawn = spawn  # type: ignore[method-assign]
    order: list[str] = []
    sb._wait = lambda name, *a, **k: order.append(name)  # type: ignore[method-assign,assignment,return-value]
    sb._start_mariadb = lambda ready: ready("mariadb")  # type: ignore[method-assign]
    sb._build_images = lambda: order.append("images")  # type: ignore[method-assign]
    timings = sb._up(1.0)
    assert order[-2:] == ["dockerd", "images"] and "images" in timings
    assert envs["dockerd"]["HTTPS_PROXY"] == f"http://127.0.0.1:{sb.layout.registry_trap_port}"
    # ... and its own /etc/resolv.conf, naming only the closed loopback resolver
    wrapped = argvs["dockerd"]
    assert wrapped[:2] == ["unshare", "--mount"] and wrapped[wrapped.index("dockerd") - 1] == str(
        tmp_path / "docker" / "resolv.conf")
