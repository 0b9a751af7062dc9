"""A pipeline's DAG with step states, drawn for the terminal (text) and the web view (SVG).

Both drawings come from `stages`: each step's column is the length of the longest chain of
upstreams before it, so every arrow points right (or down the list). Pure functions.
"""

from __future__ import annotations

from collections.abc import Sequence
from html import escape

from slurm_idle.pipeline import FAILED_STATES, StepStatus

#: One-character marks and colours per state family (the legend of both drawings).
MARKS = {"COMPLETED": "✓", "RUNNING": "▶", "PENDING": "…", "FAILED": "✗"}
COLOURS = {"COMPLETED": "#2e7d32", "RUNNING": "#1565c0", "PENDING": "#9e9e9e",
           "FAILED": "#c62828", "OTHER": "#ef6c00"}


def family(state: str) -> str:
    if state in FAILED_STATES:
        return "FAILED"
    if state in {"COMPLETED", "RUNNING", "PENDING"}:
        return state
    if state in {"REQUEUED", "PREEMPTED", "COMPLETING", "CONFIGURING", "SUSPENDED"}:
        return "RUNNING" if state != "PREEMPTED" else "PENDING"
    return "OTHER"


def stages(steps: Sequence[StepStatus]) -> list[list[StepStatus]]:
    """Steps grouped by depth (0: no upstream); within a stage in recorded order."""
    depth: dict[str, int] = {}
    for s in steps:  # recorded order is topological
        depth[s.name] = 1 + max((depth.get(u, -1) for u in s.depends_on), default=-1)
    out: list[list[StepStatus]] = [[] for _ in range(max(depth.values(), default=-1) + 1)]
    for s in steps:
        out[depth[s.name]].append(s)
    return out


def render_text(pipeline: str, steps: Sequence[StepStatus]) -> str:
    """`pipeline status` in the terminal: stage by stage, each step with state and upstreams."""
    lines = [f"pipeline {pipeline}"]
    for i, stage in enumerate(stages(steps), 1):
        lines.append(f"  stage {i}")
        for s in stage:
            mark = MARKS.get(family(s.state), "•")
            after = f"  <- {', '.join(s.depends_on)}" if s.depends_on else ""
            node = f" on {s.node}" if s.node else ""
            extra = f"  ({s.reason})" if s.reason else ""
            lines.append(f"    {mark} {s.name:18} {s.state:11} job {s.job_id:<7} "
                         f"restarts={s.restarts}{node}{after}{extra}")
    return "\n".join(lines)


BOX_W, BOX_H, GAP_X, GAP_Y, PAD = 170, 46, 60, 18, 10


def render_svg(steps: Sequence[StepStatus]) -> str:
    """An inline SVG: one box per step coloured by state, arrows from each upstream."""
    pos: dict[str, tuple[int, int]] = {}
    cols = stages(steps)
    for c, stage in enumerate(cols):
        for r, s in enumerate(stage):
            pos[s.name] = (PAD + c * (BOX_W + GAP_X), PAD + r * (BOX_H + GAP_Y))
    width = PAD * 2 + len(cols) * BOX_W + max(len(cols) - 1, 0) * GAP_X
    height = PAD * 2 + max((len(st) for st in cols), default=0) * (BOX_H + GAP_Y) - GAP_Y
    height = max(height, BOX_H + 2 * PAD)
    parts = [
        # The viewBox lets a page scale a wide DAG down to its width instead of clipping it.
        (f'<svg xmlns="http://www.w3.org/2000/svg" class="dag" width="{width}" '
        f'height="{height}" viewBox="0 0 {width} {height}" role="img">'),
        ('<defs><marker id="arrow" viewBox="0 0 10 10" refX="10" refY="5" markerWidth="7" '
        'markerHeight="7" orient="auto"><path d="M0,0 L10,5 L0,10 z" fill="#555"/></marker></defs>'),
    ]
    for s in steps:
        x, y = pos[s.name]
        for u in s.depends_on:
            if u in pos:
                ux, uy = pos[u]
                parts.append(f'<line x1="{ux + BOX_W}" y1="{uy + BOX_H // 2}" x2="{x}" '
                             f'y2="{y + BOX_H // 2}" stroke="#555" marker-end="url(#arrow)"/>')
    for s in steps:
        x, y = pos[s.name]
        colour = COLOURS[family(s.state)]
        parts.append(
            f'<g class="step" data-step="{escape(s.name)}" data-state="{escape(s.state)}">'
            f'<rect x="{x}" y="{y}" width="{BOX_W}" height="{BOX_H}" rx="6" fill="{colour}"/>'
            f'<text x="{x + 8}" y="{y + 19}" fill="white" font-size="13" '
            f'font-weight="bold">{escape(s.name[:22])}</text>'
            f'<text x="{x + 8}" y="{y + 37}" fill="white" font-size="11">'
            f'{escape(s.state)} · job {s.job_id}</text></g>'
        )
    parts.append("</svg>")
    return "".join(parts)
