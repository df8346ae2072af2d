"""w4 matmul kernel on the GPU: correctness on Llama-3-8B shapes, then timing of its two paths (gemv
for T <= 4, dot) vs the jnp dequant path and a bf16 matmul of the same shape.

Run on the GPU machine:  python benchmarks/w4_matmul_bench.py [--sweep] [--sweep-prefetch] [--sweep-dot] [--tokens 1 16]
On CPU:                  python benchmarks/w4_matmul_bench.py --smoke   (interpret mode, tiny shapes)

check   each path (gemv where T <= 4, dot) vs x @ dequantize_w4 in float32, bf16, every shape and T;
        the reference's error alongside.
time    per shape and T: gemv and dot paths, the dot path with int->float converts (dot-cvt), the gemv
        path in float32 (gemv-f32, its default before the bf16x2 PTX), jnp (x @ dequantize_w4(...)),
        bf16 x @ w; GB/s counts
        the packed weight + scale + offset bytes; "vs bf16" = bf16 time / best kernel path time.
        The last rows sum one 8B decoder layer (q, k, v, o, gate, up, down).
sweep   (--sweep) the gemv path at T = 1 for every shape, coordinate descent: block_o x rows x
        num_warps (auto splits), then num_splits x num_stages x prefetch around the best (and the
        tiles again under the best if it prefetches), then unpack; best
        configs per shape next to the heuristic's. (--sweep-prefetch) a shorter one: tiles x splits x
        prefetch near the heuristic's config. (--sweep-dot) the dot path: block_o x num_splits x num_warps.
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
from benchmarks.kernels_common import _TIMER, _time_wall, bench  # noqa: E402
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


def kernel_fn(interpret, config=None, path="auto"):
    return jax.jit(functools.partial(wm.w4_matmul_kernel, group_size=GROUP, interpret=interpret, config=config,
                                     path=path))


def paths_for(T):
    return ("gemv", "dot") if T <= wm.GEMV_MAX_T else ("dot",)


@jax.jit
def jnp_dequant_matmul(x_TI, packed_JO, scale_gO, offset_gO):
    return x_TI @ dequantize_w4(packed_JO, scale_gO, offset_gO, GROUP, x_TI.dtype)


@jax.jit
def bf16_matmul(x_TI, w_IO):
    return x_TI @ w_IO


def check(shapes, tokens, interpret) -> bool:
    """Each kernel path and the reference (bf16 out) vs x @ dequantize_w4 in float32."""
    ok = True
    ref = jax.jit(functools.partial(wm.w4_matmul_reference, group_size=GROUP))
    for (I, O), T in itertools.product(shapes, tokens):
        _, *quant = make_weights(I, O)
        x = make_x(T, I)
        dense = dense_f32(x, *quant)
        ref_err, _ = rel_err(ref(x, *quant), dense)
        for path in paths_for(T):
            err, finite = rel_err(kernel_fn(interpret, path=path)(x, *quant), dense)
            good = finite and err < 1e-2
            ok &= good
            print(f"check I={I:6d} O={O:6d} T={T:3d} {path:>4}  kernel rel_err={err:.2e}  "
                  f"reference rel_err={ref_err:.2e}  {'ok' if good else 'FAIL'}")
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
    print(f"\n{'I':>6} {'O':>6} {'T':>3} {'gemv us':>8} {'GB/s':>6} {'dot us':>8} {'GB/s':>6} {'dot-cvt':>8} "
          f"{'gemv-f32':>8} {'jnp us':>8} {'bf16 us':>8} {'vs bf16':>8} {'gemv/dot':>9}")
    names = ("gemv", "dot", "dot-cvt", "gemv-f32", "jnp", "bf16")
    layer = {T: dict.fromkeys(names, 0.0) for T in tokens}
    for (I, O), count in shapes.items():
        w_IO, *quant = make_weights(I, O)
        for T in tokens:
            x = make_x(T, I)
            sec = {path: t(kernel_fn(interpret, path=path), x, *quant) for path in paths_for(T)}
            # the dot path before its exponent trick (int->float converts) and the gemv path in float32
            # (before its packed bf16x2 PTX), as same-run baselines
            sec["dot-cvt"] = t(kernel_fn(interpret, {"unpack": "convert"}, "dot"), x, *quant)
            if "gemv" in sec:
                sec["gemv-f32"] = t(kernel_fn(interpret, {"unpack": "magic"}, "gemv"), x, *quant)
            sec["jnp"] = t(jnp_dequant_matmul, x, *quant)
            sec["bf16"] = t(bf16_matmul, x, w_IO)
            best = min(sec[p] for p in paths_for(T))
            cells = []
            for path in ("gemv", "dot"):
                if path in sec:
                    cells.append(f"{sec[path] * 1e6:8.1f} {wm.packed_bytes(I, O, GROUP) / sec[path] / 1e9:6.0f}")
                else:
                    cells.append(f"{'-':>8} {'-':>6}")
            ratio = f"{sec['dot'] / sec['gemv']:8.2f}x" if "gemv" in sec else f"{'-':>9}"
            f32 = f"{sec['gemv-f32'] * 1e6:8.1f}" if "gemv-f32" in sec else f"{'-':>8}"
            print(f"{I:6d} {O:6d} {T:3d} {' '.join(cells)} {sec['dot-cvt'] * 1e6:8.1f} {f32} {sec['jnp'] * 1e6:8.1f} "
                  f"{sec['bf16'] * 1e6:8.1f} "
                  f"{sec['bf16'] / best:7.2f}x {ratio}")
            for name in names:
                layer[T][name] += count * sec.get(name, float("nan"))
    for T, sec in layer.items():
        paths = {p: sec[p] for p in paths_for(T)}
        kernels = ", ".join(f"{p} {v * 1e6:.0f} us ({sec['bf16'] / v:.2f}x faster than bf16)"
                            for p, v in paths.items())
        f32 = f"gemv-f32 {sec['gemv-f32'] * 1e6:.0f} us, " if T <= wm.GEMV_MAX_T else ""
        print(f"one decoder layer, T={T}: {kernels}; dot-cvt {sec['dot-cvt'] * 1e6:.0f} us, {f32}"
              f"jnp {sec['jnp'] * 1e6:.0f} us, "
              f"bf16 {sec['bf16'] * 1e6:.0f} us")


def _try(interpret, x, quant, cfg, path, label):
    """Seconds for one config, or None where Triton cannot compile it (reported, then skipped)."""
    try:
        return timer(interpret)(kernel_fn(interpret, cfg, path), x, *quant)
    except Exception as e:  # noqa: BLE001 - a config Triton cannot compile is skipped
        print(f"  {label} {cfg}: {type(e).__name__}: {str(e)[:100]}")
        return None


def _report(I, O, auto, results):
    results = sorted((r for r in results if r[0] is not None), key=lambda r: r[0])
    print(f"sweep I={I:6d} O={O:6d} auto={auto}; best:")
    for sec, cfg in results[:3]:
        print(f"    {sec * 1e6:8.1f} us  {wm.packed_bytes(I, O, GROUP) / sec / 1e9:6.0f} GB/s  {cfg}")
    return results


def _gemv_stage1(I, O):
    """block_o x rows x num_warps, at most 256 packed bytes per thread per iteration (register room)."""
    for block_o, rows, warps in itertools.product((128, 256, 512, 1024), (16, 32, 64, 128, 256), (4, 8)):
        if block_o <= max(128, O) and rows <= I // 2 and block_o * rows <= 256 * 32 * warps:
            yield dict(block_o=block_o, rows=rows, num_warps=warps)


def sweep_gemv(shapes, interpret):
    """Coordinate descent over the gemv path's tunables at T = 1 (the full product is too many compiles)."""
    for I, O in shapes:
        _, *quant = make_weights(I, O)
        x = make_x(1, I)
        label = f"gemv I={I} O={O}"
        auto = wm._choose_gemv_config(I // 2, O, GROUP // 2, on_gpu=not interpret, x_bf16=True)
        auto = {k: auto[k] for k in wm.GEMV_TUNABLES}
        results = [(_try(interpret, x, quant, None, "gemv", label), {"auto": True, **auto})]
        results += [(_try(interpret, x, quant, cfg, "gemv", label), cfg) for cfg in _gemv_stage1(I, O)]
        best = min((r for r in results if r[0] is not None), key=lambda r: r[0])[1]
        base = {k: best[k] for k in ("block_o", "rows", "num_warps")}
        iters = -(-(I // 2) // base["rows"])
        for splits, stages, prefetch in itertools.product((1, 2, 4, 8, 16, 32, 64), (1, 3), (False, True)):
            if splits <= iters and not (prefetch and splits == iters):  # prefetch needs >= 2 tiles a split
                cfg = dict(base, num_splits=splits, num_stages=stages, prefetch=prefetch)
                results.append((_try(interpret, x, quant, cfg, "gemv", label), cfg))
        best = min((r for r in results if r[0] is not None), key=lambda r: r[0])[1]
        if best.get("prefetch"):  # tiles re-swept for prefetch's best splits: it may favour other shapes
            loop = {k: best[k] for k in ("num_splits", "num_stages", "prefetch")}
            results += [(_try(interpret, x, quant, dict(cfg, **loop), "gemv", label), dict(cfg, **loop))
                        for cfg in _gemv_stage1(I, O)]
        best = _report(I, O, auto, results)[0][1]
        cfg = dict({k: v for k, v in best.items() if k != "auto"}, unpack="convert")  # the exponent trick's worth
        sec = _try(interpret, x, quant, cfg, "gemv", label)
        if sec is not None:
            print(f"    {sec * 1e6:8.1f} us  {wm.packed_bytes(I, O, GROUP) / sec / 1e9:6.0f} GB/s  {cfg}")


def sweep_prefetch(shapes, interpret):
    """Loads in flight across loop iterations: tiles near the heuristic's x splits (so tiles a split)
    x prefetch, the heuristic's warps and stages; every result printed as it comes."""
    for I, O in shapes:
        _, *quant = make_weights(I, O)
        x = make_x(1, I)
        auto = wm._choose_gemv_config(I // 2, O, GROUP // 2, on_gpu=not interpret, x_bf16=True)
        results = [(_try(interpret, x, quant, None, "gemv", "auto"), {"auto": True})]
        for block_o, rows, splits, prefetch in itertools.product(
                sorted({auto["block_o"], 256, 512}), (GROUP // 2, GROUP), (2, 4, 8, 16, 32), (False, True)):
            iters = -(-(I // 2) // rows)
            if block_o > max(128, O) or splits > iters or (prefetch and splits == iters):
                continue
            cfg = dict(block_o=block_o, rows=rows, num_splits=splits, num_warps=auto["num_warps"],
                       prefetch=prefetch)
            sec = _try(interpret, x, quant, cfg, "gemv", f"gemv I={I} O={O}")
            results.append((sec, cfg))
            if sec is not None:
                print(f"  I={I} O={O} {sec * 1e6:7.1f} us {wm.packed_bytes(I, O, GROUP) / sec / 1e9:6.0f} GB/s {cfg}",
                      flush=True)
        _report(I, O, {k: auto[k] for k in wm.GEMV_TUNABLES}, results)


def sweep_dot(shapes, interpret):
    for I, O in shapes:
        _, *quant = make_weights(I, O)
        x = make_x(1, I)
        groups = -(-I // GROUP)
        results = []
        for block_o, splits, warps in itertools.product((64, 128, 256), (1, 2, 4, 8, 16, 32), (4, 8)):
            if splits > groups or (block_o == 256 and warps == 4):
                continue
            cfg = dict(block_o=block_o, num_splits=splits, num_warps=warps)
            results.append((_try(interpret, x, quant, cfg, "dot", f"dot I={I} O={O}"), cfg))
        auto = wm._choose_config(1, I // 2, O, groups, on_gpu=not interpret)
        _report(I, O, {k: auto[k] for k in ("block_o", "num_splits")}, results)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--smoke", action="store_true", help="CPU: interpret mode, tiny shapes")
    ap.add_argument("--sweep", action="store_true", help="the gemv path's tunables, T = 1")
    ap.add_argument("--sweep-prefetch", action="store_true", help="the gemv path's splits x prefetch, T = 1")
    ap.add_argument("--sweep-dot", action="store_true", help="the dot path's tunables, T = 1")
    ap.add_argument("--tokens", type=int, nargs="+", default=[1, 16])
    args = ap.parse_args()
    interpret = args.smoke or jax.default_backend() != "gpu"
    shapes = SHAPES_SMOKE if args.smoke else SHAPES_8B
    print(f"# {jax.devices()[0].device_kind}, jax {jax.__version__}, interpret={interpret}")
    ok = check(shapes, args.tokens, interpret)
    time_shapes(shapes, args.tokens, interpret)
    if args.sweep:
        sweep_gemv(shapes, interpret)
    if args.sweep_prefetch:
        sweep_prefetch(shapes, interpret)
    if args.sweep_dot:
        sweep_dot(shapes, interpret)
    print(f"# timer calls: {_TIMER}")
    sys.exit(0 if ok else 1)


if __name__ == "__main__":
    main()
