"""Per-replica engine identity: a secret second served model name.

A model name in `/v1/models` proves nothing: any process that binds a replica's port (a job's
process left on the node) can list it. So each replica's engine is started with a name only
the agent knows, `slurm-idle-<random>` (the `{identity}` placeholder of the start command,
given to vLLM as a second `--served-model-name` after the model's own, which vLLM lists in
`/v1/models` like every served name; metrics keep the first). The name is kept in a root-only
directory beside the journal and replaced after each stop, so a name a client once saw through
the router's `/v1/models` is dead by the time the replica starts again.
"""

from __future__ import annotations

import os
import re
import secrets
from pathlib import Path

from slurm_idle import safefiles
from slurm_idle.errors import EngineError

PREFIX = "slurm-idle-"
#: The directory beside the journal holding one file per replica (0700, files 0600).
DIR_NAME = "engine-identity"


def identity_dir(journal: str) -> Path:
    """Where the identities live: beside the journal, in the agent's own state directory."""
    return Path(journal).parent / DIR_NAME


def _file_name(replica: str) -> str:
    return re.sub(r"[^A-Za-z0-9_.-]", "_", replica or "replica")


class IdentityStore:
    """The secret served name of each replica, by replica name."""

    def __init__(self, directory: str | os.PathLike[str]) -> None:
        self.directory = Path(directory)

    def current(self, replica: str) -> str | None:
        """The replica's name now; None when none was issued yet (an engine started before
        identities existed, or never started by us). EngineError when it cannot be read."""
        try:
            text = safefiles.read_text(self.directory / _file_name(replica))
        except OSError as exc:
            raise EngineError(f"cannot read the engine identity of {replica}: {exc}") from None
        name = (text or "").strip()
        return name if name.startswith(PREFIX) else None

    def issue(self, replica: str) -> str:
        """The replica's name, made now when it has none."""
        return self.current(replica) or self.rotate(replica)

    def rotate(self, replica: str) -> str:
        """A new name for the replica (after its engine stopped: the old one is never valid
        again)."""
        name = PREFIX + secrets.token_hex(16)
        try:
            with safefiles.checked_dir(self.directory, 0o700) as dfd:
                os.fchmod(dfd, 0o700)  # root-only, whatever the umask or an older mode
            safefiles.atomic_write(self.directory / _file_name(replica), name + "\n", mode=0o600)
        except (OSError, safefiles.UnsafePath) as exc:
            raise EngineError(f"cannot write the engine identity of {replica}: {exc}") from None
        return name
