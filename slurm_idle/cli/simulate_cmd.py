"""`slurm-idle simulate`: replay a load trace against a policy and score it."""

from __future__ import annotations

import os

import click

from slurm_idle.cli import main
from slurm_idle.cli.common import Context, echo_json, pass_ctx
from slurm_idle.errors import BadInput, ConfigError

DEFAULT_SYNTHETIC_FLEET = "llama-70b=20:4:2500"


@main.command()
@click.argument("trace", required=False, type=click.Path(dir_okay=False))
@click.option("--fleet", "fleets", multiple=True,
              metavar="MODEL=REPLICAS:GPUS_PER_REPLICA:TOKENS_PER_S[:PER_NODE]",
              help="A simulated model (repeatable); PER_NODE replicas share a node, which is lent "
              "only whole (default 1). Default: the pool of the config in effect.")
@click.option("--config", "config_path", default=None, metavar="PATH",
              help="Take the pool and the policy knobs from this slurm-idle config (like the "
              "global --config). Without either, $SLURM_IDLE_CONFIG or "
              "/etc/slurm-idle/slurm-idle.yaml is used if that file exists; with no config at "
              "all, --fleet (or --synthetic's default fleet) and default knobs are simulated.")
@click.option("--policy", type=click.Choice(["slurm-idle", "reactive", "night-window", "oracle"]),
              default="slurm-idle", show_default=True)
@click.option("--start-s", type=float, default=300.0, show_default=True, help="Replica cold start.")
@click.option("--wake-s", type=float, default=None, help="Sleep-mode wake time (replaces --start-s).")
@click.option("--grace-s", type=float, default=60.0, show_default=True, help="Job grace time at reclaim.")
@click.option("--placement", type=click.Choice(["nodes", "jobs"]), default="nodes", show_default=True,
              help="How the --fleet models run: `jobs` times each replica as a Slurm job "
              "(reclaim = grace + queue + start, lend = drain + scancel; one replica per lend "
              "unit). Models from a config keep their own placement.")
@click.option("--queue-s", type=float, default=None,
              help="placement jobs: Slurm's delay from sbatch to the replica job's start, "
              "GraceTime aside (default: the sandbox's measured value, see docs/benchmarks.md).")
@click.option("--prompt-weight", type=float, default=0.1, show_default=True,
              help="Demand model: cost of a prompt token relative to a generated one (without "
              "--config the slurm-idle policy weighs prompts the same).")
@click.option("--utilisation", type=float, default=0.8, show_default=True,
              help="Demand model: a replica breaks the SLO above this share of its tokens/s. "
              "Without --config the slurm-idle policy plans at 0.975x this (0.78 for 0.8).")
@click.option("--floor", type=int, default=1, show_default=True, help="Demand model: minimum replicas.")
@click.option("--step-s", type=int, default=60, show_default=True,
              help="Simulate in steps of this many seconds, a divisor of 60 (10: the agent's "
              "fast checks, sleep-mode wakes and short graces are timed to 10 s instead of "
              "whole minutes). The per-minute trace is made finer as --resample says.")
@click.option("--resample", type=click.Choice(["hold", "linear"]), default="hold",
              show_default=True,
              help="A trace coarser than --step-s: hold each step's load through the finer "
              "steps, or draw it linearly between the steps' centres. (A finer trace is "
              "averaged; --json `resampled` says which.)")
@click.option("--arrivals", type=click.Choice(["mean", "poisson"]), default="mean",
              show_default=True,
              help="Requests at each step's mean rate, or drawn as Poisson counts over the step "
              "(seeded by --seed): the noise an engine's counters show at low rates and short "
              "steps, which a planner must not lend and reclaim on.")
@click.option("--tick-s", type=int, default=60, show_default=True,
              help="slurm-idle: a full tick every this many seconds (whole steps; cron: 60).")
@click.option("--fast-s", type=int, default=0, show_default=True,
              help="slurm-idle: fast checks (policy.fast_plan) between ticks every this many "
              "seconds (whole steps, 0: none; the agent's default is 10 with --step-s 10).")
@click.option("--night-lend", type=int, default=None,
              help="night-window: replicas lent per model (default: what the trace's nights allow).")
@click.option("--azure-model", default=None, help="Model name for an Azure trace (default: the fleet's).")
@click.option("--synthetic", is_flag=True, help="Simulate a generated trace instead of reading TRACE.")
@click.option("--days", type=int, default=14, show_default=True, help="--synthetic: length.")
@click.option("--seed", type=int, default=1, show_default=True,
              help="--synthetic and --arrivals poisson: random seed.")
@click.option("--bursts-per-week", type=float, default=0.0, show_default=True,
              help="--synthetic: unannounced surges per week.")
@click.option("--timeline", type=click.Path(dir_okay=False), default=None,
              help="Write timestamp,model,serving,starting,lent,reclaiming per step (a "
              "minute, or --step-s) to this CSV.")
@click.option("--plot", type=click.Path(dir_okay=False), default=None,
              help="Draw load, needed/serving replicas and lent GPUs to this PNG (needs matplotlib).")
@click.option("--json", "as_json", is_flag=True, help="Machine-readable output.")
@pass_ctx
def simulate(ctx: Context, trace: str | None, fleets: tuple[str, ...], config_path: str | None,
             policy: str, start_s: float, wake_s: float | None, grace_s: float, placement: str,
             queue_s: float | None, prompt_weight: float,
             utilisation: float, floor: int, step_s: int, resample: str, arrivals: str,
             tick_s: int,
             fast_s: int, night_lend: int | None,
             azure_model: str | None,
             synthetic: bool, days: int, seed: int, bursts_per_week: float, timeline: str | None,
             plot: str | None, as_json: bool) -> None:
    """Simulate a fleet on a load trace under a policy and score it.

    TRACE is a CSV `timestamp,model,rps,prompt_tokens,output_tokens` (one row per step and
    model: a minute, or finer, e.g. every 10 s) or an Azure LLM inference trace
    (`TIMESTAMP,ContextTokens,GeneratedTokens`, aggregated per minute or per --step-s).
    The config (--config, else $SLURM_IDLE_CONFIG or /etc/slurm-idle/slurm-idle.yaml when that
    file exists) gives the pool unless --fleet is given, and the policy knobs; none is needed.
    """
    from slurm_idle.config import load_config, resolve_config_path
    from slurm_idle.safefiles import check_output
    from slurm_idle.sim import SimParams, fleet_from_config, parse_fleet
    from slurm_idle.sim import simulate as run
    from slurm_idle.sim.jobs_mode import QUEUE_S
    from slurm_idle.sim.output import plot_run, write_timeline
    from slurm_idle.traces import SyntheticModel, read_trace, synthetic_trace

    if trace and not synthetic and not os.path.isfile(trace):
        # What was typed first: a missing trace is the error, whatever the fleet or config.
        raise BadInput(f"{trace}: trace file not found")
    for path, option in ((timeline, "--timeline"), (plot, "--plot")):
        if path:
            check_output(path, option)  # before the run: root never writes through a symlink
    config = None
    explicit = config_path or ctx.config_path
    implicit = resolve_config_path(None)  # $SLURM_IDLE_CONFIG, then the system path
    if explicit:
        config = load_config(explicit)  # asked for: a missing file is an error
    elif os.path.isfile(implicit):
        config = load_config(implicit)  # installed: the pool and knobs of this site
    fleet = [parse_fleet(spec, placement) for spec in fleets]
    if not fleet and config is not None:
        fleet = fleet_from_config(config)
    if synthetic:
        if trace:
            raise ConfigError("give either TRACE or --synthetic, not both")
        if days < 1:
            raise ConfigError("--days must be at least 1")
        if not fleet:  # the fleet and trace of scripts/bench-sim's `diurnal` row
            fleet = [parse_fleet(DEFAULT_SYNTHETIC_FLEET)]
            models = [SyntheticModel(bursts_per_week=bursts_per_week)]
        else:
            models = [SyntheticModel(name=f.name, peak_rps=_peak_rps_for(f),
                                     bursts_per_week=bursts_per_week) for f in fleet]
        load = synthetic_trace(days=days, models=models, seed=seed)
    elif trace:
        if not fleet:
            raise ConfigError("no fleet: give --fleet MODEL=REPLICAS:GPUS_PER_REPLICA:TOKENS_PER_S or "
                              f"--config (no config file at {implicit})")
        name = azure_model or (fleet[0].name if len(fleet) == 1 else "azure")
        load = read_trace(trace, azure_model=name, step_s=min(step_s, 60))
    else:
        raise ConfigError("give a TRACE file or --synthetic (see `slurm-idle simulate --help`)")
    unsimulated = sorted(set(load.models) - {f.name for f in fleet})
    if unsimulated:
        click.echo(f"slurm-idle: warning: trace model(s) {', '.join(unsimulated)} have no --fleet "
                   "entry: not simulated, not in the timeline", err=True)
    params = SimParams(start_s=start_s, wake_s=wake_s, grace_s=grace_s, prompt_weight=prompt_weight,
                       utilisation=utilisation, floor=floor, tick_s=tick_s, fast_s=fast_s,
                       step_s=step_s, resample=resample, arrivals=arrivals, seed=seed,
                       queue_s=QUEUE_S if queue_s is None else queue_s)
    result = run(load, fleet, params, policy,
                 policy_config=config.policy if config is not None else None, night_lend=night_lend)
    if timeline:
        write_timeline(timeline, load, result)
    if plot:
        plot_run(plot, load, fleet, params, result, policy)
    summary = result.summary()
    if as_json:
        echo_json(summary)
        return
    resampled = {"none": "", "mean": ", averaged"}.get(result.resampled,
                                                         f", {result.resampled}")
    steps = ("" if step_s == 60 and result.resampled == "none" else
             f" in {step_s} s steps (trace at {result.trace_step_s:g} s{resampled})")
    click.echo(f"policy {policy}: {summary['minutes']} minutes{steps}, {len(fleet)} model(s)")
    click.echo(f"  harvested {summary['harvested_gpu_hours']:.1f} GPU-h of an oracle's "
               f"{summary['oracle_gpu_hours']:.1f} ({summary['harvest_ratio']:.1%})")
    violations = summary["slo_violation_minutes"]
    click.echo(f"  SLO violated in {violations} model-minute(s) ({result.violation_share:.3%} of "
               f"{result.model_minutes})")
    click.echo(f"  {summary['preemptions']} preemption(s), {summary['lost_gpu_hours']:.1f} GPU-h of work lost")


def _peak_rps_for(fleet: object) -> float:
    """A weekday peak that needs ~70% of the fleet (fleets are sized for bursts and growth)."""
    from slurm_idle.sim import FleetModel
    from slurm_idle.traces import SyntheticModel

    assert isinstance(fleet, FleetModel)
    spec = SyntheticModel()
    per_request = spec.output_tokens + 0.1 * spec.prompt_tokens
    return 0.7 * fleet.replicas * fleet.tokens_per_s * 0.8 / per_request
