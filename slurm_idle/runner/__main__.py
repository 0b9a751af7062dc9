"""`python -m slurm_idle.runner`: the runner as scripts generated before `slurm_idle.job_step`
start it (this package is imported before any line here runs, so job_step holds the signals
only from now on; new scripts run `python -m slurm_idle.job_step`)."""

import sys

from slurm_idle.job_step import main

sys.exit(main())
