"""The version ceiling: in a shard's data directory, a bound on every version the shard
has published of each fragment, kept across restarts.

A shard back without its state takes a fragment's values from a learner's anchor, which
carries the version it claims. No learner can hold a version the shard never published,
so an anchor above the ceiling is refused. The file is rewritten (atomically, fsynced)
only when a fragment's version passes its ceiling, which it then sets ``CEILING_STRIDE``
versions ahead: once per ``CEILING_STRIDE`` rounds of a fragment, before the round's
replies go out. The ceiling is therefore at most ``CEILING_STRIDE`` above the newest
version published.
"""

from __future__ import annotations

import json
import logging
from pathlib import Path

from diloco.errors import InvalidArgument
from diloco.files import atomic_write_json

logger = logging.getLogger(__name__)

CEILING_STRIDE = 64
"""How far ahead of a fragment's version its ceiling is set each time it is written."""


def ceiling_name(shard_id: int) -> str:
    """In a shard's data directory: its fragments' version ceilings (JSON)."""
    return f"ceiling-S{shard_id}.json"


class VersionCeiling:
    """Each fragment's ceiling, as read from and written to ``path`` (None: not kept)."""

    def __init__(self, path: Path | None) -> None:
        self.path = path
        self.ceilings: dict[int, int] = {}
        if path is not None and path.is_file():
            try:
                raw = json.loads(path.read_text())
                self.ceilings = {int(f): int(v) for f, v in raw.items()}
            except (ValueError, TypeError, AttributeError) as error:
                raise InvalidArgument(f"{path} is not a version ceiling file ({error}): remove it to start without one") from None

    def of(self, fragment_id: int) -> int | None:
        """The most a fragment's anchor may claim (None: no ceiling was ever written)."""
        return self.ceilings.get(fragment_id)

    def advance(self, fragment_id: int, version: int) -> None:
        """The shard is about to publish ``version`` of the fragment."""
        if self.path is None or version <= self.ceilings.get(fragment_id, -1):
            return
        self.ceilings[fragment_id] = version + CEILING_STRIDE
        atomic_write_json(self.path, {str(f): v for f, v in sorted(self.ceilings.items())})
