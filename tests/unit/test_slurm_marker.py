"""The `slurm` marker (tests/conftest.py): `-m slurm` selects the tests that touch a real Slurm,
the quick check on another Slurm release (CI runs the whole suite on both).

A Slurm-touching test that loses the marker silently drops out of that selection, so each rule
that sets it has a case here that fails when the rule is removed.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from tests.conftest import E2E_DIR, UNIT_DIR, runs_slurm, touches_slurm

CONTRACT_DIR = E2E_DIR.parent / "contract"


@dataclass
class Item:
    """The few attributes of a pytest item that the rules read."""

    path: Path
    fixturenames: list[str] = field(default_factory=list)
    markers: tuple[str, ...] = ()

    def get_closest_marker(self, name: str) -> Any:
        return object() if name in self.markers else None


PURE = CONTRACT_DIR / "test_http_deadline.py"  # a trickling HTTP server, no Slurm


def test_a_test_using_the_sandbox_fixture_is_marked() -> None:
    assert not touches_slurm(Item(PURE))
    assert touches_slurm(Item(PURE, fixturenames=["tmp_path", "sandbox"]))


def test_every_e2e_test_is_marked() -> None:
    # a module whose source names no Slurm command and that does not use the fixture
    assert touches_slurm(Item(E2E_DIR / "test_not_written_yet.py"))


def test_a_hand_marked_test_is_marked() -> None:
    assert touches_slurm(Item(PURE, markers=("slurm",)))


def test_a_module_that_runs_slurm_commands_is_marked(tmp_path: Path) -> None:
    mod = tmp_path / "test_x.py"
    mod.write_text('def test_q():\n    run(["squeue", "-h"])\n')
    assert runs_slurm(mod) and touches_slurm(Item(mod))
    plain = tmp_path / "test_y.py"
    plain.write_text('def test_q():\n    run(["haproxy", "-c"])\n')  # "squeues" is not a command
    assert not runs_slurm(plain) and not touches_slurm(Item(plain))


def test_unit_tests_are_never_marked_by_their_source() -> None:
    """Unit tests name Slurm commands in parser tests of captured output: pure, release-free."""
    assert runs_slurm(CONTRACT_DIR / "test_slurm_cli.py")
    assert not touches_slurm(Item(UNIT_DIR / "test_slurm_parse.py"))


def test_non_slurm_contract_modules_are_the_known_ones() -> None:
    """The contract modules `-m slurm` leaves out whole: they neither use the sandbox nor run
    Slurm. A new module that does neither fails here until it is listed with its reason."""
    skipped = sorted(p.name for p in CONTRACT_DIR.glob("test_*.py")
                     if not runs_slurm(p) and "sandbox" not in p.read_text())
    assert skipped == [
        "test_agent_metrics_prometheus.py",  # Prometheus, promtool, systemd-analyze
        "test_file_safety.py",  # lock, journal and report files against other local users
        "test_http_deadline.py",  # a trickling HTTP server
        "test_logrotate.py",  # the shipped logrotate rule on a journal of an agent on fakes
        "test_router_real.py",  # HAProxy's runtime API, an nginx reload
        "test_vllm_faults.py",  # a real vLLM's SIGTERM and start faults; Slurm is a fake there
        "test_vllm_real.py",  # a real vLLM on CPU; no Slurm (it runs in the Debian 12 lane)
        "test_web_outlook_prometheus.py",  # the web outlook's history query, Prometheus only
    ], ("a contract module that neither uses the sandbox nor runs a Slurm command is skipped by "
        "`-m slurm`: list it here with the reason its outcome cannot depend on "
        "the Slurm release, or mark it @pytest.mark.slurm")
