"""Hostlist expansion matches Slurm's notation."""

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
