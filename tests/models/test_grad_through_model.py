"""jax.grad through lmjax's Flax NNX model ("plain Flax NNX modules", notebooks/02) with the default
settings (probe 25): the default attention on CPU (`auto` -> the XLA tiled op, a fori_loop with dynamic bounds)
and on GPU (`auto` -> Pallas kernels) has no reverse-mode rule, so JAX raised "Reverse-mode differentiation
does not work for lax.while_loop..."; paged_attention now differentiates through the jnp reference
(lmjax.layers.attention._with_reference_derivatives) and the gradient matches PyTorch's; forward mode (jax.jvp)
works too and agrees with it (a custom_vjp, the first fix, had broken jvp: review 25)."""
import jax
import jax.numpy as jnp
import numpy as np
import torch
import transformers
from flax import nnx

from tiny_llama import write_tiny_llama
from lmjax.loader.model_loader import load_model
from lmjax.models.forward import prefill_inputs


def test_grad_of_a_token_logprob_matches_torch(tmp_path, monkeypatch):
    monkeypatch.delenv("LMJAX_ATTENTION_IMPL", raising=False)
    path = write_tiny_llama(tmp_path)
    ids = list(map(int, np.random.default_rng(0).integers(3, 256, 11)))
    model = load_model(path, dtype="float32").model

    def loss(m):
        ids_T, pos_T, caches, meta, _ = prefill_inputs(m, [ids])
        hidden_TD, _ = m(ids_T, pos_T, caches, meta)
        return -jax.nn.log_softmax(m.compute_logits(hidden_TD), -1)[-2, ids[-1]]

    grads = nnx.grad(loss)(model)
    got = np.asarray(grads["layers"][0]["self_attn"]["q_proj"]["kernel"][...])

    hf = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    out = -torch.log_softmax(hf(torch.tensor([ids])).logits[0], -1)[-2, ids[-1]]
    out.backward()
    want = hf.model.layers[0].self_attn.q_proj.weight.grad.numpy().T
    np.testing.assert_allclose(got, want, atol=1e-6)


def test_jvp_agrees_with_grad(tmp_path, monkeypatch):
    monkeypatch.delenv("LMJAX_ATTENTION_IMPL", raising=False)
    model = load_model(write_tiny_llama(tmp_path), dtype="float32").model
    ids_T, pos_T, caches, meta, _ = prefill_inputs(model, [[5, 9, 14, 3, 7, 21, 8]])
    graphdef, state = nnx.split(model)

    def last_logit(state):
        m = nnx.merge(graphdef, state)
        hidden_TD, _ = m(ids_T, pos_T, caches, meta)
        return m.compute_logits(hidden_TD)[-1, 0]
    tangent = jax.tree_util.tree_map(jnp.ones_like, state)
    _, jvp_out = jax.jvp(last_logit, (state,), (tangent,))
    grads = jax.grad(last_logit)(state)
    dot = sum(float(jnp.vdot(a, b)) for a, b in zip(jax.tree_util.tree_leaves(grads), jax.tree_util.tree_leaves(tangent)))
    np.testing.assert_allclose(float(jvp_out), dot, rtol=1e-4)
