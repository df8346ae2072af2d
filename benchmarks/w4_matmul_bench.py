"""w4 matmul kernel on the GPU: correctness on Llama-3-8B shapes, then timing vs the jnp dequant path
and a bf16 matmul of the same shape.

Run on the GPU machine:  python benchmarks/w4_matmul_bench.py [--sweep] [--tokens 1 16]
On CPU:                  python benchmarks/w4_matmul_bench.py --smoke   (interpret mode, tiny shapes)

check   kernel vs w4_matmul_reference (float32 algebra), bf16, T = 1 and 16, every shape.
time    per shape and T: kernel, jnp (x @ dequantize_w4(...), what QuantLinear did), bf16 x @ w;
        GB/s counts the packed weight + scale + offset bytes; "vs bf16" = bf16 time / kernel time.
        The last rows sum one 8B decoder layer (q, k, v, o, gate, up, down).
sweep   (--sweep) block_o x num_splits x num_warps at T = 1 for every shape; best config per shape.
"""
from __future__ import annotations

import argparse
import functools
import itertools
import sys

import jax
import jax.numpy as jnp
import numpy as np

sys.path.insert(0, __file__.rsplit("/benchmarks/", 1)[0])
from benchmarks.kernels import _TIMER, _time_wall, bench  # noqa: E402
from lmjax.layers.quant import dequantize_w4, quantize_w4  # noqa: E402
from pallas_kernels import w4_matmul as wm  # noqa: E402

GROUP = 128
# (I, O) of Llama-3-8B's linears and how many of each a decoder layer holds
SHAPES_8B = {(4096, 4096): 2, (4096, 1024): 2, (4096, 14336): 2, (14336, 4096): 1}
SHAPES_SMOKE = {(256, 128): 1, (576, 200): 1}


def make_weights(I, O, seed=0):
    """Random bf16 weights, their w4 quantization, on the device."""
    key = jax.random.PRNGKey(seed)
    w_IO = (jax.random.normal(key, (I, O), jnp.float32) * 0.02)
    packed, scale, offset = jax.jit(quantize_w4, static_argnums=1)(w_IO, GROUP)
    return w_IO.astype(jnp.bfloat16), packed, scale.astype(jnp.bfloat16), offset.astype(jnp.bfloat16)


def make_x(T, I, seed=1):
    return jax.random.normal(jax.random.PRNGKey(seed), (T, I), jnp.float32).astype(jnp.bfloat16)


def rel_err(out, ref):
    out, ref = np.asarray(out, np.float64), np.asarray(ref, np.float64)
    return float(np.linalg.norm(out - ref) / np.linalg.norm(ref)), bool(np.isfinite(out).all())


def kernel_fn(interpret, config=None):
    return jax.jit(functools.partial(wm.w4_matmul_kernel, group_size=GROUP, interpret=interpret, config=config))


@jax.jit
def jnp_dequant_matmul(x_TI, packed_JO, scale_gO, offset_gO):
    return x_TI @ dequantize_w4(packed_JO, scale_gO, offset_gO, GROUP, x_TI.dtype)


@jax.jit
def bf16_matmul(x_TI, w_IO):
    return x_TI @ w_IO


def check(shapes, tokens, interpret) -> bool:
    """Kernel and reference (bf16 out) vs x @ dequantize_w4 in float32."""
    ok = True
    ref = jax.jit(functools.partial(wm.w4_matmul_reference, group_size=GROUP))
    for (I, O), T in itertools.product(shapes, tokens):
        _, *quant = make_weights(I, O)
        x = make_x(T, I)
        dense = dense_f32(x, *quant)
        err, finite = rel_err(kernel_fn(interpret)(x, *quant), dense)
        ref_err, _ = rel_err(ref(x, *quant), dense)
        good = finite and err < 1e-2
        ok &= good
        print(f"check I={I:6d} O={O:6d} T={T:3d}  kernel rel_err={err:.2e}  reference rel_err={ref_err:.2e}  "
              f"{'ok' if good else 'FAIL'}")
    return ok


@jax.jit
def dense_f32(x_TI, packed_JO, scale_gO, offset_gO):
    w_IO = dequantize_w4(packed_JO, scale_gO, offset_gO, GROUP, jnp.float32)
    return jnp.matmul(x_TI.astype(jnp.float32), w_IO, precision=jax.lax.Precision.HIGHEST)


def timer(interpret):
    # interpret mode (CPU smoke) has no CUPTI: plain wall clock, few iterations
    return (lambda fn, *args: _time_wall(fn, args, 2)) if interpret else (
        lambda fn, *args: bench(fn, *args, iterations=50))


def time_shapes(shapes, tokens, interpret):
    t = timer(interpret)
    print(f"\n{'I':>6} {'O':>6} {'T':>3} {'kernel us':>10} {'GB/s':>7} {'jnp us':>9} {'bf16 us':>8} "
          f"{'vs bf16':>8} {'vs jnp':>7}")
    layer = {T: [0.0, 0.0, 0.0] for T in tokens}
    for (I, O), count in shapes.items():
        w_IO, *quant = make_weights(I, O)
        for T in tokens:
            x = make_x(T, I)
            tk = t(kernel_fn(interpret), x, *quant)
            tj = t(jnp_dequant_matmul, x, *quant)
            tb = t(bf16_matmul, x, w_IO)
            gbs = wm.packed_bytes(I, O, GROUP) / tk / 1e9
            print(f"{I:6d} {O:6d} {T:3d} {tk * 1e6:10.1f} {gbs:7.0f} {tj * 1e6:9.1f} {tb * 1e6:8.1f} "
                  f"{tb / tk:7.2f}x {tj / tk:6.1f}x")
            for i, v in enumerate((tk, tj, tb)):
                layer[T][i] += count * v
    for T, (tk, tj, tb) in layer.items():
        print(f"one decoder layer, T={T}: kernel {tk * 1e6:.0f} us, jnp {tj * 1e6:.0f} us, bf16 {tb * 1e6:.0f} us"
              f" -> {tb / tk:.2f}x faster than bf16")


def sweep(shapes, interpret):
    t = timer(interpret)
    x_cache = {}
    for I, O in shapes:
        _, *quant = make_weights(I, O)
        x = x_cache.setdefault(I, make_x(1, I))
        groups = -(-I // GROUP)
        results = []
        for block_o, splits, warps in itertools.product((64, 128, 256), (1, 2, 4, 8, 16, 32), (4, 8)):
            if splits > groups or (block_o == 256 and warps == 4):
                continue
            cfg = dict(block_o=block_o, num_splits=splits, num_warps=warps)
            try:
                results.append((t(kernel_fn(interpret, cfg), x, *quant), cfg))
            except Exception as e:  # noqa: BLE001 - a config Triton cannot compile is skipped
                print(f"  I={I} O={O} {cfg}: {type(e).__name__}: {str(e)[:80]}")
        results.sort(key=lambda r: r[0])
        auto = wm._choose_config(1, I // 2, O, groups, on_gpu=not interpret)
        print(f"sweep I={I:6d} O={O:6d} auto=(block_o={auto['block_o']}, splits={auto['num_splits']}); best:")
        for sec, cfg in results[:3]:
            print(f"    {sec * 1e6:8.1f} us  {wm.packed_bytes(I, O, GROUP) / sec / 1e9:6.0f} GB/s  {cfg}")


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--smoke", action="store_true", help="CPU: interpret mode, tiny shapes")
    ap.add_argument("--sweep", action="store_true")
    ap.add_argument("--tokens", type=int, nargs="+", default=[1, 16])
    args = ap.parse_args()
    interpret = args.smoke or jax.default_backend() != "gpu"
    shapes = SHAPES_SMOKE if args.smoke else SHAPES_8B
    print(f"# {jax.devices()[0].device_kind}, jax {jax.__version__}, interpret={interpret}")
    ok = check(shapes, args.tokens, interpret)
    time_shapes(shapes, args.tokens, interpret)
    if args.sweep:
        sweep(shapes, interpret)
    print(f"# timer calls: {_TIMER}")
    sys.exit(0 if ok else 1)


if __name__ == "__main__":
    main()
