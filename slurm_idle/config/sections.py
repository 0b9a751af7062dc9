"""The agent's own sections: `policy`, `timeouts`, `paths`, `report`, `job_policy`, `pipeline`
and `web`."""

from __future__ import annotations

import os
from typing import Literal

from pydantic import (
    Field,
    field_validator,
    model_validator,
)

from slurm_idle.config.base import (
    _Strict,
)
from slurm_idle.errors import ConfigError


class PolicyConfig(_Strict):
    """Knobs of the planner (policy.py). Defaults are safe: service first."""

    target_utilisation: float = Field(0.8, gt=0, le=1)
    prompt_token_weight: float = Field(0.1, ge=0)
    max_lent_fraction: float = Field(1.0, ge=0, le=1)
    max_transitions_per_tick: int = Field(2, ge=1)
    scale_down_window_s: int = Field(900, ge=0)
    kv_cache_high: float = Field(0.9, gt=0, le=1)
    ttft_p95_slo_s: float | None = Field(None, gt=0)
    queue_waiting_threshold: float = Field(0.0, ge=0)
    headroom_replicas: int = Field(0, ge=0)
    learn_capacity: bool = False
    forecast: bool = True
    forecast_lead_s: float | None = Field(None, ge=0)  # default: grace + expected start + a tick
    # A queue adds replicas only once it has lasted this long (its minimum over this span is
    # above queue_waiting_threshold): one request waiting for a moment reclaims nothing.
    queue_sustain_s: int = Field(60, ge=0)
    lending_windows: tuple[str, ...] = ()  # e.g. ["20:00-08:00"]; empty = always
    timezone: str = "UTC"
    reclaim_on_unknown_metrics: bool = False
    # Adaptive headroom (issue 15): the replicas a model needs are sized for its load's level
    # and trend plus this many standard deviations of its minute-to-minute variability, all
    # three estimated over the scale-down window (policy/capacity.py `adaptive_demand`). 0 turns
    # it off. The same default holds from 1% to 10% noise because the margin scales with the
    # noise measured, not with a fixed planning factor.
    headroom_sigmas: float = Field(3.0, ge=0)
    # `slurm-idle agent` (a long-running loop instead of cron): a full tick every
    # tick_interval_s, and between ticks a fast check every fast_interval_s that only starts
    # reclaims of models under queue / KV-cache / TTFT pressure or with a serving replica out of
    # service (0: no fast check).
    tick_interval_s: int = Field(60, ge=1)
    fast_interval_s: int = Field(10, ge=0)
    # Like Slurm's PreemptExemptTime: a lent node running a job younger than this is reclaimed
    # last, only when no other lent node can be (service still comes first); 0 turns it off.
    min_job_runtime_s: float = Field(0.0, ge=0)

    @field_validator("lending_windows")
    @classmethod
    def _windows_parse(cls, value: tuple[str, ...]) -> tuple[str, ...]:
        from slurm_idle.policy.windows import parse_window  # the planner's own parser

        for window in value:
            try:
                parse_window(window)
            except ConfigError as exc:
                raise ValueError(str(exc)) from None
        return value

    @field_validator("timezone")
    @classmethod
    def _known_zone(cls, value: str) -> str:
        from zoneinfo import ZoneInfo, ZoneInfoNotFoundError

        try:
            ZoneInfo(value)
        except (ZoneInfoNotFoundError, ValueError):
            raise ValueError(f"{value!r} is not a known time zone (e.g. Europe/Paris)") from None
        return value


class TimeoutsConfig(_Strict):
    """How long a transition may take before it is reported as stuck and retried."""

    retire_s: float = Field(300.0, gt=0)
    lend_s: float = Field(300.0, gt=0)
    reclaim_s: float = Field(600.0, gt=0)
    start_s: float = Field(900.0, gt=0)
    # A reclaimed node whose GPUs still hold someone's memory (`held`) waits this long for them.
    gpu_free_s: float = Field(300.0, gt=0)
    tick_budget_s: float = Field(50.0, gt=0)  # a cron tick gives up waiting after this


class PathsConfig(_Strict):
    """Files the agent writes: in directories only root (or the agent's user) can write, opened
    without following symlinks (safefiles)."""

    journal: str = "/var/lib/slurm-idle/journal.jsonl"
    # In a 0700 directory of its own (created by the agent), never the world-writable /run/lock.
    lock: str = "/run/slurm-idle/tick.lock"
    textfile: str | None = None  # node_exporter textfile collector .prom file
    # Prometheus file_sd_configs targets of the replica jobs (`placement: jobs`), rewritten
    # each tick (filesd.py); None: not written.
    file_sd: str | None = None


class ReportConfig(_Strict):
    """Money saved is priced at what the lent GPU-hours would cost elsewhere."""

    price_per_gpu_hour: float = Field(2.0, ge=0)
    currency: str = "USD"
    # Work lost to a preemption = min(run, this) x GPUs; unset: the whole run (an upper bound).
    checkpoint_interval_s: float | None = Field(None, gt=0)


class PipelineConfig(_Strict):
    """Bounds on what one `pipeline run` may submit: a `matrix:` fans out as the product of
    its lists, so a few short lines can ask for 10^20 jobs; refused before anything expands."""

    max_steps: int = Field(1000, ge=1)  # jobs of one pipeline, matrix jobs counted one by one


class WebConfig(_Strict):
    """`slurm-idle web`: whose job logs and pipeline parameters a viewer sees.

    By default only their own: the viewer is the user the site's proxy authenticated, in
    `user_header` (set it only when nothing but the proxy can reach the view: anyone who can
    connect could send the header), else, when the view runs as a user other than root, that
    user. `show_all_users: true` shows everyone's to everyone (a trusted team's view).
    """

    show_all_users: bool = False
    user_header: str | None = None  # e.g. X-Remote-User, set by the site's SSO proxy


class JobPolicyConfig(_Strict):
    """What a container job may ask of a node: checked at `submit` and again by the runner on
    the node (a user can write their own batch script, but not the node's config).

    The defaults are safe: no host network (it reaches Prometheus, the engines and every
    loopback service), bind mounts and absolute log paths only under `mount_prefixes`, and no
    job as root (a root container writes wherever its mounts point, e.g. the host's /etc).
    """

    mount_prefixes: tuple[str, ...] = ("/home", "/scratch", "/data", "/shared")
    networks: tuple[Literal["none", "host"], ...] = ("none",)
    allow_root: bool = False
    # The container engine the runner uses: rootless podman (a per-user API socket, no daemon
    # that is root on the node) or docker (its socket is root-equivalent: every researcher who
    # can use it is root on the node; choose it only where the site accepts that), or
    # charliecloud (`ch-run`, unprivileged, no daemon, no store: flattened image directories
    # under `charliecloud_images`, never pulled).
    runtime: Literal["podman", "docker", "charliecloud"] = "podman"
    # charliecloud: where the image directories are, one per image, named as ch-image names its
    # storage (`slurm-idle/demo:latest` -> `slurm-idle%demo+latest`).
    charliecloud_images: str = "/var/lib/slurm-idle/images"
    # When the runner may ask a registry for a job's image: `missing` (only when it is not on
    # the node), `always` (every run), `never` (the image must be on the node already: no
    # registry is asked, not even its name resolved; a missing image fails the job before any
    # container starts, in one line naming the image, the node and how to load it).
    pull: Literal["never", "missing", "always"] = "missing"

    @field_validator("charliecloud_images")
    @classmethod
    def _absolute_dir(cls, value: str) -> str:
        if not value.startswith("/"):
            raise ValueError(f"charliecloud_images {value!r} must be an absolute directory")
        return value

    @field_validator("mount_prefixes")
    @classmethod
    def _absolute_dirs(cls, value: tuple[str, ...]) -> tuple[str, ...]:
        for prefix in value:
            if not prefix.startswith("/") or prefix != os.path.normpath(prefix) or prefix == "/":
                raise ValueError(
                    f"mount prefix {prefix!r} must be an absolute, normalised directory other "
                    "than / (e.g. /scratch)"
                )
        return value


class HaConfig(_Strict):
    """Several agents, one actor (leadership.py), and what happens when none renews the lease
    (watchdog.py). Off by default: one agent with its lock, as before."""

    enabled: bool = False
    # A standby takes over this long after the actor stopped renewing (renewed every third of it).
    lease_s: float = Field(30.0, ge=5)
    # Fischer's wait between a claim and its check; a claim slower than half of it is given up.
    settle_s: float = Field(2.0, gt=0)
    # No renewal for this long: the node-local watchdog acts (on_dead).
    dead_after_s: float = Field(120.0, gt=0)
    # safe: the watchdog gives lent nodes back to serving; frozen: keeps them lent and alerts.
    on_dead: Literal["safe", "frozen"] = "safe"
    partition: str | None = None  # the lease job's partition (default: slurm.lend_partition)

    @model_validator(mode="after")
    def _timings_hold(self) -> HaConfig:
        if self.settle_s > self.lease_s / 5:
            raise ValueError(f"settle_s ({self.settle_s:g}) must be at most lease_s / 5 "
                             f"({self.lease_s / 5:g}): a claim must leave the leader time to act")
        if self.dead_after_s < 2 * self.lease_s:
            raise ValueError(f"dead_after_s ({self.dead_after_s:g}) must be at least 2 x lease_s "
                             f"({2 * self.lease_s:g}): the watchdogs must not act while a "
                             "standby is taking over")
        return self
