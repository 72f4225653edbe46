"""Storage tiers and the packed reference counts kept per holding.

A holding's reference counts for the three tiers live in one Python int, 32 bits per tier
(GPU in the low bits, then CPU, then STORAGE), so that the overwhelmingly common state,
"stored once on GPU", is the small int 1 and needs no per-holding entry at all: containers
store a packed count only when it differs from ``GPU_ONCE``.

Invariants:
- tier numbers are ordered fastest first: GPU=0 < CPU=1 < STORAGE=2;
- a packed count is never negative and no field exceeds ``FIELD_MASK`` (a refcount
  reaching 2**32 - 1 is refused with ``ValueError`` rather than carried into the next tier).
"""

from __future__ import annotations

GPU, CPU, STORAGE = 0, 1, 2
TIER_NAMES: tuple[str, str, str] = ("GPU", "CPU", "STORAGE")
FIELD_BITS = 32
FIELD_MASK = (1 << FIELD_BITS) - 1
UNITS: tuple[int, int, int] = (1, 1 << FIELD_BITS, 1 << (2 * FIELD_BITS))
GPU_ONCE = UNITS[GPU]

# Exact spellings -> tier; hot paths look up here first and fall back to tier_of().
TIER_OF: dict[str | None, int] = {None: GPU}
for _number, _name in enumerate(TIER_NAMES):
    TIER_OF[_name] = _number
    TIER_OF[_name.lower()] = _number


def tier_of(medium: str | None) -> int:
    """The tier number of a vLLM ``medium`` (None means GPU; any letter case is accepted)."""
    tier = TIER_OF.get(medium)  # type: ignore[arg-type]
    if tier is not None:
        return tier
    if isinstance(medium, str):
        tier = TIER_OF.get(medium.upper())
        if tier is not None:
            return tier
    raise ValueError(f"unknown medium {medium!r}: expected one of GPU, CPU, STORAGE or None")


def count_in(packed: int, tier: int) -> int:
    """The reference count of one tier inside a packed count."""
    return (packed >> (tier * FIELD_BITS)) & FIELD_MASK


def fastest(packed: int) -> int | None:
    """The fastest tier with a non-zero count, or None when nothing is held."""
    if packed & FIELD_MASK:
        return GPU
    if (packed >> FIELD_BITS) & FIELD_MASK:
        return CPU
    if packed:
        return STORAGE
    return None
