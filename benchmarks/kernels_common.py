"""What every section of benchmarks/kernels.py shares: kernel timing (CUPTI, else wall clock), the
measured ceilings, random paged inputs, our kernel, error and percent-of-ceiling arithmetic, the results
collected for --json and the markdown table printer. Shape letters as in
pallas_kernels/ragged_paged_attention.py."""
from __future__ import annotations

import functools
import statistics
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np

sys.path.insert(0, __file__.rsplit("/benchmarks/", 1)[0])
from pallas_kernels import ragged_paged_attention as rpa  # noqa: E402

HEADS = {"llama3-8b": (32, 8, 128), "llama3.2-1b": (32, 8, 64)}
BLOCK_SIZE = 16
RESULTS: dict = {}
# Per-kernel CUPTI breakdowns run last: after one, CUPTI timing stops working.
BREAKDOWNS: list = []


# ---------------------------------------------------------------- timing
def _time_cupti(fn, args, iterations):
    from jax.experimental.mosaic.gpu import profiler
    _, times_ms = profiler.measure(fn, iterations=iterations)(*args)
    return statistics.median(times_ms) * 1e-3


def _time_wall(fn, args, iterations):
    jax.block_until_ready(fn(*args))
    samples = []
    for _ in range(5):
        start = time.perf_counter()
        for _ in range(iterations):
            out = fn(*args)
        jax.block_until_ready(out)
        samples.append((time.perf_counter() - start) / iterations)
    return statistics.median(samples)


_TIMER = {"cupti": 0, "wall": 0}


def bench(fn, *args, iterations=20) -> float:
    """Median seconds per call of a jitted fn (warmed up first).

    CUPTI sums the GPU time of the call's kernels; a call that launches no
    kernel (a plain device memcpy) or a CUPTI failure falls back, for that
    call only, to wall clock around async dispatches (which is dispatch-bound
    below ~50 us on the device machine).
    """
    jax.block_until_ready(fn(*args))
    jax.block_until_ready(fn(*args))
    try:
        t = _time_cupti(fn, args, iterations)
        _TIMER["cupti"] += 1
        return t
    except Exception as e:  # noqa: BLE001 - CUPTI may be unavailable
        print(f"# CUPTI timing failed ({type(e).__name__}: {str(e)[:80]}); wall clock")
    _TIMER["wall"] += 1
    return _time_wall(fn, args, iterations)


# ---------------------------------------------------------------- ceilings
def measure_copy_bandwidth() -> tuple[float, dict]:
    """The device's copy bandwidth (bytes read + written a second): the best of a few device copies
    (XLA's bf16 elementwise kernel alone reads low), and each copy's figure."""
    x = jax.random.bits(jax.random.key(0), (1 << 29,), jnp.uint32)  # 2 GiB
    copies = {
        "u32 x+1, 2 GiB": (jax.jit(lambda a: a + 1), x),
        "bf16 x+1, 1 GiB": (jax.jit(lambda a: a + 1),
                            jax.random.normal(jax.random.key(0), (1 << 29,), jnp.bfloat16)),
    }
    bandwidths = {}
    for name, (fn, arg) in copies.items():
        bandwidths[name] = 2 * arg.nbytes / bench(fn, arg, iterations=10)
    return max(bandwidths.values()), bandwidths


def measure_ceilings():
    """Copy bandwidth (measure_copy_bandwidth); bf16 matmul rate on random data."""
    copy_bw, bandwidths = measure_copy_bandwidth()
    n = 8192
    a = jax.random.normal(jax.random.key(1), (n, n), jnp.bfloat16)
    b = jax.random.normal(jax.random.key(2), (n, n), jnp.bfloat16)
    mm = jax.jit(lambda a, b: a @ b)
    t = bench(mm, a, b, iterations=10)
    mm_rate = 2 * n ** 3 / t
    RESULTS["ceilings"] = dict(copy_bytes_per_s=copy_bw, copies=bandwidths, bf16_matmul_flops=mm_rate)
    print("copies (read+write):", {k: f"{v / 1e12:.3f} TB/s" for k, v in bandwidths.items()})
    print(f"ceilings: copy {copy_bw / 1e12:.3f} TB/s; bf16 matmul {mm_rate / 1e12:.1f} TFLOP/s")
    return copy_bw, mm_rate


def kernel_breakdown(name, fn, args):
    """Per-kernel GPU times of one call (CUPTI), to see the op's small side kernels."""
    try:
        from jax.experimental.mosaic.gpu import profiler
        jax.block_until_ready(fn(*args))
        _, per_iter = profiler.measure(fn, aggregate=False, iterations=3)(*args)
        kernels = per_iter[-1]
        RESULTS[f"breakdown_{name}"] = kernels
        print(f"kernels of {name}: " + "; ".join(f"{k[:48]} {ms * 1e3:.1f} us" for k, ms in kernels))
    except Exception as e:  # noqa: BLE001
        print(f"breakdown {name} failed: {type(e).__name__}: {e}")


# ---------------------------------------------------------------- inputs
def paged_inputs(seed, q_lens, kv_lens, num_q_heads, num_kv_heads, head_dim, block_size,
                 dtype=jnp.bfloat16):
    """Random ragged batch over a cache with shuffled blocks (block 0 = sink)."""
    rng = np.random.default_rng(seed)
    blocks_B = [-(-kv // block_size) for kv in kv_lens]
    max_blocks = max(blocks_B)
    num_blocks = 1 + sum(blocks_B)
    ids = rng.permutation(np.arange(1, num_blocks)).astype(np.int32)
    tables_BM = np.zeros((len(kv_lens), max_blocks), np.int32)
    used = 0
    for b, n in enumerate(blocks_B):
        tables_BM[b, :n] = ids[used:used + n]
        used += n
    keys = jax.random.split(jax.random.key(seed), 3)
    shape = (num_blocks, block_size, num_kv_heads, head_dim)
    k_PSKH = jax.random.normal(keys[0], shape, dtype)
    v_PSKH = jax.random.normal(keys[1], shape, dtype)
    q_TNH = jax.random.normal(keys[2], (sum(q_lens), num_q_heads, head_dim), dtype)
    cu_B1 = np.concatenate([[0], np.cumsum(q_lens)]).astype(np.int32)
    return (q_TNH, k_PSKH, v_PSKH, jnp.asarray(kv_lens, jnp.int32), jnp.asarray(tables_BM),
            jnp.asarray(cu_B1))


def ours(sm_scale, config=None):
    return jax.jit(functools.partial(rpa.ragged_paged_attention_kernel, sm_scale=sm_scale,
                                     config=config))


def rel_err(out, ref):
    out, ref = np.asarray(out, np.float32), np.asarray(ref, np.float32)
    return float(np.linalg.norm(out - ref) / np.linalg.norm(ref))


# ---------------------------------------------------------------- reporting
def run_rows(name: str, cases, measure, line) -> list:
    """A section's rows: measure(*case) for each case, printed as line(row) as soon as it is measured;
    RESULTS[name] holds them all."""
    rows = []
    for case in cases:
        row = measure(*case)
        rows.append(row)
        print(line(row), flush=True)
    RESULTS[name] = rows
    return rows


def add_percents(row: dict, impls, name: str, work: float, ceiling: float) -> None:
    """row[f"{impl}_{name}"] = percent of `ceiling` (work per second) each impl's row[f"{impl}_s"] reaches."""
    for impl in impls:
        row[f"{impl}_{name}"] = 100 * work / row[f"{impl}_s"] / ceiling


def column(header: str, key: str, fmt: str = "", scale: float = 1.0):
    """A print_table column: row[key] (times `scale` when one is given) formatted by `fmt`."""
    return header, (lambda r: format(r[key], fmt)) if scale == 1.0 else (lambda r: format(r[key] * scale, fmt))


def print_table(columns, rows) -> None:
    """A markdown table after a blank line: `columns` are (header, cell of a row as text) pairs."""
    print("\n| " + " | ".join(header for header, _ in columns) + " |")
    print("|" + "---|" * len(columns))
    for r in rows:
        print("| " + " | ".join(cell(r) for _, cell in columns) + " |")
