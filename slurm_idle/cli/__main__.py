"""`python -m slurm_idle.cli` runs the command line."""

from slurm_idle.cli import entry

entry()
