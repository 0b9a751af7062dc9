"""Unit tests are hermetic: a developer's `eval "$(scripts/sandbox env)"` must not change them."""

from __future__ import annotations

import os
from collections.abc import Iterator

import pytest

from slurm_idle.config import CONFIG_ENV


@pytest.fixture(autouse=True, scope="session")
def _no_config_from_the_shell() -> Iterator[None]:
    """$SLURM_IDLE_CONFIG of the calling shell is hidden from the tests and their subprocesses
    (a test that wants it sets it with monkeypatch or an explicit env)."""
    saved = os.environ.pop(CONFIG_ENV, None)
    try:
        yield
    finally:
        if saved is not None:
            os.environ[CONFIG_ENV] = saved
