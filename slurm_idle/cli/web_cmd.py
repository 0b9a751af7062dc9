"""`slurm-idle web`: serve the read-only pool / jobs / pipelines view (extra `web`)."""

from __future__ import annotations

import os
import pwd

import click

from slurm_idle.cli import main
from slurm_idle.cli.common import Context, pass_ctx


@main.command()
@click.option("--host", default="127.0.0.1", show_default=True,
              help="Address to bind. Keep the default and put a reverse proxy with the site's "
                   "SSO in front: the view has no login of its own.")
@click.option("--port", default=8765, show_default=True, type=click.IntRange(1, 65535))
@click.option("--cache-s", default=15.0, show_default=True, type=click.FloatRange(min=0),
              help="Reuse the cluster's answers this long (every page load runs squeue/sacct).")
@pass_ctx
def web(ctx: Context, host: str, port: int, cache_s: float) -> None:
    """Serve a read-only web view of the pool, the jobs and the pipelines.

    Pages: / (pool: nodes and phases, lent GPU-hours, 24-hour plot, GPUs expected lendable
    in the next hours), /jobs?user=NAME (jobs with preemptions and failures apart, log tails,
    pipeline DAGs). JSON: /api/pool and /api/jobs?user=NAME (shapes in docs/researchers.md). The jobs
    and pipelines are those recorded in this user's state dir ($SLURM_IDLE_STATE_DIR).
    Needs `pip install 'slurm-idle[web]'`.

    Who sees what is the site's choice. Every job is listed, but log tails and pipeline
    parameters are shown only to their owner: the user the site's proxy names in the header
    `web.user_header` (config), else the user this view runs as (not root). Run as root
    without web.user_header, it shows no one's. `web.show_all_users: true` shows everyone's
    to everyone. ?user= only filters the list; the viewer's own jobs come first, and the
    jobs page says who it takes the viewer to be. Times are in policy.timezone (log lines'
    t=<epoch> stamps too, on the page only: the log files are not changed).
    """
    from slurm_idle.cli.jobs_cmd import _config
    from slurm_idle.pipeline import state_dir
    from slurm_idle.web import check_bindable, create_app, serve
    from slurm_idle.web.data import LiveData

    cfg = _config(ctx)
    tz = cfg.policy.timezone if cfg is not None else "UTC"
    header = cfg.web.user_header if cfg is not None else None
    local = pwd.getpwuid(os.getuid()).pw_name if os.getuid() != 0 else None
    app = create_app(LiveData(cfg, state_dir(), ttl_s=cache_s), timezone=tz, user_header=header,
                     local_user=local)
    check_bindable(host, port)  # before `serving http://...`: a port in use is bad input
    click.echo(f"slurm-idle web: serving http://{host}:{port}/ (read-only; Ctrl-C stops)",
               err=True)
    serve(app, host, port)
