"""lmjax.layers.merge: one layer for several reading the same input gives exactly their outputs side by
side (float, int8 and int4 weights, with and without bias); layers that differ are left apart; and the
merged q/k/v and gate/up projections keep a model's logits."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from lmjax.layers.linear import Linear
from lmjax.layers.merge import merge_linears
from lmjax.layers.quant import QuantLinear, QuantSpec

D = 64


def _linear(out_dim, seed, bias=True, dtype=jnp.float32):
    layer = Linear(D, out_dim, bias=bias, dtype=dtype)
    keys = jax.random.split(jax.random.key(seed))
    layer.kernel = nnx.Param(jax.random.normal(keys[0], (D, out_dim), dtype))
    if bias:
        layer.bias = nnx.Param(jax.random.normal(keys[1], (out_dim,), dtype))
    return layer


def _layers(kind, bias):
    floats = [_linear(n, i, bias) for i, n in enumerate((48, 16, 16))]
    if kind == "float":
        return floats
    spec = QuantSpec(kind, group_size=32)
    return [QuantLinear.from_linear(x, spec) for x in floats]


@pytest.mark.parametrize("kind", ["float", "w8", "w4"])
@pytest.mark.parametrize("bias", [True, False])
def test_merged_output_is_the_outputs_side_by_side(kind, bias, monkeypatch):
    monkeypatch.setenv("LMJAX_W4_IMPL", "reference")  # the dequantizing jnp path: the same math either way
    layers = _layers(kind, bias)
    merged = merge_linears(layers)
    assert type(merged) is type(layers[0]) and merged.kernel.shape[-1] == 80
    x_TD = jax.random.normal(jax.random.key(9), (5, D), jnp.float32)
    want = np.concatenate([np.asarray(x(x_TD)) for x in layers], axis=-1)
    # equal up to float32 summation order (a wider GEMM may block the reduction differently)
    np.testing.assert_allclose(np.asarray(merged(x_TD)), want, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("kind", ["float", "w4"])
def test_merged_in_shard_blocks_holds_each_shards_columns(kind, monkeypatch):
    """shards=2 (tensor parallelism): [a_0 | b_0 | c_0 | a_1 | b_1 | c_1], which `unshard_qkv` puts back in
    [a | b | c] order (here a = 6 "q heads", b and c = 2 "KV heads" of 8 columns)."""
    from lmjax.layers.attention import unshard_qkv

    monkeypatch.setenv("LMJAX_W4_IMPL", "reference")
    layers = _layers(kind, bias=True)
    merged = merge_linears(layers, shards=2)
    x_TD = jax.random.normal(jax.random.key(9), (5, D), jnp.float32)
    outs = [np.asarray(x(x_TD)) for x in layers]
    got = np.asarray(merged(x_TD))
    blocks = [o.reshape(5, 2, -1)[:, s] for s in range(2) for o in outs]
    np.testing.assert_allclose(got, np.concatenate(blocks, axis=-1), rtol=1e-5, atol=1e-5)
    ordered = unshard_qkv(jnp.asarray(got).reshape(5, 10, 8), num_kv_heads=2, shards=2)
    np.testing.assert_allclose(np.asarray(ordered).reshape(5, 80), np.concatenate(outs, axis=-1), rtol=1e-5, atol=1e-5)


def test_layers_that_differ_stay_apart():
    a, b = _linear(16, 0), _linear(16, 1, bias=False)
    assert merge_linears([a, b]) is None  # bias on one only
    assert merge_linears([a, _linear(16, 2, dtype=jnp.bfloat16)]) is None  # dtypes
    w4 = [QuantLinear.from_linear(x, QuantSpec("w4", group_size=g)) for x, g in ((a, 32), (_linear(16, 3), 64))]
    assert merge_linears(w4) is None  # group sizes
    assert merge_linears([a, QuantLinear.from_linear(_linear(16, 4), QuantSpec("w8"))]) is None  # kinds


def test_model_merges_keep_the_logits(tmp_path):
    """Llama with q/k/v bias (Qwen2-like) in float32: merged q/k/v and gate/up, the same logits."""
    import sys

    sys.path.insert(0, "benchmarks")
    from random_model import write_random_checkpoint

    from lmjax.loader.model_loader import load_model
    from lmjax.models.forward import prompt_logits

    path = write_random_checkpoint("tiny", str(tmp_path))
    model = load_model(path, dtype="float32").model
    prompts = [[5, 9, 2, 7, 11], list(range(3, 40))]
    want = prompt_logits(model, prompts, block_size=8)
    layers = len(model.layers)
    assert model.merge_qkv() == layers and model.merge_gate_up() == layers
    assert model.layers[0].mlp.gate_proj is None and model.layers[0].self_attn.q_proj is None
    for got, ref in zip(prompt_logits(model, prompts, block_size=8), want):
        np.testing.assert_allclose(got, ref, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("tokens", [1, 4])  # the one-token GEMV and the dot path of the Pallas kernel
def test_merged_w4_through_the_pallas_kernel(tokens, monkeypatch):
    monkeypatch.setenv("LMJAX_W4_IMPL", "kernel")  # interpret mode on CPU
    layers = [QuantLinear.from_linear(_linear(n, i, bias=False), QuantSpec("w4", group_size=32))
              for i, n in enumerate((64, 32, 32))]
    x_TD = jax.random.normal(jax.random.key(3), (tokens, D), jnp.float32)
    want = np.concatenate([np.asarray(x(x_TD)) for x in layers], axis=-1)
    np.testing.assert_allclose(np.asarray(merge_linears(layers)(x_TD)), want, rtol=1e-5, atol=1e-5)
