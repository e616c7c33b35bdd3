"""The device-table cache of the Triton wrappers (effilayers/_core/cache.py)."""

import threading
import time
from collections import OrderedDict

import pytest

from effilayers._core.cache import TableCache


def test_least_recently_used_entry_goes_first():
    cache = TableCache(entries=2)
    built = []

    def build(key):
        return lambda: built.append(key) or f"table {key}"

    assert cache.get("a", build("a")) == "table a"
    assert cache.get("b", build("b")) == "table b"
    assert cache.get("a", build("a")) == "table a"  # a hit, and now the most recent
    assert cache.get("c", build("c")) == "table c"  # evicts b
    assert "a" in cache and "c" in cache and "b" not in cache and len(cache) == 2
    assert built == ["a", "b", "c"]


class _SlowLookups(OrderedDict):
    """Widens the window between a lookup and what follows it, where an
    unlocked cache lets another thread evict the key it just found."""

    def get(self, key, default=None):
        value = super().get(key, default)
        time.sleep(1e-4)
        return value


def test_threads_share_one_cache_without_errors():
    # An unlocked get-then-move_to_end raises KeyError here (checked against
    # the cache before the lock: 8 threads, every run).
    cache = TableCache(entries=2)
    cache._map = _SlowLookups()
    errors = []

    def worker(seed):
        try:
            for i in range(200):
                key = (seed + i) % 3
                assert cache.get(key, lambda: ("table", key)) == ("table", key)
        except Exception as error:  # noqa: BLE001 - reported below
            errors.append(error)

    threads = [threading.Thread(target=worker, args=(seed,)) for seed in range(8)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert errors == [] and len(cache) <= 2


def test_entries_must_be_positive():
    with pytest.raises(ValueError, match="entries must be >= 1, got 0"):
        TableCache(entries=0)
