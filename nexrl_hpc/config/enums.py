"""``StrEnum`` on every supported Python: names that travel as their strings (config values,
statuses on the wire, status.json) and compare equal to them."""

from __future__ import annotations

import sys
from enum import Enum

if sys.version_info >= (3, 11):
    from enum import StrEnum
else:

    class StrEnum(str, Enum):
        """``enum.StrEnum`` (Python 3.11) for 3.10: a member is its value for ``str()``, ``==`` and json."""

        def __str__(self) -> str:
            return str(self.value)


__all__ = ["StrEnum"]
