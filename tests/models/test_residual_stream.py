"""The decoder carries its residual as vLLM does (`DecoderLayer` returns mlp output and residual apart,
each add + norm pair is one `RMSNorm.add_and_norm`): by default bit for bit the plain decoder (`x + attn`,
`x + mlp`, then the norms), and with LMJAX_NORM_IMPL=kernel the fused Pallas kernel (interpret mode
here) gives the same logits and greedy tokens."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from lmjax.layers import norm as norm_module
from lmjax.layers.attention import contiguous_metadata
from lmjax.models.config import model_config_from_hf
from lmjax.models.forward import greedy_generate, make_kv_caches, prompt_logits
from lmjax.models.llama import LlamaForCausalLM
from pallas_kernels import add_rms_norm as kernel_module

HF = dict(vocab_size=128, hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
          num_key_value_heads=2, max_position_embeddings=256, rms_norm_eps=1e-5)
BLOCK = 8


def _random_llama(dtype, seed=0):
    """A tiny Llama with random weights (norm weights near 1), built in memory: no checkpoint needed."""
    cfg = model_config_from_hf(HF, "LlamaForCausalLM")
    graphdef, state = nnx.split(nnx.eval_shape(lambda: LlamaForCausalLM(cfg, dtype=dtype)))
    leaves, treedef = jax.tree.flatten(state)
    rng = np.random.default_rng(seed)  # numpy: one jax op per weight shape would compile each
    leaves = [jnp.asarray((1.0 if p.ndim == 1 else 0.0) + 0.1 * rng.standard_normal(p.shape), p.dtype)
              for p in leaves]
    return nnx.merge(graphdef, jax.tree.unflatten(treedef, leaves))


def _plain_hidden(model, ids_T, positions_T, caches, meta):
    """The decoder as it was before the residual was carried: add, then norm, in the layer."""
    x_TD = model.embed_tokens(ids_T)
    for layer, cache in zip(model.layers, caches):
        attn_TD, cache = layer.self_attn(layer.input_layernorm(x_TD), positions_T, cache, meta)
        x_TD = x_TD + attn_TD
        x_TD = x_TD + layer.mlp(layer.post_attention_layernorm(x_TD))
    return model.norm(x_TD)


def _step_inputs(model, lengths, dtype):
    rng = np.random.default_rng(1)
    num_blocks = 1 + sum(-(-n // BLOCK) for n in lengths)
    ids_T = jnp.asarray(rng.integers(0, HF["vocab_size"], sum(lengths)), jnp.int32)
    positions_T = jnp.asarray(np.concatenate([np.arange(n) for n in lengths]), jnp.int32)
    caches = make_kv_caches(model.config, num_blocks, BLOCK, dtype)
    return ids_T, positions_T, caches, contiguous_metadata(lengths, BLOCK, num_blocks)


def _fresh_jit(fn):
    return nnx.jit(lambda model, *args: fn(model, *args))


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
def test_default_path_is_the_plain_decoder_bit_for_bit(monkeypatch, dtype):
    monkeypatch.delenv("LMJAX_NORM_IMPL", raising=False)
    model = _random_llama(dtype)
    args = _step_inputs(model, [5, 19], dtype)
    got = _fresh_jit(lambda m, *a: m(*a)[0])(model, *args)
    want = _fresh_jit(_plain_hidden)(model, *args)
    assert got.dtype == dtype
    np.testing.assert_array_equal(np.asarray(got.astype(jnp.float32)), np.asarray(want.astype(jnp.float32)))


def test_a_layer_runs_on_its_own_with_no_residual():
    """`layer(x, None, ...)` on the whole hidden state (what convert.calibrate and the notebooks do):
    mlp output + residual is the plain layer's output, bit for bit."""
    model = _random_llama(jnp.float32)
    ids_T, positions_T, caches, meta = _step_inputs(model, [11], jnp.float32)
    x_TD = model.embed_tokens(ids_T)

    @nnx.jit
    def run(layer, x_TD, cache):
        mlp_TD, residual_TD, _ = layer(x_TD, None, positions_T, cache, meta)
        attn_TD, _ = layer.self_attn(layer.input_layernorm(x_TD), positions_T, cache, meta)
        mid_TD = x_TD + attn_TD
        return residual_TD, mid_TD, mlp_TD + residual_TD, mid_TD + layer.mlp(layer.post_attention_layernorm(mid_TD))

    residual_TD, mid_TD, got_TD, want_TD = run(model.layers[1], x_TD, caches[1])
    np.testing.assert_array_equal(np.asarray(residual_TD), np.asarray(mid_TD))
    np.testing.assert_array_equal(np.asarray(got_TD), np.asarray(want_TD))


def _logits_and_greedy(model, monkeypatch, impl):
    """prompt_logits of a ragged batch and 5 greedy tokens (a prefill, then decode steps of 2 rows)."""
    if impl is None:
        monkeypatch.delenv("LMJAX_NORM_IMPL", raising=False)
    else:
        monkeypatch.setenv("LMJAX_NORM_IMPL", impl)
    jax.clear_caches()  # forward's steps are jitted once per shape: retrace them under this impl
    prompts = [np.random.default_rng(n).integers(0, HF["vocab_size"], n).tolist() for n in (3, 13)]
    return prompt_logits(model, prompts, block_size=BLOCK), greedy_generate(model, prompts, 5, block_size=BLOCK)


def test_fused_kernel_gives_the_same_logits_and_tokens(monkeypatch):
    """LMJAX_NORM_IMPL=kernel: every add + norm pair (2 per layer, and the final norm) is one kernel
    call, in prefill and decode steps; logits within float32 tolerance and the same greedy tokens as
    the default."""
    calls = []  # (has residual) per kernel call traced: proves the kernel ran, and where
    kernel = kernel_module._add_rms_norm_pallas
    monkeypatch.setattr(kernel_module, "_add_rms_norm_pallas",
                        lambda *a, **kw: calls.append(a[1] is not None) or kernel(*a, **kw))
    model = _random_llama(jnp.float32)
    logits, tokens = _logits_and_greedy(model, monkeypatch, "kernel")
    per_trace = [False] + [True] * (2 * HF["num_hidden_layers"])  # layer 0's input norm has no residual
    assert calls == per_trace * 3  # prompt_logits, the greedy prefill and its decode step
    calls.clear()
    want_logits, want_tokens = _logits_and_greedy(model, monkeypatch, None)
    assert not calls
    for got, want in zip(logits, want_logits):
        np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)
    assert tokens == want_tokens


def test_norm_impl_reads_and_checks_the_env(monkeypatch):
    monkeypatch.delenv("LMJAX_NORM_IMPL", raising=False)
    assert norm_module.norm_impl() == "xla"
    monkeypatch.setenv("LMJAX_NORM_IMPL", "kernel")
    assert norm_module.norm_impl() == "kernel"
    assert norm_module.norm_impl("xla") == "xla"
    monkeypatch.setenv("LMJAX_NORM_IMPL", "fused")
    with pytest.raises(ValueError, match="LMJAX_NORM_IMPL.*impl='fused' must be one of"):
        norm_module.norm_impl()
