"""Argument checks shared by the utils modules: one message format everywhere."""

from __future__ import annotations

import numbers


def check_int(name: str, value, *, minimum: int | None = None,
              maximum: int | None = None) -> int:
    """Return ``value`` as an int, or raise ``TypeError``/``ValueError``
    naming ``name``.

    Booleans are rejected even though ``bool`` is a subclass of ``int``: ``rank=True``
    is a bug.
    """
    if isinstance(value, bool) or not isinstance(value, numbers.Integral):
        raise TypeError(f"{name} must be an integer, "
                        f"got {value!r} of type {type(value).__name__}")
    value = int(value)
    if minimum is not None and value < minimum:
        raise ValueError(f"{name}={value} is out of range; "
                         f"expected {name} >= {minimum}")
    if maximum is not None and value > maximum:
        raise ValueError(f"{name}={value} is out of range; "
                         f"expected {name} <= {maximum}")
    return value


def check_rank(rank, num_replicas: int) -> int:
    """Check that ``0 <= rank < num_replicas`` and return ``rank`` as an int."""
    rank = check_int("rank", rank)
    if not 0 <= rank < num_replicas:
        raise ValueError(
            f"rank={rank} is out of range for num_replicas={num_replicas}; "
            f"expected 0 <= rank < {num_replicas}"
        )
    return rank


def check_bool(name: str, value) -> bool:
    """Return ``value`` if it is a bool, else raise ``TypeError`` naming ``name``."""
    if not isinstance(value, bool):
        raise TypeError(f"{name} must be True or False, got {value!r}")
    return value
