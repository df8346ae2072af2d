"""The LMJAX_* switches: engine choices read from the environment at trace time, so A/B runs of one
engine (benchmarks, parity checks) need no code change. One reader, so every bad value is named alike."""
from __future__ import annotations

import os


def env_choice(name: str, choices: tuple[str, ...], default: str, value: str | None = None,
               *, label: str | None = None) -> str:
    """`value` if given, else $`name` if set and non-empty, else `default`; it must be in `choices`.
    `label` names the argument `value` stands for (e.g. "norm impl") in the error."""
    value = value or os.environ.get(name) or default
    if value not in choices:
        where = f"{name} / {label}" if label else name
        raise ValueError(f"{where}={value!r} must be one of {choices}")
    return value
