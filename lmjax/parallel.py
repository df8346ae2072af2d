"""Tensor parallelism: a device mesh and logical-axis sharding rules, kept apart from the model code.

Data flow with tp > 1: `make_mesh(tp)` -> `check_tp(cfg, tp)` (a head count that does not fit is an
error naming it) -> `make_placer(mesh, cfg)` given to the loader, which puts each checkpoint tensor
straight into its shards (`jax.make_array_from_callback`: every device receives only its slice; no
device ever holds the whole model) -> `make_kv_caches(cfg, ..., mesh)` allocates the paged cache
already sharded on KV heads -> the jitted step runs under `jax.set_mesh(mesh)` (`use_mesh`): XLA
(GSPMD) inserts the all-reduces after the row-parallel o_proj/down_proj and gathers the vocab-parallel
logits, and `lmjax.layers.attention` wraps the attention op in `shard_map` so each device attends its
own heads.

Sharding is two tables, both public so a notebook can shard a model its own way:
  PARAM_AXES     parameter path (regex on "layers.3.self_attn.q_proj.kernel") -> logical axis names
  DEFAULT_RULES  logical axis name -> mesh axis (None: replicated)
Column-parallel q/k/v and gate/up (output dim), row-parallel o and down (input dim, XLA reduces),
vocab-parallel embedding and lm_head, norms replicated. A dimension that the mesh axis does not
divide is replicated instead (k/v projections when there are fewer KV heads than devices).

KV heads when K % tp != 0: the cache stores each KV head r times (K * r = lcm(K, tp) cache heads,
sharded over tp), so each device keeps only the heads its query heads read: memory per device is
that of K == tp, not a full replica. q head n still reads KV head n // (N / K) (see `kv_cache_heads`).

Across hosts: `initialize_distributed()` (flags or LMJAX_/JAX_ environment variables) joins the
processes before the mesh is built over all their devices. Then either every process runs the same
engine calls (deterministic scheduling: same requests, same steps), or one scheduler drives them all:
process 0 calls `ModelRunner.lead()` and runs the engine, which sends each step's inputs
(`send_step`), while the other processes sit in `ModelRunner.follow()` (`receive_step`) running the
same SPMD step, until process 0 calls `release_followers()`.
"""
from __future__ import annotations

import argparse
import logging
import math
import os
import re
from collections.abc import Callable, Mapping, Sequence

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec

logger = logging.getLogger("lmjax.parallel")

TP_AXIS = "tp"

# Logical axis names per parameter, by path. Paths are NNX state paths joined with dots.
PARAM_AXES: list[tuple[str, tuple[str | None, ...]]] = [
    (r"embed_tokens\.embedding", ("vocab", "embed")),
    (r"lm_head\.kernel", ("embed", "vocab")),
    (r"lm_head\.bias", ("vocab",)),
    (r".*\.q_proj\.kernel", ("embed", "heads")),
    (r".*\.q_proj\.bias", ("heads",)),
    (r".*\.[kv]_proj\.kernel", ("embed", "kv_heads")),
    (r".*\.[kv]_proj\.bias", ("kv_heads",)),
    (r".*\.qkv_proj\.kernel", ("embed", "heads")),  # merged q/k/v in per-device blocks (lmjax.layers.merge)
    (r".*\.qkv_proj\.bias", ("heads",)),
    (r".*\.o_proj\.kernel", ("heads", "embed")),
    (r".*\.(gate|up)_proj\.kernel", ("embed", "mlp")),
    (r".*\.(gate|up)_proj\.bias", ("mlp",)),
    (r".*\.down_proj\.kernel", ("mlp", "embed")),
]
# Logical axis -> mesh axis. Anything not named here (embed, norms, o/down biases) is replicated.
DEFAULT_RULES: dict[str, str | None] = {"vocab": TP_AXIS, "heads": TP_AXIS, "kv_heads": TP_AXIS,
                                        "mlp": TP_AXIS, "embed": None}
# Logical axes of one layer's KV cache (k_PSKH / v_PSKH).
KV_CACHE_AXES = (None, None, "kv_heads", None)

Rules = Mapping[str, str | None]


# ---------------------------------------------------------------- mesh
def make_mesh(tp: int, devices: Sequence[jax.Device] | None = None) -> Mesh:
    """A 1-D mesh named "tp" over the first `tp` devices (of every process, after
    `initialize_distributed`)."""
    initialize_distributed()  # no-op unless LMJAX_/JAX_ coordinator variables are set
    devices = list(devices if devices is not None else jax.devices())
    if not 1 <= tp <= len(devices):
        raise ValueError(f"tp={tp} needs {tp} devices; {len(devices)} available "
                         f"({jax.process_count()} process(es), backend {jax.default_backend()!r})")
    left_out = sorted({d.process_index for d in devices} - {d.process_index for d in devices[:tp]})
    if left_out:  # a process with no device in the mesh holds no shard: it fails deep in placement
        raise ValueError(f"tp={tp} takes the first {tp} of {len(devices)} devices, none of process(es) {left_out} "
                         f"({jax.process_count()} processes): give tp={len(devices)} to use every process's "
                         "devices, or start fewer processes")
    return Mesh(np.array(devices[:tp]), (TP_AXIS,), axis_types=(jax.sharding.AxisType.Auto,))


def host_array(x: jax.Array, dtype=None) -> np.ndarray:
    """The whole of `x` on this host, also when it is sharded over devices of other processes (each process
    must then call this too, in the same order: a collective gather)."""
    if not getattr(x, "is_fully_addressable", True):
        from jax.experimental import multihost_utils

        x = multihost_utils.process_allgather(x, tiled=True)
    return np.asarray(x, dtype)


def tp_size(mesh: Mesh | None) -> int:
    return 1 if mesh is None or TP_AXIS not in mesh.axis_names else mesh.shape[TP_AXIS]


def use_mesh(mesh: Mesh | None):
    """Context manager under which a step is traced and run: `with use_mesh(mesh): step(...)`.
    The attention layer reads this mesh (jax's abstract mesh) to wrap its kernel in shard_map."""
    import contextlib

    return jax.set_mesh(mesh) if mesh is not None else contextlib.nullcontext()


def mesh_of(tree) -> Mesh | None:
    """The mesh the arrays of `tree` (a model, an nnx.State, caches) are sharded over, if any has
    more than one device; None for single-device arrays."""
    from flax import nnx

    if isinstance(tree, nnx.Module):
        tree = nnx.state(tree)
    for leaf in jax.tree.leaves(tree):
        sharding = getattr(leaf, "sharding", None)
        if isinstance(sharding, NamedSharding) and sharding.mesh.size > 1:
            return sharding.mesh
    return None


# ---------------------------------------------------------------- heads
def check_tp(cfg, tp: int) -> None:
    """Raise ValueError, naming the numbers, when the model's heads cannot be split over tp devices."""
    N = cfg.num_heads
    if N % tp:
        raise ValueError(f"num_attention_heads={N} is not divisible by tp={tp}: choose tp among "
                         f"{[d for d in range(1, N + 1) if N % d == 0]}")
    # K divides N (config) and tp divides N, so lcm(K, tp) divides N too: the KV cache heads fit.


def kv_cache_heads(num_kv_heads: int, tp: int) -> int:
    """Heads the KV cache stores: K itself when tp divides it, else lcm(K, tp) (each KV head repeated
    lcm / K times, so every device holds whole heads; cache head c holds KV head c // (lcm / K))."""
    return num_kv_heads if num_kv_heads % tp == 0 else math.lcm(num_kv_heads, tp)


# ---------------------------------------------------------------- parameter shardings
# A quantized layer's (lmjax.layers.quant) per-channel scale [O] and per-group scale / offset [groups, O]
# take its kernel's axes, the last ones first: the output axis shards like the kernel's columns, the
# groups like its input rows (row-parallel o / down), so no device holds another's scales.
QUANT_LEAVES = ("scale", "offset")


def logical_axes(path: tuple | str) -> tuple[str | None, ...] | None:
    """Logical axis names of the parameter at `path` (None: replicated, e.g. norms). A quantized layer's
    scale / offset get its kernel's (`QUANT_LEAVES`; `param_spec` keeps as many as the array has dims)."""
    name = path if isinstance(path, str) else ".".join(map(str, path))
    base, _, leaf = name.rpartition(".")
    if leaf in QUANT_LEAVES:
        name = f"{base}.kernel"
    for pattern, axes in PARAM_AXES:
        if re.fullmatch(pattern, name):
            return axes
    return None


def logical_to_spec(axes: Sequence[str | None] | None, shape: Sequence[int], mesh: Mesh,
                    rules: Rules = DEFAULT_RULES) -> PartitionSpec:
    """PartitionSpec for `shape`: each logical axis through `rules`; a dimension the mesh axis does
    not divide (or a mesh axis used twice) is replicated; a rule naming an axis that does not exist is an
    error (`check_rules`). Trailing replicated dims are dropped, so a fully replicated parameter gets
    PartitionSpec()."""
    check_rules(rules, mesh)
    if axes is None:
        return PartitionSpec()
    spec, used = [], set()
    for dim, name in zip(shape, axes):
        mesh_axis = rules.get(name) if name is not None else None
        if mesh_axis is None or mesh_axis in used or dim % mesh.shape[mesh_axis]:
            spec.append(None)
        else:
            spec.append(mesh_axis)
            used.add(mesh_axis)
    while spec and spec[-1] is None:
        spec.pop()
    return PartitionSpec(*spec)


def logical_axis_names() -> set[str]:
    """The logical axes rules may name: those of `PARAM_AXES` (read now: a notebook may extend it) and
    of the KV cache."""
    return {a for _, axes in PARAM_AXES for a in axes if a} | {a for a in KV_CACHE_AXES if a}


def check_rules(rules: Rules, mesh) -> None:
    """A ValueError naming a rule whose logical axis nothing has or whose mesh axis `mesh` lacks: either
    would leave the dimension replicated without a word (a typo such as {"heads": "model"} on a "tp" mesh)."""
    known = logical_axis_names()
    for name, mesh_axis in rules.items():
        if name not in known:
            raise ValueError(f"sharding rule {name!r}: {mesh_axis!r} names logical axis {name!r}, which no "
                             f"parameter has; logical axes: {sorted(known)}")
        if mesh_axis is not None and mesh_axis not in mesh.axis_names:
            raise ValueError(f"sharding rule {name!r}: {mesh_axis!r} names mesh axis {mesh_axis!r}, which the "
                             f"mesh lacks; its axes: {list(mesh.axis_names)} (None replicates)")


def param_spec(path: tuple | str, shape: Sequence[int], mesh: Mesh, cfg=None,
               rules: Rules = DEFAULT_RULES) -> PartitionSpec:
    """PartitionSpec of one parameter. With `cfg`, k/v projections are replicated when the KV heads do
    not split evenly over tp (the cache then repeats heads; see `kv_cache_heads`)."""
    axes = logical_axes(path)
    if axes is not None and len(axes) > len(shape):  # a w8 scale [O] of a kernel [I, O]
        axes = axes[len(axes) - len(shape):]
    if axes is not None and cfg is not None and "kv_heads" in axes and cfg.num_kv_heads % tp_size(mesh):
        axes = tuple(None if a == "kv_heads" else a for a in axes)
    return logical_to_spec(axes, shape, mesh, rules)


def place(array: np.ndarray, sharding: NamedSharding) -> jax.Array:
    """A global array from a host array, each device receiving only its own slice (works across
    processes: each process fills its addressable devices from its own copy)."""
    return jax.make_array_from_callback(array.shape, sharding, lambda index: array[index])


def make_placer(mesh: Mesh, cfg=None, rules: Rules = DEFAULT_RULES) -> Callable[[tuple, np.ndarray], jax.Array]:
    """A `placer(path, host_array)` for `lmjax.loader.weights.load_params`: straight into shards."""
    def placer(path: tuple, array: np.ndarray) -> jax.Array:
        return place(array, NamedSharding(mesh, param_spec(path, array.shape, mesh, cfg, rules)))
    return placer


def shard_model(model, mesh: Mesh, rules: Rules = DEFAULT_RULES, cfg=None):
    """Re-place an already built model's parameters by `rules` (for notebooks; the loader shards while
    it reads, which never needs the whole model on one device). Returns the model, updated in place."""
    from flax import nnx

    cfg = cfg if cfg is not None else getattr(model, "config", None)
    if cfg is not None:
        check_tp(cfg, tp_size(mesh))
    state = nnx.state(model)
    flat = nnx.to_flat_state(state)
    for path, var in flat:
        value = var[...]
        spec = param_spec(path, value.shape, mesh, cfg, rules)
        var.set_value(jax.device_put(value, NamedSharding(mesh, spec)))
    return model


def param_shardings(model, mesh: Mesh, rules: Rules = DEFAULT_RULES, cfg=None) -> dict[str, PartitionSpec]:
    """{dotted path: PartitionSpec} the rules give each parameter of `model` (for inspection)."""
    from flax import nnx

    cfg = cfg if cfg is not None else getattr(model, "config", None)
    return {".".join(map(str, p)): param_spec(p, v[...].shape, mesh, cfg, rules)
            for p, v in nnx.to_flat_state(nnx.state(model))}


def per_device_bytes(tree) -> dict[jax.Device, int]:
    """Bytes each addressable device holds of the arrays in `tree` (a model, state or caches)."""
    from flax import nnx

    if isinstance(tree, nnx.Module):
        tree = nnx.state(tree)
    out: dict = {}
    for leaf in jax.tree.leaves(tree):
        for shard in getattr(leaf, "addressable_shards", ()):
            out[shard.device] = out.get(shard.device, 0) + shard.data.nbytes
    return out


# ---------------------------------------------------------------- KV cache
def kv_cache_sharding(mesh: Mesh, rules: Rules = DEFAULT_RULES) -> NamedSharding:
    check_rules(rules, mesh)
    spec = [rules.get(a) if a else None for a in KV_CACHE_AXES]
    while spec and spec[-1] is None:  # as a step's donated output cache comes back: jit keys on the spelling, so
        spec.pop()  # P(.., 'tp', None) made warm-up's first program compile again in the middle of serving
    return NamedSharding(mesh, PartitionSpec(*spec))


def make_kv_caches(cfg, num_blocks: int, block_size: int, dtype, mesh: Mesh | None = None,
                   rules: Rules = DEFAULT_RULES) -> list[tuple[jax.Array, jax.Array]]:
    """Zeroed per-layer (k_PSKH, v_PSKH) caches, created already sharded on KV heads under `mesh`."""
    if mesh is None or tp_size(mesh) == 1:
        shape = (num_blocks, block_size, cfg.num_kv_heads, cfg.head_dim)
        return [(jnp.zeros(shape, dtype), jnp.zeros(shape, dtype)) for _ in range(cfg.num_layers)]
    shape = (num_blocks, block_size, kv_cache_heads(cfg.num_kv_heads, tp_size(mesh)), cfg.head_dim)
    zeros = jax.jit(lambda: jnp.zeros(shape, dtype), out_shardings=kv_cache_sharding(mesh, rules))
    return [(zeros(), zeros()) for _ in range(cfg.num_layers)]


def replicate(tree, mesh: Mesh | None):
    """Host (numpy) step inputs -> arrays replicated over the mesh (identical on every process)."""
    if mesh is None:
        return tree
    sharding = NamedSharding(mesh, PartitionSpec())
    if jax.process_count() == 1:
        return jax.device_put(tree, sharding)
    return jax.tree.map(lambda x: place(np.asarray(x), sharding), tree)


# ---------------------------------------------------------------- shard_map (jax spelling compat)
def shard_map(f, mesh, in_specs, out_specs):
    """`jax.shard_map` (jax >= 0.6) or `jax.experimental.shard_map.shard_map`, without replication
    checks (Pallas kernels inside carry no replication rules)."""
    if hasattr(jax, "shard_map"):
        return jax.shard_map(f, mesh=mesh, in_specs=in_specs, out_specs=out_specs, check_vma=False)
    from jax.experimental.shard_map import shard_map as legacy  # pragma: no cover - older jax

    return legacy(f, mesh=mesh, in_specs=in_specs, out_specs=out_specs, check_rep=False)


# ---------------------------------------------------------------- multi-host
from lmjax.step_broadcast import receive_step, send_step, send_stop  # noqa: E402,F401  (the leader's steps)

_ENV = {"coordinator_address": ("LMJAX_COORDINATOR_ADDRESS", "JAX_COORDINATOR_ADDRESS"),
        "num_processes": ("LMJAX_NUM_PROCESSES", "JAX_NUM_PROCESSES"),
        "process_id": ("LMJAX_PROCESS_ID", "JAX_PROCESS_ID")}
_initialized = False


def _from_env(name: str) -> str | None:
    return next((os.environ[v] for v in _ENV[name] if os.environ.get(v)), None)


def initialize_distributed(coordinator_address: str | None = None, num_processes: int | None = None,
                           process_id: int | None = None) -> bool:
    """Join this process to the others (`jax.distributed.initialize`), from the arguments or else the
    LMJAX_COORDINATOR_ADDRESS / LMJAX_NUM_PROCESSES / LMJAX_PROCESS_ID environment variables (JAX_*
    also read). Must run before anything touches a jax backend. Returns whether it initialized; a
    second call, or no coordinator given, does nothing."""
    global _initialized
    coordinator_address = coordinator_address or _from_env("coordinator_address")
    if _initialized or not coordinator_address:
        return False
    num = num_processes if num_processes is not None else _from_env("num_processes")
    pid = process_id if process_id is not None else _from_env("process_id")
    if num is None or pid is None:
        raise ValueError(f"coordinator {coordinator_address!r} given but num_processes={num} and "
                         f"process_id={pid}: give all three (flags or LMJAX_* environment variables)")
    if jax.config.jax_platforms in (None, "", "cpu") or os.environ.get("JAX_PLATFORMS") == "cpu":
        # CPU collectives across processes go through gloo.
        jax.config.update("jax_cpu_collectives_implementation", "gloo")
    jax.distributed.initialize(coordinator_address, int(num), int(pid))
    _initialized = True
    logger.info("process %d of %d joined %s: %d devices in all", jax.process_index(), jax.process_count(),
                coordinator_address, jax.device_count())
    return True


def add_distributed_arguments(parser: argparse.ArgumentParser) -> None:
    """--coordinator-address, --num-processes, --process-id on a script's own parser (`initialize_from_args`
    joins with them). The `lmjax` subcommands read the LMJAX_* environment variables instead."""
    parser.add_argument("--coordinator-address", default=None,
                        help="host:port of process 0, to join several processes (LMJAX_COORDINATOR_ADDRESS)")
    parser.add_argument("--num-processes", type=int, default=None, help="processes in all (LMJAX_NUM_PROCESSES)")
    parser.add_argument("--process-id", type=int, default=None, help="this process's rank (LMJAX_PROCESS_ID)")


def initialize_from_args(args: argparse.Namespace) -> bool:
    """`initialize_distributed` from the flags of `add_distributed_arguments` (environment as fallback)."""
    return initialize_distributed(args.coordinator_address, args.num_processes, args.process_id)
