"""Argument checks shared by the Pallas kernels and their jnp references.

Every error names the offending value (``f"{name}={value!r} ..."``) so that a
caller can see at once which argument is wrong. Only static properties
(shapes, dtypes, Python scalars) are checked: the functions run at trace time.
"""
from __future__ import annotations


def require(cond: bool, message: str) -> None:
    """Raise ValueError(message) unless cond holds."""
    if not cond:
        raise ValueError(message)


def require_rank(name: str, x, rank: int, letters: str) -> None:
    require(
        x.ndim == rank,
        f"{name}.shape={tuple(x.shape)} must have rank {rank} ({letters})",
    )


def require_dtype(name: str, x, allowed) -> None:
    """allowed: dtype names such as ("float32", "bfloat16")."""
    require(
        str(x.dtype) in allowed,
        f"{name}.dtype={x.dtype} must be one of {tuple(allowed)}",
    )


def require_dim(name: str, x, axis: int, expected: int, what: str) -> None:
    require(
        x.shape[axis] == expected,
        f"{name}.shape={tuple(x.shape)}: axis {axis} must be {what}={expected}",
    )


def is_power_of_two(n: int) -> bool:
    return n > 0 and (n & (n - 1)) == 0


IMPLS = ("auto", "kernel", "reference")  # every op's impl choices ("auto": the kernel on GPU)


def require_impl(impl, impls: tuple[str, ...] = IMPLS) -> None:
    require(impl in impls, f"impl={impl!r} must be one of {impls}")
