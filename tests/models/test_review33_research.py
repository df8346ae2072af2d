"""Review 33 of the research API (probes /tmp/review33a/p3, p6, p8, p10, p16):
- gradients through paged attention kept a copy of every KV block per query token (8.6 GiB a layer at 2048
  tokens): they now come from a dense masked reference (ragged_paged_attention_dense_reference);
- prompt_logits / greedy_generate compiled again for every prompt length: inputs now padded to buckets;
- bad ids, empty prompts, a 1-token perplexity and max_new_tokens <= 0 were accepted without a word;
- apply_model with a weakly typed value recompiled every engine step;
- sharding rules naming a mesh axis (or logical axis) that does not exist replicated silently."""
import contextlib
import json
import os
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch
import transformers
from jax._src import monitoring
from jax.sharding import AbstractMesh
from jax.sharding import PartitionSpec as P
from tiny_llama import write_tiny_llama

from lmjax import parallel
from lmjax.layers.attention import contiguous_metadata, paged_attention
from lmjax.loader.model_loader import load_model
from lmjax.models.forward import (
    _forward_all,
    greedy_generate,
    perplexity,
    prefill_inputs,
    prompt_logits,
)
from pallas_kernels import ragged_paged_attention_reference as references


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    return write_tiny_llama(tmp_path_factory.mktemp("tiny33"))


@pytest.fixture(scope="module")
def model(tiny):
    return load_model(tiny, dtype="float32").model


@contextlib.contextmanager
def compilations():
    """A list that collects one entry per XLA compilation while the block runs."""
    seen = []

    def listener(event, duration, **_):
        if event == "/jax/core/compile/backend_compile_duration":
            seen.append(duration)
    monitoring.register_event_duration_secs_listener(listener)
    try:
        yield seen
    finally:
        monitoring.unregister_event_duration_listener(listener)


# ---------------------------------------------------------------- 1. derivatives through attention
def _ragged_inputs(rng, sliding_window):
    """Two sequences of different lengths mid-prefill (q_len < kv_len), a padding sequence and padding rows,
    GQA (6 q heads on 2 KV heads), blocks in shuffled order, NaN in the sink block 0."""
    P_, S, K, H, N = 12, 4, 2, 16, 6
    q_lens, kv_lens = [5, 2], [9, 13]
    tables = np.zeros((3, 4), np.int32)
    next_block = 1
    for b, n in enumerate(kv_lens):
        c = -(-n // S)
        tables[b, :c] = rng.permutation(np.arange(next_block, next_block + c))
        next_block += c
    T = sum(q_lens) + 3
    floats = [jnp.asarray(rng.normal(size=shape), jnp.float32) for shape in ((T, N, H), (P_, S, K, H), (P_, S, K, H))]
    q, k, v = floats[0], floats[1].at[0].set(jnp.nan), floats[2].at[0].set(jnp.nan)
    ints = (jnp.asarray(kv_lens + [0], jnp.int32), jnp.asarray(tables),
            jnp.asarray(np.concatenate([[0], np.cumsum(q_lens), [sum(q_lens)]]), jnp.int32))
    return (q, k, v), ints, {"sm_scale": 0.3, "sliding_window": sliding_window}


@pytest.mark.parametrize("sliding_window", [None, 3])
def test_dense_reference_values_and_derivatives_match_the_scan(sliding_window):
    rng = np.random.default_rng(0)
    floats, ints, kw = _ragged_inputs(rng, sliding_window)
    old = lambda q, k, v: references.ragged_paged_attention_reference(q, k, v, *ints, **kw)
    new = lambda q, k, v: references.ragged_paged_attention_dense_reference(q, k, v, *ints, **kw)
    np.testing.assert_allclose(new(*floats), old(*floats), atol=2e-6)
    tangents = tuple(jnp.asarray(rng.normal(size=x.shape), jnp.float32) for x in floats)
    np.testing.assert_allclose(jax.jvp(new, floats, tangents)[1], jax.jvp(old, floats, tangents)[1], atol=1e-5)
    cotangent = jnp.asarray(rng.normal(size=floats[0].shape), jnp.float32)
    got, want = jax.vjp(new, *floats)[1](cotangent), jax.vjp(old, *floats)[1](cotangent)
    for g, w in zip(got, want):  # q, k and v cotangents; none NaN from the sink block
        assert not np.isnan(np.asarray(g)).any()
        np.testing.assert_allclose(g, w, atol=1e-5)


@pytest.mark.parametrize("impl", ["auto", "reference"])
def test_grad_through_paged_attention_keeps_dense_memory(impl):
    """XLA's temp bytes for jax.grad of one 256-token attention (4 q / 2 KV heads of 32; compiled, not run):
    dense attention's probabilities are 1 MiB; the scan reference's derivatives took 49 MiB."""
    L, S, K, N, H = 256, 16, 2, 4, 32
    meta = contiguous_metadata([L], S, L // S + 1)
    q = jax.ShapeDtypeStruct((L, N, H), jnp.float32)
    cache = jax.ShapeDtypeStruct((L // S + 1, S, K, H), jnp.float32)
    loss = lambda q, k, v: paged_attention(q, k, v, meta, sm_scale=0.1, impl=impl).sum()
    grad = jax.jit(jax.grad(loss, argnums=(0, 1, 2))).lower(q, cache, cache).compile()
    assert grad.memory_analysis().temp_size_in_bytes < 12 * 2**20


# ---------------------------------------------------------------- 2. bucketed inputs
def test_prompt_logits_share_a_bucket_and_match_transformers(tiny, model):
    hf = transformers.AutoModelForCausalLM.from_pretrained(tiny, dtype=torch.float32).eval()
    rng = np.random.default_rng(1)
    prompt_logits(model, [[1, 2, 3] * 6])  # the 17..32-token bucket compiles here
    for n in (20, 21, 22):
        ids = rng.integers(0, 256, n).tolist()
        with compilations() as seen:
            got = prompt_logits(model, [ids])[0]
        assert not seen, f"prompt of {n} tokens compiled {len(seen)} programs"
        exact = prefill_inputs(model, [ids])[:4]  # unpadded, as before the buckets
        np.testing.assert_allclose(got, np.asarray(_forward_all(model, *exact)[0]), atol=1e-5)
        with torch.no_grad():
            want = hf(torch.tensor([ids])).logits[0].numpy()
        np.testing.assert_allclose(got, want, atol=1e-5)


def test_greedy_generate_pads_without_changing_tokens(model):
    prompts = [[5, 9, 14, 3, 7, 21, 8], [40, 41, 42], [7, 8]]  # 3 sequences: one padding sequence
    want = [greedy_generate(model, [p], 6)[0] for p in prompts]
    assert greedy_generate(model, prompts, 6) == want
    with compilations() as seen:  # another prompt length and output length in the same buckets
        got = greedy_generate(model, [[5, 9, 14, 3, 7, 21, 9, 1]] + prompts[1:], 5)
    assert got[1:] == [w[:5] for w in want[1:]]
    assert not seen, f"{len(seen)} compilations"


# ---------------------------------------------------------------- 3. bad inputs
@pytest.mark.parametrize("prompt, named", [([5, 9, 356], "356"), ([5, 9, -7], "-7"), ([], "non-empty"),
                                           ([5.7, 9.2], "5.7"), ([True, 3], "True")])
def test_bad_prompts_raise_naming_the_value(model, prompt, named):
    calls = [lambda: prompt_logits(model, [[1, 2], prompt]), lambda: greedy_generate(model, [prompt], 2),
             lambda: prefill_inputs(model, [prompt])]
    if prompt:  # perplexity takes one prompt: [4] + [] is a 1-token one (the next test)
        calls.append(lambda: perplexity(model, [4] + prompt))
    for call in calls:
        with pytest.raises(ValueError, match=named):
            call()


def test_perplexity_and_max_new_tokens_limits(model):
    with pytest.raises(ValueError, match="at least 2 tokens"):
        perplexity(model, [5])
    with pytest.raises(ValueError, match="outside the vocabulary"):
        perplexity(model, [5, 9, 257])
    assert greedy_generate(model, [[5, 9, 14], [3]], 0) == [[], []]
    with pytest.raises(ValueError, match="max_new_tokens=-2"):
        greedy_generate(model, [[5, 9, 14]], -2)


# ---------------------------------------------------------------- 4. apply_model with a weak type
def test_apply_model_weak_value_compiles_nothing_new(tiny):
    from lmjax import LLM, SamplingParams

    llm = LLM(tiny, max_model_len=128, dtype="float32")
    runner = llm.llm_engine.runner
    params = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)
    llm.generate([{"prompt_token_ids": [5, 9, 14, 3]}], params, use_tqdm=False)

    def set_ones_weak(m):
        m.norm.weight[...] = jnp.full(m.norm.weight.shape, 1.0)
    llm.apply_model(set_ones_weak)
    before = runner.num_compilations
    llm.generate([{"prompt_token_ids": [5, 9, 14, 3]}], params, use_tqdm=False)
    assert runner.num_compilations == before
    assert not any(getattr(p, "weak_type", False) for p in runner.params)


# ---------------------------------------------------------------- 5. sharding rules
def test_rules_naming_missing_axes_raise():
    mesh = AbstractMesh((2,), ("tp",))
    q_path = ("layers", 0, "self_attn", "q_proj", "kernel")
    with pytest.raises(ValueError, match=r"'heads': 'model'.*mesh axis 'model'.*\['tp'\]"):
        parallel.param_spec(q_path, (64, 128), mesh, rules={"heads": "model"})
    with pytest.raises(ValueError, match="logical axis 'head'"):
        parallel.param_spec(q_path, (64, 128), mesh, rules={"head": "tp"})
    with pytest.raises(ValueError, match="mesh axis 'model'"):
        parallel.kv_cache_sharding(parallel.make_mesh(1), {"kv_heads": "model"})
    assert parallel.param_spec(q_path, (64, 128), mesh, rules={"heads": "tp"}) == P(None, "tp")
    assert parallel.param_spec(q_path, (64, 127), mesh, rules={"heads": "tp"}) == P()  # 2 doesn't divide: replicated


_TP_CHILD = """
import json, sys
import jax
from lmjax import parallel
from lmjax.loader.model_loader import load_model
model = load_model(sys.argv[1], dtype="float32").model
mesh = parallel.make_mesh(2)
try:
    parallel.shard_model(model, mesh, {"heads": "model", "mlp": "model"})
    error = None
except ValueError as e:
    error = str(e)
parallel.shard_model(model, mesh, {"heads": "tp"})
q = model.layers[0].self_attn.q_proj.kernel[...]
print(json.dumps({"devices": jax.device_count(), "error": error, "q_spec": str(q.sharding.spec)}))
"""


def test_shard_model_with_a_typo_axis_raises_on_two_devices(tiny):
    env = {**os.environ, "XLA_FLAGS": "--xla_force_host_platform_device_count=2", "JAX_PLATFORMS": "cpu"}
    repo = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    env["PYTHONPATH"] = os.pathsep.join([repo, env.get("PYTHONPATH", "")])
    proc = subprocess.run([sys.executable, "-c", _TP_CHILD, tiny], capture_output=True, text=True, env=env,
                          timeout=120, cwd=repo, check=False)
    assert proc.returncode == 0, proc.stderr[-2000:]
    out = json.loads(proc.stdout.strip().splitlines()[-1])
    assert out["devices"] == 2 and out["q_spec"] in ("P(None, 'tp')", "PartitionSpec(None, 'tp')")
    assert out["error"] is not None and "'model'" in out["error"] and "['tp']" in out["error"]
