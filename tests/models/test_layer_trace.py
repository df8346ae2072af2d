"""Inside `shared_layer_traces` the decoder's layers share one trace (lmjax.models.layer_trace): the same numbers
as layers run inline, bit for bit, with two traces (the first layer has no residual yet) instead of one a layer."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from conftest import write_tiny_llama
from lmjax import LLM, SamplingParams
from lmjax.layers.attention import contiguous_metadata
from lmjax.models import layer_trace
from lmjax.models.config import model_config_from_hf
from lmjax.models.forward import make_kv_caches
from lmjax.models.llama import LlamaForCausalLM

HF = dict(vocab_size=128, hidden_size=64, intermediate_size=96, num_hidden_layers=5, num_attention_heads=4,
          num_key_value_heads=2, max_position_embeddings=256, rms_norm_eps=1e-5)
BLOCK = 8


def _random_llama(seed=0):
    cfg = model_config_from_hf(HF, "LlamaForCausalLM")
    graphdef, state = nnx.split(nnx.eval_shape(lambda: LlamaForCausalLM(cfg, dtype=jnp.float32)))
    leaves, treedef = jax.tree.flatten(state)
    rng = np.random.default_rng(seed)
    leaves = [jnp.asarray((1.0 if p.ndim == 1 else 0.0) + 0.1 * rng.standard_normal(p.shape), p.dtype)
              for p in leaves]
    return nnx.merge(graphdef, jax.tree.unflatten(treedef, leaves))


@pytest.fixture
def traces(monkeypatch):
    """Counts traces of the shared layer function (a Python side effect runs once per trace)."""
    count = [0]
    run_layer = layer_trace._run_layer

    def counted(graphdef, state, *args):
        count[0] += 1
        return run_layer(graphdef, state, *args)

    monkeypatch.setattr(layer_trace, "_run_layer", counted)
    return count


def test_shared_traces_compute_what_inline_layers_do(traces):
    model = _random_llama()
    lengths = [5, 19]
    num_blocks = 1 + sum(-(-n // BLOCK) for n in lengths)
    rng = np.random.default_rng(1)
    ids_T = jnp.asarray(rng.integers(0, HF["vocab_size"], sum(lengths)), jnp.int32)
    positions_T = jnp.asarray(np.concatenate([np.arange(n) for n in lengths]), jnp.int32)
    meta = contiguous_metadata(lengths, BLOCK, num_blocks)
    tracer = layer_trace.layer_tracer()

    def forward(shared, model, caches):
        if not shared:
            return model(ids_T, positions_T, caches, meta)
        with layer_trace.shared_layer_traces(tracer):
            return model(ids_T, positions_T, caches, meta)

    inline = nnx.jit(lambda m, c: forward(False, m, c))(model, make_kv_caches(model.config, num_blocks, BLOCK,
                                                                              jnp.float32))
    assert traces[0] == 0
    shared = nnx.jit(lambda m, c: forward(True, m, c))(model, make_kv_caches(model.config, num_blocks, BLOCK,
                                                                             jnp.float32))
    assert traces[0] == 2  # 5 layers: the first (no residual yet) and one for the other four
    for got, want in zip(jax.tree.leaves(shared), jax.tree.leaves(inline)):
        np.testing.assert_array_equal(np.asarray(got), np.asarray(want))


def test_the_engine_traces_each_layer_shape_once(tmp_path, traces):
    """The engine's programs go through the shared tracer: each step or decode program it traces adds two layer
    traces (the first layer, the rest), not one per layer."""
    path = write_tiny_llama(tmp_path, eos_token_id=3, num_hidden_layers=4)
    llm = LLM(path, max_model_len=64, block_size=8, num_scheduler_steps=4)
    out = llm.generate([[5, 9, 12, 30]], SamplingParams(max_tokens=9, temperature=0, ignore_eos=True), use_tqdm=False)
    assert len(out[0].outputs[0].token_ids) == 9
    assert 0 < traces[0] <= 2 * llm.llm_engine.runner.num_compilations


def test_a_second_engine_traces_its_layers_with_its_own_settings(tmp_path, monkeypatch):
    """jax's jaxpr cache is keyed by the traced function, process-wide: with one module-level layer function, an
    engine of the same shapes reused the first engine's layer traces, whatever its LMJAX_* switches (review 30)."""
    from lmjax.layers import attention

    path = write_tiny_llama(tmp_path, eos_token_id=3)
    kw = dict(max_model_len=32, block_size=8, num_scheduler_steps=1)
    params = SamplingParams(max_tokens=3, temperature=0, ignore_eos=True)
    monkeypatch.delenv("LMJAX_ATTENTION_IMPL", raising=False)  # CPU "auto": the tiled XLA op
    a = LLM(path, **kw)
    max_M = a.llm_engine.runner.max_M
    prompt = list(range(5, 5 + (max_M - 1) * 8 + 1))  # fills max_M blocks: same widths under both impls
    want = a.generate([prompt], params, use_tqdm=False)[0].outputs[0].token_ids

    impls = []
    real = attention.ragged_paged_attention
    monkeypatch.setattr(attention, "ragged_paged_attention",
                        lambda *args, **k: impls.append(k.get("impl")) or real(*args, **k))
    monkeypatch.setenv("LMJAX_ATTENTION_IMPL", "reference")
    b = LLM(path, **kw)
    assert not b.llm_engine.runner.fixed_M  # B did read the switch (width buckets)
    got = b.generate([prompt], params, use_tqdm=False)[0].outputs[0].token_ids
    assert got == want
    # B's programs must run the attention B's setting asks for: traced with impl="reference"
    assert "reference" in impls, f"engine B traced no attention at all: impls={impls}"
