"""kvroute's prefix index: pure and synchronous (no I/O, no asyncio, never imports ``app``).

``PrefixIndex`` keeps, for many workers, which content blocks each one holds in which
medium, and answers how many consecutive blocks of a prompt each worker has cached.
"""

from kvroute.index.prefix_index import PrefixIndex
from kvroute.index.results import IndexStats, Match

__all__ = ["IndexStats", "Match", "PrefixIndex"]
