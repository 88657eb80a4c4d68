"""Progress bars for long single operations, shown only when stderr is a terminal."""

from __future__ import annotations

import sys
from typing import Iterable, Optional, TypeVar

T = TypeVar("T")


def progress(items: Iterable[T], desc: str, total: Optional[int] = None,
             unit: str = "it") -> Iterable[T]:
    """``items`` wrapped in a tqdm bar on stderr when stderr is a terminal, else unchanged (logs
    and pipes get no bar characters)."""
    if not sys.stderr.isatty():
        return items
    from tqdm import tqdm

    return tqdm(items, desc=desc, total=total, unit=unit, leave=False)
