"""w4 matmul: Pallas kernel (interpret mode on CPU) vs the jnp reference vs x @ dequantize_w4 in float32."""
import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from lmjax.layers.quant import QuantLinear, QuantSpec, dequantize_w4, quantize_w4
from pallas_kernels import w4_matmul as wm

ON_GPU = jax.default_backend() == "gpu"
INTERPRET = not ON_GPU
TOL = {"float32": 1e-5, "bfloat16": 1e-2, "float16": 2e-3}
# QuantLinear's jnp path on a GPU: XLA's float32 dots may run as tf32 (issue 4's GPU tolerance)
LAYER_TOL_F32 = 5e-4 if ON_GPU else 1e-5


def _inputs(seed, T, I, O, group_size, dtype):
    rng = np.random.default_rng(seed)
    w_IO = jnp.asarray(rng.standard_normal((I, O)), jnp.float32)
    x_TI = jnp.asarray(rng.standard_normal((T, I)), dtype)
    packed_JO, scale_gO, offset_gO = quantize_w4(w_IO, group_size)
    return x_TI, packed_JO, scale_gO.astype(dtype), offset_gO.astype(dtype)


def _dense_f32(x_TI, packed_JO, scale_gO, offset_gO, group_size):
    """The ground truth: dequantize in float32, one float32 matmul."""
    w_IO = dequantize_w4(packed_JO, scale_gO, offset_gO, group_size, jnp.float32)
    return jnp.matmul(x_TI.astype(jnp.float32), w_IO, precision=jax.lax.Precision.HIGHEST)


def _rel_err(out, ref):
    out, ref = np.asarray(out, np.float64), np.asarray(ref, np.float64)
    assert np.isfinite(out).all()
    return np.linalg.norm(out - ref) / np.linalg.norm(ref)


# Interpret mode is slow: every case covers several edges at once (short last group, O not a
# multiple of block_o, T not a multiple of 16, several splits).
CASES = [  # T, I, O, group_size, dtype, config, path
    (1, 1024, 512, 128, "float32", None, "dot"),
    (7, 576, 200, 128, "bfloat16", None, "auto"),
    (16, 256, 64, 64, "float32", {"num_splits": 2}, "auto"),
    (33, 576, 200, 64, "float32", {"block_o": 128, "num_splits": 3}, "auto"),
    (1, 1024, 200, 128, "bfloat16", {"num_splits": 3}, "dot"),
    (16, 576, 512, 128, "bfloat16", {"block_o": 64, "num_splits": 5}, "auto"),
    # the dot path's unpack: 16-bit x takes M + q (bf16 above, float16 here), "convert" the int->float path
    (5, 576, 200, 64, "float16", None, "dot"),
    (2, 576, 200, 128, "bfloat16", {"unpack": "convert"}, "dot"),
]
# The gemv path: chunks smaller than a group (rows < G/2), tiles of several groups (rows > G/2) with a
# masked split tail, the int->float convert variant, one split (stores x's dtype) and several.
GEMV_CASES = [
    (1, 1024, 512, 128, "float32", None, "auto"),
    (2, 576, 200, 128, "bfloat16", {"block_o": 64, "num_splits": 3}, "gemv"),
    (3, 576, 640, 64, "float32", {"block_o": 128, "rows": 16, "num_splits": 4}, "gemv"),
    (1, 576, 200, 64, "bfloat16", {"rows": 128, "num_splits": 2}, "auto"),
    (3, 1024, 256, 128, "float32", {"unpack": "convert", "num_splits": 2, "num_warps": 8}, "gemv"),
    (4, 1024, 96, 128, "bfloat16", {"block_o": 32, "rows": 256}, "gemv"),
    # prefetch: several tiles a split with a short last group and a masked split tail; one tile a split
    (2, 1088, 200, 128, "float32", {"block_o": 64, "rows": 32, "num_splits": 3, "prefetch": True}, "gemv"),
    (1, 576, 256, 64, "bfloat16", {"rows": 64, "num_splits": 9, "prefetch": True}, "gemv"),
    # bf16x2 (packed PTX on the GPU, its jnp emulation in interpret mode): masked columns and rows,
    # several splits and tokens, chunks smaller than a group
    (1, 1088, 200, 128, "bfloat16", {"unpack": "bf16x2", "block_o": 64, "num_splits": 3}, "gemv"),
    (3, 576, 512, 64, "bfloat16", {"unpack": "bf16x2", "block_o": 256, "rows": 16, "num_splits": 4}, "gemv"),
]


@pytest.mark.parametrize("T,I,O,group_size,dtype,config,path", CASES + GEMV_CASES)
def test_kernel_and_reference_match_dense(T, I, O, group_size, dtype, config, path):
    args = _inputs(0, T, I, O, group_size, dtype)
    dense = _dense_f32(*args, group_size)
    kernel = jax.jit(functools.partial(wm.w4_matmul_kernel, group_size=group_size, interpret=INTERPRET,
                                       config=config, path=path))
    out = kernel(*args)
    ref = jax.jit(functools.partial(wm.w4_matmul_reference, group_size=group_size))(*args)
    for y in (out, ref):
        assert y.shape == (T, O) and y.dtype == jnp.dtype(dtype)
        assert _rel_err(y, dense) < TOL[dtype]


def _pallas_names(fn, *args):
    """The pallas_call names in fn's jaxpr: which kernel path a call takes, without running it."""
    return {name for name in ("w4_gemv", "w4_matmul") if name in str(jax.make_jaxpr(fn)(*args))}


@pytest.mark.parametrize("T,path,want", [
    (1, "auto", "w4_gemv"), (2, "auto", "w4_matmul"), (5, "auto", "w4_matmul"),
    (1, "dot", "w4_matmul"), (3, "gemv", "w4_gemv"),
])
def test_path_is_chosen_by_tokens_or_forced(T, path, want):
    args = _inputs(5, T, 256, 64, 128, "bfloat16")
    assert wm.choose_path(T, path) == want.replace("w4_matmul", "dot").replace("w4_", "")
    kernel = functools.partial(wm.w4_matmul_kernel, group_size=128, interpret=True, path=path)
    assert _pallas_names(kernel, *args) == {want}
    public = functools.partial(wm.w4_matmul, group_size=128, impl="kernel", interpret=True, path=path)
    assert _pallas_names(public, *args) == {want}


def test_public_op_takes_the_reference_off_gpu_and_the_kernel_on_it():
    args = _inputs(1, 3, 256, 64, 128, "float32")
    out = wm.w4_matmul(*args, 128)
    want = wm.w4_matmul_kernel(*args, 128) if ON_GPU else wm.w4_matmul_reference(*args, 128)
    np.testing.assert_allclose(out, want, rtol=0, atol=0)


def test_quant_linear_forced_kernel_matches_jnp_path(monkeypatch):
    rng = np.random.default_rng(2)
    w_IO = jnp.asarray(rng.standard_normal((576, 200)), jnp.float32)
    layer = QuantLinear.from_arrays(QuantSpec("w4", 128), *quantize_w4(w_IO, 128), dtype=jnp.float32)
    x_BTI = jnp.asarray(rng.standard_normal((2, 3, 576)), jnp.float32)
    monkeypatch.setenv("LMJAX_W4_IMPL", "reference")
    want = layer(x_BTI)
    want_1 = layer(x_BTI[:1, :1])
    monkeypatch.setenv("LMJAX_W4_IMPL", "kernel")
    got = layer(x_BTI)  # 6 tokens: the dot path
    assert got.shape == (2, 3, 200)
    assert _rel_err(got, want) < LAYER_TOL_F32
    got_1 = layer(x_BTI[:1, :1])  # one token: the gemv path
    assert got_1.shape == (1, 1, 200)
    assert _rel_err(got_1, want_1) < LAYER_TOL_F32


@pytest.mark.parametrize("bad,match", [
    (dict(packed_JO=jnp.zeros((100, 64), jnp.uint8)), r"packed_JO.shape=\(100, 64\)"),
    (dict(packed_JO=jnp.zeros((128, 64), jnp.int8)), r"packed_JO.dtype=int8"),
    (dict(scale_gO=jnp.zeros((3, 64))), r"scale_gO.shape=\(3, 64\)"),
    (dict(group_size=0), r"group_size=0"),
    (dict(impl="triton"), r"impl='triton'"),
    (dict(path="gemm"), r"path='gemm'"),
    (dict(path="gemv", x_TI=jnp.zeros((5, 256))), r"path='gemv' needs T=5 <= GEMV_MAX_T=4"),
])
def test_validation_names_the_bad_value(bad, match):
    kw = dict(x_TI=jnp.zeros((1, 256)), packed_JO=jnp.zeros((128, 64), jnp.uint8),
              scale_gO=jnp.zeros((2, 64)), offset_gO=jnp.zeros((2, 64)), group_size=128, impl="auto")
    kw.update(bad)
    with pytest.raises(ValueError, match=match):
        wm.w4_matmul(**kw)


@pytest.mark.parametrize("config,path,match", [
    ({"block_o": 48}, "auto", r"config\['block_o'\]=48"),
    ({"block_o": 48}, "dot", r"config\['block_o'\]=48"),
    ({"rows": 24}, "auto", r"config\['rows'\]=24"),
    ({"unpack": "lut"}, "gemv", r"config\['unpack'\]='lut'"),
    ({"rows": 64}, "dot", r"config key 'rows' must be one of .* \(path 'dot'\)"),
    ({"num_warps": 0}, "gemv", r"config\['num_warps'\]=0"),
    ({"prefetch": 1}, "gemv", r"config\['prefetch'\]=1 must be a bool"),
    ({"unpack": "bf16x2"}, "dot", r"config\['unpack'\]='bf16x2' must be one of \('magic', 'convert'\)"),
    ({"unpack": "bf16x2", "block_o": 32}, "gemv", r"config\['block_o'\]=32 must be >= 64 with unpack='bf16x2'"),
])
def test_kernel_config_is_validated(config, path, match):
    args = _inputs(3, 1, 256, 64, 128, "float32")
    with pytest.raises(ValueError, match=match):
        wm.w4_matmul_kernel(*args, 128, interpret=True, config=config, path=path)


def test_kernel_needs_power_of_two_groups_and_auto_falls_back():
    args = _inputs(4, 2, 192, 64, 96, "float32")
    with pytest.raises(ValueError, match=r"group_size=96 must be a power of two"):
        wm.w4_matmul_kernel(*args, 96, interpret=True)
    out = wm.w4_matmul(*args, 96, interpret=True)  # auto: the reference
    assert _rel_err(out, _dense_f32(*args, 96)) < TOL["float32"]


@pytest.mark.parametrize("I, O, x_bf16, want", [
    (4096, 4096, False, dict(block_o=128, rows=128, num_splits=16, num_warps=4, unpack="magic")),
    (4096, 14336, False, dict(block_o=512, rows=64, num_splits=32, num_warps=8, unpack="magic")),
    (4096, 14336, True, dict(block_o=512, rows=64, num_splits=32, num_warps=4, unpack="bf16x2")),
    (4096, 1024, True, dict(block_o=256, rows=64, num_splits=32, num_warps=4, unpack="bf16x2")),
    # the L2-cold sweep (session 16): one tile a split for the tall down weight, 8 for the merged gate/up
    (14336, 4096, True, dict(block_o=512, rows=64, num_splits=112, num_warps=4, unpack="bf16x2")),
    (4096, 28672, True, dict(block_o=512, rows=64, num_splits=8, num_warps=4, unpack="bf16x2")),
    # a vocab-wide lm_head (--quant-lm-head w4): rows that divide O, no masked column tail
    (4096, 128256, True, dict(block_o=256, rows=64, num_splits=8, num_warps=4, unpack="bf16x2")),
])
def test_gemv_gpu_tiling_follows_the_sweeps(monkeypatch, I, O, x_bf16, want):
    from pallas_kernels import w4_gemv

    monkeypatch.setattr(w4_gemv, "_num_sms", lambda: 132)  # where the gemv tiling reads it
    cfg = wm._choose_gemv_config(I // 2, O, 64, on_gpu=True, x_bf16=x_bf16)
    assert {k: cfg[k] for k in want} == want


def test_gemv_bf16x2_needs_bf16_x():
    args = _inputs(5, 1, 256, 64, 128, "float32")
    with pytest.raises(ValueError, match=r"config\['unpack'\]='bf16x2' needs bfloat16 x, got float32"):
        wm.w4_matmul_kernel(*args, 128, interpret=True, config={"unpack": "bf16x2"}, path="gemv")


def test_bf16x2_emulation_rounds_like_the_ptx():
    """The emulation's roundings, checked by hand on one byte: x * (q - 8) products round to bf16
    (8 significant bits), then their pair sum does."""
    from pallas_kernels.w4_bf16x2 import bf16x2_products

    p = jnp.asarray([[0xF3]], jnp.uint8)  # low q = 3 -> -5, high q = 15 -> 7
    xe, xo = jnp.asarray([1.0078125], jnp.bfloat16), jnp.asarray([3.0], jnp.bfloat16)
    got = float(bf16x2_products(p, xe, xo, interpret=True)[0, 0])
    # -5 * 1.0078125 = -5.0390625 needs 10 bits: rounds to -5.03125 (nearest bf16); + 21 = 15.96875,
    # which rounds to 16.0 in bf16
    assert got == 16.0


@pytest.mark.skipif(not ON_GPU, reason="the PTX runs on a GPU only; this file runs there too (BENCHMARKS.md)")
def test_bf16x2_ptx_matches_its_emulation():
    args = _inputs(6, 1, 4096, 1024, 128, "bfloat16")
    cfg = {"unpack": "bf16x2", "num_splits": 4}
    gpu = wm.w4_matmul_kernel(*args, 128, interpret=False, config=cfg, path="gemv")
    emulated = wm.w4_matmul_kernel(*args, 128, interpret=True, config=cfg, path="gemv")
    # the same roundings; only the float32 row sums' order differs (then bf16 out)
    assert _rel_err(gpu, emulated) < 5e-4
