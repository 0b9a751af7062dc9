"""Logging setup: one line per decision to syslog (--syslog); stderr only for warnings and
errors unless -v."""

from __future__ import annotations

import logging
import logging.handlers
import os

LOGGER_NAME = "slurm_idle"
SYSLOG_SOCKET = "/dev/log"


#: Where `--log` sends the decision lines: `syslog` (as --syslog: on a systemd host that is the
#: journal) or `stderr` (as before this convention: one INFO line per decision, no debug).
LOG_TARGETS = ("stderr", "syslog")


def setup_logging(verbose: int = 0, quiet: bool = False, syslog: bool = False,
                  log: str | None = None) -> list[str]:
    """Configure the `slurm_idle` logger (may be called again: the last call wins).

    The decision lines (INFO: plans, each step) go to syslog under --syslog, the log a cron
    job or a service keeps; stderr gets only warnings and errors, once, so a cron tick that
    did nothing is silent and one that acted is not printed twice (its command prints what it
    did on stdout). -v: stderr gets the INFO lines and DEBUG ones too (what was observed,
    every Slurm command and Prometheus query and how long it took); -vv: the libraries' own
    debug lines too (HTTP requests to Prometheus and the container engine). -q: only errors
    on stderr. `log`: `syslog` is --syslog; `stderr` puts the decision lines on stderr without
    the debug ones (a person watching a run; -q still wins). Returns warnings about the setup
    itself, e.g. syslog asked for but no /dev/log.
    """
    problems: list[str] = []
    verbose = 0 if quiet else verbose
    syslog = syslog or log == "syslog"
    stderr_level = (logging.ERROR if quiet else logging.DEBUG if verbose >= 1
                    else logging.INFO if log == "stderr" else logging.WARNING)
    record_level = logging.DEBUG if verbose >= 1 else logging.INFO  # syslog keeps the decisions
    logging.getLogger().setLevel(logging.DEBUG if verbose >= 2 else logging.WARNING)
    logger = logging.getLogger(LOGGER_NAME)
    logger.setLevel(record_level)
    logger.handlers.clear()
    stderr = logging.StreamHandler()
    stderr.setLevel(stderr_level)
    stderr.setFormatter(logging.Formatter("%(asctime)s slurm-idle %(levelname)s %(message)s"))
    logger.addHandler(stderr)
    if verbose >= 2:
        root = logging.getLogger()
        root.handlers.clear()
        root.addHandler(stderr)
    if syslog:
        if os.path.exists(SYSLOG_SOCKET):
            handler = logging.handlers.SysLogHandler(address=SYSLOG_SOCKET)
            handler.setFormatter(logging.Formatter("slurm-idle[%(process)d]: %(message)s"))
            logger.addHandler(handler)
        else:
            problems.append(f"--syslog: no syslog socket at {SYSLOG_SOCKET}; the decision lines are "
                            "not kept (-v shows them on stderr)")
    logger.propagate = False
    for problem in problems:
        if problem not in _warned:  # setup runs again when log options follow the command
            _warned.add(problem)
            logger.warning("%s", problem)
    return problems


#: Setup problems already said in this process: each once, not once per setup_logging call.
_warned: set[str] = set()


def get_logger(name: str) -> logging.Logger:
    """A child of the package logger, e.g. get_logger(__name__)."""
    return logging.getLogger(name if name.startswith(LOGGER_NAME) else f"{LOGGER_NAME}.{name}")
