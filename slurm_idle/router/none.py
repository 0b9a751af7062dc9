"""`router: none`: nobody is told. Today's behaviour: clients may see errors while a replica
drains and stops (a health-checking router keeps sending to a sleeping vLLM, whose /health
still answers 200)."""

from __future__ import annotations

from collections.abc import Sequence

from slurm_idle.router import UNKNOWN, RouterTarget

WARNING = ("router: none: no router is told before a replica stops; clients may see errors "
           "at every lend (set `router:` in the config, see docs/admin.md 'The request router')")


class NoRouter:
    kind = "none"

    def remove(self, target: RouterTarget) -> None:
        return None

    def add(self, target: RouterTarget) -> None:
        return None

    def state(self, targets: Sequence[RouterTarget]) -> dict[str, str]:
        return {t.name: UNKNOWN for t in targets}
