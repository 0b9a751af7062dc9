"""Bounded polling for tests against real services: wait for a condition, never sleep blindly."""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any


def poll(check: Callable[[], Any], timeout_s: float, what: str, interval_s: float = 0.5) -> Any:
    """Return the first truthy value of check(); fail (AssertionError) after timeout_s."""
    deadline = time.monotonic() + timeout_s
    last: Any = None
    while time.monotonic() < deadline:
        last = check()
        if last:
            return last
        time.sleep(interval_s)
    raise AssertionError(f"{what} not seen within {timeout_s}s (last: {last!r})")
