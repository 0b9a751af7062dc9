"""Logging setup: one line per decision, to stderr and optionally syslog."""

from __future__ import annotations

import logging
import logging.handlers
import os

LOGGER_NAME = "slurm_idle"
SYSLOG_SOCKET = "/dev/log"


def setup_logging(verbose: int = 0, quiet: bool = False, syslog: bool = False) -> list[str]:
    """Configure the `slurm_idle` logger (may be called again: the last call wins).

    Default: one INFO line per decision. -v: DEBUG, with what was observed, every Slurm
    command and Prometheus query and how long it took. -vv: the libraries' own debug lines
    too (HTTP requests to Prometheus and the container engine). Returns warnings about the
    setup itself, e.g. syslog asked for but no /dev/log.
    """
    problems: list[str] = []
    level = logging.WARNING if quiet else logging.DEBUG if verbose >= 1 else logging.INFO
    logging.getLogger().setLevel(logging.DEBUG if verbose >= 2 and not quiet else logging.WARNING)
    logger = logging.getLogger(LOGGER_NAME)
    logger.setLevel(level)
    logger.handlers.clear()
    stderr = logging.StreamHandler()
    stderr.setFormatter(logging.Formatter("%(asctime)s slurm-idle %(levelname)s %(message)s"))
    logger.addHandler(stderr)
    if verbose >= 2 and not quiet:
        root = logging.getLogger()
        root.handlers.clear()
        root.addHandler(stderr)
    if syslog:
        if os.path.exists(SYSLOG_SOCKET):
            handler = logging.handlers.SysLogHandler(address=SYSLOG_SOCKET)
            handler.setFormatter(logging.Formatter("slurm-idle[%(process)d]: %(message)s"))
            logger.addHandler(handler)
        else:
            problems.append(f"--syslog: no syslog socket at {SYSLOG_SOCKET}; logging to stderr only")
    logger.propagate = False
    for problem in problems:
        logger.warning("%s", problem)
    return problems


def get_logger(name: str) -> logging.Logger:
    """A child of the package logger, e.g. get_logger(__name__)."""
    return logging.getLogger(name if name.startswith(LOGGER_NAME) else f"{LOGGER_NAME}.{name}")
