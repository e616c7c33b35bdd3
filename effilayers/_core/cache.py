"""A small least-recently-used cache for the device tables the Triton
wrappers build (DenseNet's map tables, Adam's parameter and tile tables).

Shared by threads (DataParallel replicas, threaded inference call the same
op at once), so lookups and evictions hold one lock; building an entry
happens outside it (it copies to the device), so two threads that miss the
same key may both build it, and the second entry simply replaces the first.
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from typing import Any, Callable, Hashable


class TableCache:
    def __init__(self, entries: int) -> None:
        if entries < 1:
            raise ValueError(f"TableCache: entries must be >= 1, got {entries}")
        self.entries = entries
        self._map: "OrderedDict[Hashable, Any]" = OrderedDict()
        self._lock = threading.Lock()

    def get(self, key: Hashable, build: Callable[[], Any]) -> Any:
        """The entry for ``key``, built by ``build()`` on a miss."""
        with self._lock:
            entry = self._map.get(key)
            if entry is not None:
                self._map.move_to_end(key)
                return entry
        entry = build()
        with self._lock:
            self._map[key] = entry
            self._map.move_to_end(key)
            while len(self._map) > self.entries:
                self._map.popitem(last=False)
        return entry

    def clear(self) -> None:
        with self._lock:
            self._map.clear()

    def __len__(self) -> int:
        return len(self._map)

    def __contains__(self, key: Hashable) -> bool:
        return key in self._map
