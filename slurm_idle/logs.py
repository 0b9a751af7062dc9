"""Logging setup: one line per decision, to stderr and optionally syslog."""

from __future__ import annotations

import logging
import logging.handlers
import os

LOGGER_NAME = "slurm_idle"


def setup_logging(verbose: int = 0, quiet: bool = False, syslog: bool = False) -> None:
    """Configure the `slurm_idle` logger once per process."""
    level = logging.WARNING if quiet else logging.DEBUG if verbose > 1 else logging.INFO
    logger = logging.getLogger(LOGGER_NAME)
    logger.setLevel(level)
    logger.handlers.clear()
    stderr = logging.StreamHandler()
    stderr.setFormatter(logging.Formatter("%(asctime)s slurm-idle %(levelname)s %(message)s"))
    logger.addHandler(stderr)
    if syslog and os.path.exists("/dev/log"):
        handler = logging.handlers.SysLogHandler(address="/dev/log")
        handler.setFormatter(logging.Formatter("slurm-idle[%(process)d]: %(message)s"))
        logger.addHandler(handler)
    logger.propagate = False


def get_logger(name: str) -> logging.Logger:
    """A child of the package logger, e.g. get_logger(__name__)."""
    return logging.getLogger(name if name.startswith(LOGGER_NAME) else f"{LOGGER_NAME}.{name}")
