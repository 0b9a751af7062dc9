"""`router: command`: the admin's own commands tell the router (a gateway's CLI, an API call
with curl, a service-discovery tool). Placeholders are shell-quoted like engine commands;
`state_command`, if set, prints what is in the router now (one name or url a line)."""

from __future__ import annotations

import re
import shlex
from collections.abc import Sequence

from slurm_idle.commands import CommandRunner, SubprocessRunner
from slurm_idle.config import RouterConfig
from slurm_idle.errors import CommandError, RouterError
from slurm_idle.router import IN, OUT, UNKNOWN, RouterTarget

_PLACEHOLDER = re.compile(r"\{(name|node|model|url|host|port)\}")


def format_router_command(template: str, target: RouterTarget) -> str:
    """Fill the placeholders with shell-quoted values; other braces stay as they are."""
    values = target.fields()
    return _PLACEHOLDER.sub(lambda m: shlex.quote(values[m.group(1)]), template)


class CommandRouter:
    kind = "command"

    def __init__(self, config: RouterConfig, runner: CommandRunner | None = None) -> None:
        self.config = config
        self.runner = runner or SubprocessRunner()

    def _run(self, template: str, target: RouterTarget | None = None) -> str:
        command = format_router_command(template, target) if target else template
        try:
            return self.runner.run(["sh", "-c", command], timeout=self.config.timeout_s).stdout
        except CommandError as exc:
            raise RouterError(f"router command: {exc}") from None

    def remove(self, target: RouterTarget) -> None:
        assert self.config.remove_command is not None
        self._run(self.config.remove_command, target)

    def add(self, target: RouterTarget) -> None:
        assert self.config.add_command is not None
        self._run(self.config.add_command, target)

    def state(self, targets: Sequence[RouterTarget]) -> dict[str, str]:
        if not self.config.state_command:
            return {t.name: UNKNOWN for t in targets}
        listed = {line.strip() for line in self._run(self.config.state_command).splitlines()}
        return {t.name: IN if (t.name in listed or t.url in listed) else OUT for t in targets}
