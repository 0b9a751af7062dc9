"""Hostlist expansion matches Slurm's notation."""

import pytest

from slurm_idle.hostlist import expand_hostlist


def test_range_and_single() -> None:
    """A bracket with a range and a single index expands in order."""
    assert expand_hostlist("gpu[1-3,7]") == ["gpu1", "gpu2", "gpu3", "gpu7"]


def test_zero_padding_and_lists() -> None:
    """Zero-padded ranges keep their width; top-level commas separate expressions."""
    assert expand_hostlist("n[08-10],login") == ["n08", "n09", "n10", "login"]


def test_plain_name() -> None:
    """A name without brackets is itself."""
    assert expand_hostlist("gpu1") == ["gpu1"]


@pytest.mark.parametrize("expr", ["gpu[1-", "gpu1-4]", "gpu[a-3]", "gpu[3-1]", "gpu[1-4] x", "gpu[[1-2]]"])
def test_a_malformed_config_hostlist_is_refused(expr: str) -> None:
    """`nodes:` in the config is strict: a typo fails config check, it never invents nodes."""
    with pytest.raises(ValueError, match="malformed hostlist"):
        expand_hostlist(expr, strict=True)


def test_strict_accepts_what_slurm_writes() -> None:
    assert expand_hostlist("gpu[01-03,7],cpu-a.b", strict=True) == ["gpu01", "gpu02", "gpu03", "gpu7", "cpu-a.b"]
