"""One scheduler, many processes: process 0 (the leader) runs the engine and sends each step's host inputs to the
others (followers), which run the same jitted step on their devices (lmjax.engine.followers). Re-exported by
lmjax.parallel."""
from __future__ import annotations

from collections.abc import Mapping, Sequence

import jax
import numpy as np

# A step goes as a fixed-size int32 header (kind: 0 = stop, else the caller's step kind; the caller's static ints;
# every leaf's shape) then the leaves.
_HEADER_LEN = 256


def _broadcast(tree):
    from jax.experimental import multihost_utils

    return multihost_utils.broadcast_one_to_all(tree)


def send_step(tree, static: Sequence[int], kind: int = 1) -> None:
    """Leader: send one step of `kind` (>= 1: which jitted function the followers run), its numpy
    inputs `tree` and its static ints to every follower."""
    if kind < 1:
        raise ValueError(f"step kind={kind} must be >= 1 (0 means stop)")
    leaves = [np.asarray(x) for x in jax.tree.leaves(tree)]
    header = [kind, len(static), *static, len(leaves)]
    for leaf in leaves:
        if leaf.ndim > 2:
            raise ValueError(f"step inputs must have rank <= 2, got shape {leaf.shape}")
        header += [leaf.ndim, *leaf.shape, *[0] * (2 - leaf.ndim)]
    if len(header) > _HEADER_LEN:
        raise ValueError(f"step header of {len(header)} ints exceeds {_HEADER_LEN}")
    _broadcast(np.array(header + [0] * (_HEADER_LEN - len(header)), np.int32))
    _broadcast(leaves)


def send_stop() -> None:
    """Leader: release the followers from `receive_step` (their loop ends)."""
    _broadcast(np.zeros(_HEADER_LEN, np.int32))


def receive_step(templates: Mapping[int, object]):
    """Follower: the next step as (kind, tree shaped like `templates[kind]`, static ints), or None on
    stop. A template is any tree of arrays with the step's structure, leaf ranks and dtypes."""
    header = [int(x) for x in _broadcast(np.zeros(_HEADER_LEN, np.int32))]
    kind = header[0]
    if kind == 0:
        return None
    if kind not in templates:
        raise ValueError(f"leader sent a step of kind {kind}; this follower knows {sorted(templates)}")
    n_static = header[1]
    static, pos = header[2:2 + n_static], 2 + n_static
    leaves, treedef = jax.tree.flatten(templates[kind])
    if header[pos] != len(leaves):
        raise ValueError(f"leader sent {header[pos]} step inputs, this follower expects {len(leaves)}")
    zeros = []
    for i, leaf in enumerate(leaves):
        ndim, d0, d1 = header[pos + 1 + 3 * i:pos + 4 + 3 * i]
        zeros.append(np.zeros((d0, d1)[:ndim], np.asarray(leaf).dtype))
    received = [np.asarray(x) for x in _broadcast(zeros)]
    return kind, jax.tree.unflatten(treedef, received), static
