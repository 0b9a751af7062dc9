"""scripts/bench-tick: one observe -> plan through the real parsers costs a constant number of calls."""

from __future__ import annotations

import importlib.machinery
import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path
from types import ModuleType

import pytest

SCRIPT = Path(__file__).resolve().parents[2] / "scripts" / "bench-tick"


def load_script() -> ModuleType:
    loader = importlib.machinery.SourceFileLoader("bench_tick", str(SCRIPT))
    spec = importlib.util.spec_from_loader("bench_tick", loader)
    assert spec is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules["bench_tick"] = module  # dataclasses look their module up while decorating
    loader.exec_module(module)
    return module


def test_calls_do_not_grow_with_the_fleet() -> None:
    """Slurm commands and Prometheus queries per tick are the same for 8, 40 and 200 nodes."""
    bench = load_script().bench
    results = [bench(n) for n in (8, 40, 200)]
    assert {r["slurm_calls"] for r in results} == {2}  # sinfo --json + squeue --json
    assert len({r["prometheus_queries"] for r in results}) == 1
    assert results[0]["prometheus_queries"] == 9 + 10  # per-replica signals + per-model ones
    assert all(r["planned"] and r["observation_errors"] == 0 for r in results)


def test_synthetic_cluster_goes_through_the_real_parsers() -> None:
    """The synthetic sinfo/squeue JSON parse into every node, half of them lent with a job."""
    mod = load_script()
    config = mod.make_config(40)
    sinfo, squeue = mod.synthetic_slurm(config)
    runner = mod.ReplayRunner(sinfo, squeue)
    backend = mod.CliBackend(runner=runner)
    nodes, jobs = backend.nodes(), backend.jobs()
    assert {n.name for n in nodes} == set(config.pool_nodes)
    assert 5 < len(jobs) < 35 and all(j.state == "RUNNING" and j.partition == "idle" for j in jobs)
    assert [a[0] for a in runner.argvs] == ["sinfo", "squeue"]


def test_cli_prints_the_documented_json() -> None:
    """`bench-tick --nodes N --json` prints tick_s, slurm_calls and prometheus_queries."""
    res = subprocess.run([sys.executable, str(SCRIPT), "--nodes", "20", "--json"],
                         check=False, capture_output=True, text=True, timeout=120)
    assert res.returncode == 0, res.stderr
    doc = json.loads(res.stdout)
    assert {"tick_s", "slurm_calls", "prometheus_queries"} <= set(doc)
    assert doc["tick_s"] >= 0 and doc["nodes"] == 20


@pytest.mark.parametrize("script", ["bench-tick", "bench-sim", "bench-sim-diagnose", "make-trace"])
def test_scripts_import_their_own_tree(tmp_path: Path, script: str) -> None:
    """Run from anywhere, a script imports the slurm_idle next to it, not one found first on
    the path (another checkout sharing the venv; here a decoy on PYTHONPATH)."""
    decoy = tmp_path / "slurm_idle"
    decoy.mkdir()
    (decoy / "__init__.py").write_text('raise ImportError("decoy slurm_idle from another tree")\n')
    env = {**os.environ, "PYTHONPATH": str(tmp_path)}
    res = subprocess.run([sys.executable, str(SCRIPT.parent / script), "--help"], cwd=tmp_path, env=env,
                         check=False, capture_output=True, text=True, timeout=120)
    assert res.returncode == 0, res.stderr
    assert "decoy" not in res.stderr


@pytest.mark.skipif(not Path("/usr/bin/python3").exists(), reason="no system python3")
@pytest.mark.parametrize("script", ["bench-tick", "make-trace"])
def test_scripts_run_by_a_bare_python_use_the_projects_venv(tmp_path: Path, script: str) -> None:
    """Run by a python without the dependencies (the shebang's python3 on a fresh clone), a
    script re-executes itself under the tree's .venv instead of failing to import pydantic."""
    env = {k: v for k, v in os.environ.items() if k not in ("VIRTUAL_ENV", "PYTHONPATH")}
    res = subprocess.run(["/usr/bin/python3", "-I", str(SCRIPT.parent / script), "--help"],
                         cwd=tmp_path, env=env, check=False, capture_output=True, text=True,
                         timeout=300)
    assert res.returncode == 0, res.stderr
    assert "usage:" in res.stdout and "ModuleNotFoundError" not in res.stderr


def test_observe_pauses_gc_and_restores_it() -> None:
    """observe runs with the cyclic GC paused and leaves it as it found it, also on errors."""
    import gc

    from slurm_idle.agent import observe

    mod = load_script()
    config = mod.make_config(8)
    sinfo, squeue = mod.synthetic_slurm(config)
    seen: list[bool] = []

    class Spy:
        """A Slurm backend that records whether the GC was on while it was read."""

        def __init__(self, fail: bool = False) -> None:
            self.inner = mod.CliBackend(runner=mod.ReplayRunner(sinfo, squeue))
            self.fail = fail

        def nodes(self):  # type: ignore[no-untyped-def]
            seen.append(gc.isenabled())
            if self.fail:
                raise RuntimeError("slurmctld down")
            return self.inner.nodes()

        def jobs(self):  # type: ignore[no-untyped-def]
            return self.inner.jobs()

    metrics = mod.PrometheusSource(config, prom=mod.synthetic_prometheus(config))
    was = gc.isenabled()
    try:
        gc.enable()
        obs = observe(config, Spy(), metrics, mod.NOW)
        assert len(obs.nodes) == 8 and gc.isenabled()
        with pytest.raises(RuntimeError):
            observe(config, Spy(fail=True), metrics, mod.NOW)
        assert gc.isenabled()
        gc.disable()
        observe(config, Spy(), metrics, mod.NOW)
        assert not gc.isenabled()
    finally:
        if was:
            gc.enable()
    assert seen == [False, False, False]
