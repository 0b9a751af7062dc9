"""`python -m slurm_idle.runner`: what every generated batch script runs as its srun step."""

import sys

from slurm_idle.runner.cli import main

sys.exit(main())
