"""The demo says OK only when its story held: no client request failed because a replica was
stopped or put to sleep under it, nor for an unexplained reason; timeouts in an overloaded
queue and the generator's own limit are reported as such, not held against the story."""

from __future__ import annotations

from typing import Any

from slurm_idle.testing.demo import DemoReport, client_summary, verdict


def story(failures: dict[str, int], **traffic: Any) -> DemoReport:
    return DemoReport(job_restarts=1, resumed_from=7,
                      client_traffic={"requests": 1000, "failures": failures, **traffic})


def test_a_clean_story_is_ok() -> None:
    assert verdict(story({})) == (True, ["demo: OK"])


def test_aborted_requests_fail_the_demo() -> None:
    """An abort, a reset or a 503 by a stopping replica: not OK, and the line names them."""
    ok, lines = verdict(story({"timeout": 6, "aborted": 3, "connection: ConnectionResetError": 1,
                               "http 503": 2}))
    assert not ok
    assert "demo: OK" not in lines
    assert lines[-1] == ("demo: 6 client requests failed because a replica was stopped or put "
                         "to sleep under them (aborted 3, connection: ConnectionResetError 1, "
                         "http 503 2)")


def test_overload_timeouts_are_explained_not_held_against_the_story() -> None:
    """Timeouts of queued requests and requests the generator could not send: OK, with a line
    saying the timeouts were the load's."""
    ok, lines = verdict(story({"timeout": 6, "http 504": 1}, client_overload=40))
    assert ok and lines[-1] == "demo: OK"
    assert lines[0].startswith("demo: 7 client requests waited out their timeout in a queue "
                               "under overload (timeout 6, http 504 1)")


def test_an_unexplained_failure_fails_the_demo() -> None:
    ok, lines = verdict(story({"http 404": 2}))
    assert not ok and lines == ["demo: 2 client requests failed for another reason (http 404 2)"]


def test_the_story_must_still_complete() -> None:
    """No preemption or no resume: not OK whatever the clients saw."""
    assert not verdict(DemoReport(job_restarts=0, resumed_from=7))[0]
    assert not verdict(DemoReport(job_restarts=1, resumed_from=None))[0]


def test_the_client_line_keeps_drain_overload_and_the_client_apart() -> None:
    """The printed line says which failures a drain caused and which the load did."""
    line = client_summary({"requests": 1000, "failures": {"timeout": 6, "aborted": 3},
                           "client_overload": 40}, "2.00s")
    assert line == ("requests 1000, failed by a drain 3 (aborted 3), timed out under overload 6 "
                    "(timeout 6), not sent (client_overload) 40, p99 2.00s")
    assert client_summary({"requests": 5, "failures": {}}, "-") == \
        "requests 5, failed by a drain 0, p99 -"
