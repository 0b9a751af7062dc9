"""Unit tests are hermetic: a developer's `eval "$(scripts/sandbox env)"` must not change them."""

from __future__ import annotations

import pytest

from slurm_idle.config import CONFIG_ENV


@pytest.fixture(autouse=True)
def _no_config_from_the_shell(monkeypatch: pytest.MonkeyPatch) -> None:
    """$SLURM_IDLE_CONFIG is hidden from each unit test and its subprocesses (a test that wants
    it sets it with monkeypatch or an explicit env): the calling shell's, and, with the suite
    sharded, a sandbox's that an end-to-end module run earlier on the same worker left in the
    process (the story's in-process agent sets it), which once made `simulate` read the
    sandbox's fleet. Per test, not per session: the worker's order of modules is not fixed."""
    monkeypatch.delenv(CONFIG_ENV, raising=False)

