"""slurm-idle: lend the idle GPUs of an LLM inference fleet to a preemptible Slurm partition."""

__version__ = "0.1.0"
