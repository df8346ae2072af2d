"""A tiny Llama built in memory (no checkpoint) and one step's inputs, for model-level tests."""
import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from lmjax.layers.attention import contiguous_metadata
from lmjax.models.config import model_config_from_hf
from lmjax.models.forward import make_kv_caches
from lmjax.models.llama import LlamaForCausalLM

HF = dict(vocab_size=128, hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
          num_key_value_heads=2, max_position_embeddings=256, rms_norm_eps=1e-5)
BLOCK = 8


def random_llama(dtype, seed=0):
    """A tiny Llama with random weights (norm weights near 1), built in memory: no checkpoint needed."""
    cfg = model_config_from_hf(HF, "LlamaForCausalLM")
    graphdef, state = nnx.split(nnx.eval_shape(lambda: LlamaForCausalLM(cfg, dtype=dtype)))
    leaves, treedef = jax.tree.flatten(state)
    rng = np.random.default_rng(seed)  # numpy: one jax op per weight shape would compile each
    leaves = [jnp.asarray((1.0 if p.ndim == 1 else 0.0) + 0.1 * rng.standard_normal(p.shape), p.dtype)
              for p in leaves]
    return nnx.merge(graphdef, jax.tree.unflatten(treedef, leaves))


def step_inputs(model, lengths, dtype):
    """(ids_T, positions_T, caches, meta) of one step over fresh caches: each sequence's `lengths` tokens
    from position 0 (random ids, the same every call)."""
    rng = np.random.default_rng(1)
    num_blocks = 1 + sum(-(-n // BLOCK) for n in lengths)
    ids_T = jnp.asarray(rng.integers(0, HF["vocab_size"], sum(lengths)), jnp.int32)
    positions_T = jnp.asarray(np.concatenate([np.arange(n) for n in lengths]), jnp.int32)
    caches = make_kv_caches(model.config, num_blocks, BLOCK, dtype)
    return ids_T, positions_T, caches, contiguous_metadata(lengths, BLOCK, num_blocks)
