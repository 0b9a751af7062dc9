"""The pool's 24-hour plot, drawn on the server with matplotlib (the `plot` extra; no CDN)."""

from __future__ import annotations

import io
from collections.abc import Mapping
from datetime import datetime
from typing import Any
from zoneinfo import ZoneInfo


def pool_24h_png(doc: Mapping[str, Any], tz: str) -> bytes:
    """Serving and lent GPUs (steps, left axis) with the token demand (line, right axis)."""
    from slurm_idle.report_io import _pyplot

    plt = _pyplot()
    import matplotlib.dates as mdates

    line = doc.get("timeline") or {}
    zone = ZoneInfo(tz)
    x = [datetime.fromtimestamp(t, zone) for t in line.get("t", [])]
    fig, ax = plt.subplots(figsize=(10, 3.6))
    try:
        if x:
            ax.fill_between(x, line["serving_gpus"], step="post", alpha=0.35, color="C0",
                            label="serving GPUs")
            ax.fill_between(x, line["lent_gpus"], step="post", alpha=0.35, color="C2",
                            label="lent GPUs")
        ax.set_ylim(bottom=0)
        ax.set_ylabel("GPUs")
        demand = [(t, v) for t, v in zip(x, line.get("demand_tokens_per_s", []), strict=False)
                  if v is not None]
        handles, labels = ax.get_legend_handles_labels()
        if demand:
            ax2 = ax.twinx()
            ax2.plot([t for t, _ in demand], [v for _, v in demand], color="C3", lw=1.5,
                     label="load (tokens/s)")
            ax2.set_ylim(bottom=0)
            ax2.set_ylabel("tokens/s")
            h2, l2 = ax2.get_legend_handles_labels()
            handles, labels = handles + h2, labels + l2
        if not x:
            ax.text(0.5, 0.5, "no journal yet", ha="center", va="center", transform=ax.transAxes)
        formatter = mdates.DateFormatter("%H:%M", tz=zone)  # type: ignore[no-untyped-call]
        ax.xaxis.set_major_formatter(formatter)
        if handles:
            ax.legend(handles, labels, loc="upper left", fontsize=8)
        ax.grid(alpha=0.3)
        ax.set_title("last 24 hours")
        fig.tight_layout()
        out = io.BytesIO()
        fig.savefig(out, format="png", dpi=90)
        return out.getvalue()
    finally:
        plt.close(fig)
