"""What every config section shares: the strict frozen base model, name patterns, URL check.

Every model forbids unknown keys and non-finite numbers (`1e400`, `.inf`): a typo in a config
read by cron every minute must fail loudly and precisely.
"""

from __future__ import annotations

import re

from pydantic import (
    BaseModel,
    ConfigDict,
)

from slurm_idle import fleetspec

DEFAULT_CONFIG_PATH = "/etc/slurm-idle/slurm-idle.yaml"
CONFIG_ENV = "SLURM_IDLE_CONFIG"
#: Validation context of a config file (parse_config): rules that only a real pool needs.
FILE_CONTEXT = {"config_file": True}
DEFAULT_REPLICA_URL = fleetspec.DEFAULT_REPLICA_URL
#: A Slurm partition or our tag: they go into Reasons, Comments and `#SBATCH` lines.
SLURM_NAME_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,62}$")
#: A Slurm node name (what hostlist.expand_hostlist accepts, and not empty).
NODE_NAME_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,127}$")
#: A Prometheus label name (`by (...)`) and a label value we put between quotes in PromQL.
LABEL_NAME_RE = re.compile(r"^[A-Za-z_][A-Za-z0-9_]{0,127}$")
LABEL_VALUE_RE = re.compile(r"^[A-Za-z0-9_.:/@+-]{1,128}$")
#: A Prometheus metric name, put into PromQL as it is (`DCGM_FI_DEV_FB_USED`).
METRIC_NAME_RE = re.compile(r"^[A-Za-z_:][A-Za-z0-9_:]{0,199}$")


def _http_url(value: str, what: str) -> str:
    """Only http(s) URLs: the agent talks HTTP, and `file:`/`ftp:` would make urllib read files."""
    scheme, sep, rest = value.partition("://")
    if not sep or scheme.lower() not in {"http", "https"} or not rest or any(
        ch.isspace() or ch in "\"'" for ch in value
    ):
        raise ValueError(f"{what} {value!r} must be an http:// or https:// URL")
    return value


class _Strict(BaseModel):
    # allow_inf_nan=False: `timeouts.start_s: 1e400` is YAML for infinity, never meant.
    model_config = ConfigDict(extra="forbid", frozen=True, allow_inf_nan=False)
