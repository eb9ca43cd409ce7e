"""What piecegraph's own Triton kernels share: whether Triton imports here (it is optional: CPU installs and CI have
none, so every kernel imports it only when it runs) and the power-of-two tile a size rounds up to."""

from __future__ import annotations

import functools


@functools.cache
def triton_available() -> bool:
    """Whether Triton imports here."""
    try:
        import triton  # noqa: F401
    except ImportError:
        return False
    return True


def next_power_of_two(n: int) -> int:
    """The smallest power of two ``>= n`` (1 for ``n <= 1``): Triton's block sizes must be powers of two."""
    return 1 << max(n - 1, 0).bit_length()
