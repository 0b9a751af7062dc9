"""Test helpers shipped with slurm-idle: a local sandbox cluster and a vLLM emulator.

`slurm_idle.testing.sandbox.Sandbox` runs real Slurm (munged, MariaDB + slurmdbd, slurmctld,
4 slurmd), dockerd, Prometheus and one vLLM emulator per node on loopback, so contract and
end-to-end tests exercise the real services instead of fakes.
"""
