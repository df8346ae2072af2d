"""The Llama-family decoder in Flax NNX: Llama, Qwen2 (q/k/v bias), Mistral (sliding window),
Qwen3 (q/k norm) and InternLM2 (loaded through a weight map onto this same module tree).

Data flow of one step: token ids [T] and positions [T] in; per layer: RMSNorm -> q/k/v projections ->
RoPE + write K/V into the paged cache (`rope_and_write_kv`) -> paged attention over each sequence's context -> o_proj ->
residual -> RMSNorm -> SwiGLU MLP -> residual; final norm -> hidden [T, D]. `compute_logits` applies the
lm_head only to the rows the caller asks for (the last token of each sequence, in the engine).

The residual stream is carried as vLLM carries it: a layer returns its MLP output and the residual
apart, and each "residual add, then RMSNorm" pair is one `RMSNorm.add_and_norm` call (the next layer's
input norm, or the final norm), so that it can run as one fused launch (LMJAX_NORM_IMPL=kernel). The
sums are the same additions in the same order as `x + attn`, `x + mlp` (float addition commutes), so
the default path is bit for bit the plain one.

Shape letters: T tokens, D hidden, N q heads, K kv heads, H head dim, I intermediate, V vocab.
Layers are a Python list (unrolled under jit): measured faster than scanning stacked weights on GPU.
"""
from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx

from lmjax.layers.attention import (
    AttentionMetadata,
    paged_attention,
    qkv_gemv_takes_rope,
    rope_and_write_kv,
    rope_and_write_kv_qkv,
)
from lmjax.layers.linear import Linear
from lmjax.layers.merge import merge_linears
from lmjax.layers.norm import RMSNorm
from lmjax.layers.out_major import OutMajorLinear
from lmjax.layers.rope import inv_freq_TF, logn_scale_T
from lmjax.models.config import ModelConfig
from lmjax.models.layer_trace import call_layer

KVCache = tuple[jax.Array, jax.Array]  # (k_PSKH, v_PSKH) of one layer


class Attention(nnx.Module):
    def __init__(self, cfg: ModelConfig, layer: int, dtype):
        D, N, K, H = cfg.hidden_size, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
        self.q_proj = Linear(D, N * H, bias=cfg.qkv_bias, dtype=dtype)
        self.k_proj = Linear(D, K * H, bias=cfg.qkv_bias, dtype=dtype)
        self.v_proj = Linear(D, K * H, bias=cfg.qkv_bias, dtype=dtype)
        self.o_proj = Linear(N * H, D, bias=cfg.o_bias, dtype=dtype)
        self.q_norm = RMSNorm(H, cfg.rms_norm_eps, dtype=dtype) if cfg.qk_norm else None
        self.k_norm = RMSNorm(H, cfg.rms_norm_eps, dtype=dtype) if cfg.qk_norm else None
        self.qkv_proj = nnx.data(None)  # set by merge_qkv: q_proj, k_proj and v_proj as one weight
        self.qkv_shards = 1  # its column blocks (tensor parallelism): [q_0 | k_0 | v_0 | q_1 | ...]
        self.cfg, self.sliding_window = cfg, cfg.sliding_window(layer)
        self.record_queries = False  # lmjax.models.kv_calibration: sow each call's queries (static: retraces)

    def merge_qkv(self, shards: int = 1) -> bool:
        """Replace q_proj, k_proj and v_proj by one layer `qkv_proj` whose output is [q | k | v] (same
        numbers: the three weights' columns side by side; float or quantized, see lmjax.layers.merge),
        in `shards` blocks [q_s | k_s | v_s] for tensor parallelism over that many devices (each must
        then hold whole q and KV heads). Why: the fused RoPE + KV write kernel reads q, k and v straight
        from that one output. Not with a q/k norm (Qwen3). False when not merged."""
        whole_heads = self.cfg.num_heads % shards == 0 and self.cfg.num_kv_heads % shards == 0
        if self.qkv_proj is None and self.q_norm is None and whole_heads:
            merged = merge_linears([self.q_proj, self.k_proj, self.v_proj], shards)
            if merged is not None:
                self.qkv_proj, self.q_proj, self.k_proj, self.v_proj = merged, None, None, None
                self.qkv_shards = shards
        return self.qkv_proj is not None

    def __call__(self, x_TD, positions_T, cache: KVCache, meta: AttentionMetadata):
        cfg, T = self.cfg, x_TD.shape[0]
        if self.qkv_proj is not None:  # one GEMM; the fused kernel takes its output whole
            return self.attend_qkv(self.qkv_proj(x_TD), positions_T, cache, meta)
        q_TNH = self.q_proj(x_TD).reshape(T, cfg.num_heads, cfg.head_dim)
        k_TKH = self.k_proj(x_TD).reshape(T, cfg.num_kv_heads, cfg.head_dim)
        v_TKH = self.v_proj(x_TD).reshape(T, cfg.num_kv_heads, cfg.head_dim)
        if self.q_norm is not None:
            q_TNH, k_TKH = self.q_norm(q_TNH), self.k_norm(k_TKH)
        # RoPE of q and k and the K/V cache write (one fused launch when LMJAX_KV_WRITE_IMPL=kernel).
        q_TNH, cache = rope_and_write_kv(q_TNH, k_TKH, v_TKH, positions_T, cache, meta, cfg.rope)
        return self._attend(q_TNH, cache, positions_T, meta, T)

    def attend_qkv(self, qkv_TX, positions_T, cache: KVCache, meta: AttentionMetadata):
        """Attention from the merged projection's output [q | k | v] (`merge_qkv`) on: RoPE and the KV
        write, attention, o_proj."""
        cfg, T = self.cfg, qkv_TX.shape[0]
        qkv_TXH = qkv_TX.reshape(T, cfg.num_heads + 2 * cfg.num_kv_heads, cfg.head_dim)
        q_TNH, cache = rope_and_write_kv_qkv(qkv_TXH, cfg.num_kv_heads, positions_T, cache, meta, cfg.rope,
                                             shards=self.qkv_shards)
        return self._attend(q_TNH, cache, positions_T, meta, T)

    def attend_normed(self, x_TD, residual_TD, norm: RMSNorm, positions_T, cache: KVCache, meta: AttentionMetadata):
        """Out-major layers (`DecoderLayer.to_out_major`): (out_TD, new residual, cache) of attention over
        norm(x + residual), the add and norm in the q/k/v GEMV's launch, and RoPE with the KV write too
        where `qkv_gemv_takes_rope` allows."""
        cfg, T = self.cfg, x_TD.shape[0]
        if not qkv_gemv_takes_rope(cache, cfg.rope, cfg.num_kv_heads, cfg.head_dim, T):
            qkv_TX, residual_TD = self.qkv_proj.project_normed(x_TD, residual_TD, norm)
            out_TD, cache = self.attend_qkv(qkv_TX, positions_T, cache, meta)
            return out_TD, residual_TD, cache
        q_TNH, cache, residual_TD = self.qkv_proj.project_qkv_rope(
            x_TD, residual_TD, norm, num_kv_heads=cfg.num_kv_heads, head_dim=cfg.head_dim, positions_T=positions_T,
            inv_freq_TF=inv_freq_TF(cfg.rope, meta.seq_lens_T), attention_scaling=cfg.rope.attention_scaling,
            cache=cache, slot_mapping_T=meta.slot_mapping_T)
        out_TD, cache = self._attend(q_TNH, cache, positions_T, meta, T)
        return out_TD, residual_TD, cache

    def _attend(self, q_TNH, cache: KVCache, positions_T, meta: AttentionMetadata, T: int):
        cfg, (k_cache, v_cache) = self.cfg, cache
        if cfg.use_logn_attn:  # after RoPE, on q only: K in the cache is unscaled either way
            q_TNH = q_TNH * logn_scale_T(positions_T, cfg.logn_max_position)[:, None, None].astype(q_TNH.dtype)
        if self.record_queries:  # as attention gets them: RoPE'd (and logn-scaled)
            self.sow(nnx.Intermediate, "queries_TNH", q_TNH)
        out_TNH = paged_attention(q_TNH, k_cache, v_cache, meta, sm_scale=cfg.head_dim**-0.5,
                                  sliding_window=self.sliding_window)
        return self.o_proj(out_TNH.reshape(T, -1)), (k_cache, v_cache)


class MLP(nnx.Module):
    def __init__(self, cfg: ModelConfig, dtype):
        D, I = cfg.hidden_size, cfg.intermediate_size
        self.gate_proj = Linear(D, I, bias=cfg.mlp_bias, dtype=dtype)
        self.up_proj = Linear(D, I, bias=cfg.mlp_bias, dtype=dtype)
        self.down_proj = Linear(I, D, bias=cfg.mlp_bias, dtype=dtype)
        self.gate_up_proj = nnx.data(None)  # set by merge_gate_up

    def merge_gate_up(self) -> bool:
        """Replace gate_proj and up_proj by one layer `gate_up_proj` ([gate | up] columns): one GEMM
        launch instead of two (XLA keeps them apart). False when not merged (lmjax.layers.merge)."""
        if self.gate_up_proj is None:
            merged = merge_linears([self.gate_proj, self.up_proj])
            if merged is not None:
                self.gate_up_proj, self.gate_proj, self.up_proj = merged, None, None
        return self.gate_up_proj is not None

    def __call__(self, x_TD):
        if self.gate_up_proj is not None:
            gate_TI, up_TI = jnp.split(self.gate_up_proj(x_TD), 2, axis=-1)
            return self.down_proj(jax.nn.silu(gate_TI) * up_TI)
        return self.down_proj(jax.nn.silu(self.gate_proj(x_TD)) * self.up_proj(x_TD))


class DecoderLayer(nnx.Module):
    def __init__(self, cfg: ModelConfig, layer: int, dtype):
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, dtype=dtype)
        self.self_attn = Attention(cfg, layer, dtype)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, dtype=dtype)
        self.mlp = MLP(cfg, dtype)

    @property
    def out_major(self) -> bool:
        """Whether `to_out_major` converted this layer."""
        return isinstance(self.self_attn.qkv_proj, OutMajorLinear)

    def to_out_major(self) -> bool:
        """Its merged q/k/v and gate/up, o and down as `OutMajorLinear`s (lmjax.layers.out_major), so that
        a one-row step fuses each add + norm into the GEMV after it and SwiGLU into gate/up. Only float
        layers without a bias, q/k/v and gate/up merged (in one block), no q/k norm. False when not."""
        attn, mlp = self.self_attn, self.mlp
        layers = (attn.qkv_proj, attn.o_proj, mlp.gate_up_proj, mlp.down_proj)
        if not self.out_major and attn.qkv_shards == 1 and attn.q_norm is None \
                and all(type(x) is Linear and x.bias is None for x in layers):
            attn.qkv_proj, attn.o_proj = OutMajorLinear.from_linear(layers[0]), OutMajorLinear.from_linear(layers[1])
            mlp.gate_up_proj, mlp.down_proj = OutMajorLinear.from_linear(layers[2]), OutMajorLinear.from_linear(layers[3])
        return self.out_major

    def __call__(self, x_TD, residual_TD, positions_T, cache: KVCache, meta: AttentionMetadata):
        """(mlp_out_TD, residual_TD, cache): the layer's output is mlp_out + residual, left unsummed so
        that the next norm adds it (`RMSNorm.add_and_norm`, one fused launch when asked for).
        residual_TD None: x_TD is the whole hidden state (the first layer, or a layer run on its own)."""
        if self.out_major:
            return self._call_out_major(x_TD, residual_TD, positions_T, cache, meta)
        h_TD, residual_TD = self.input_layernorm.add_and_norm(x_TD, residual_TD)
        attn_TD, cache = self.self_attn(h_TD, positions_T, cache, meta)
        h_TD, residual_TD = self.post_attention_layernorm.add_and_norm(attn_TD, residual_TD)
        return self.mlp(h_TD), residual_TD, cache

    def _call_out_major(self, x_TD, residual_TD, positions_T, cache: KVCache, meta: AttentionMetadata):
        """The same layer over out-major weights: each norm rides in the projection after it."""
        attn, mlp = self.self_attn, self.mlp
        attn_TD, residual_TD, cache = attn.attend_normed(x_TD, residual_TD, self.input_layernorm, positions_T, cache,
                                                         meta)
        act_TI, residual_TD = mlp.gate_up_proj.project_normed(attn_TD, residual_TD, self.post_attention_layernorm,
                                                             swiglu=True)
        return mlp.down_proj(act_TI), residual_TD, cache


class Embedding(nnx.Module):
    def __init__(self, vocab: int, dim: int, dtype):
        self.embedding = nnx.Param(jnp.zeros((vocab, dim), dtype))

    def __call__(self, ids_T):
        # clip: a row the sampler marked NO_TOKEN (-1) may still feed a chained decode step before the host
        # ends its request; it must read some row of the table, not NaNs that would reach its KV blocks.
        return jnp.take(self.embedding[...], ids_T, axis=0, mode="clip")


class LlamaForCausalLM(nnx.Module):
    """Token ids + positions + paged KV cache in; final hidden states + updated cache out."""

    def __init__(self, cfg: ModelConfig, *, dtype=jnp.float32):
        self.config = cfg
        self.embed_tokens = Embedding(cfg.vocab_size, cfg.hidden_size, dtype)
        self.layers = nnx.List([DecoderLayer(cfg, i, dtype) for i in range(cfg.num_layers)])
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, dtype=dtype)
        self.lm_head = None if cfg.tie_word_embeddings else Linear(cfg.hidden_size, cfg.vocab_size, dtype=dtype)

    def __call__(self, ids_T, positions_T, caches: list[KVCache], meta: AttentionMetadata):
        x_TD, residual_TD = self.embed_tokens(ids_T), None
        new_caches = []
        for layer, cache in zip(self.layers, caches):
            x_TD, residual_TD, cache = call_layer(layer, x_TD, residual_TD, positions_T, cache, meta)
            new_caches.append(cache)
        hidden_TD, _ = self.norm.add_and_norm(x_TD, residual_TD)
        return hidden_TD, new_caches

    def merge_qkv(self, shards: int = 1) -> int:
        """`Attention.merge_qkv` in every layer (in place); returns how many layers merged."""
        return sum(layer.self_attn.merge_qkv(shards) for layer in self.layers)

    def merge_gate_up(self) -> int:
        """`MLP.merge_gate_up` in every layer (in place); returns how many layers merged."""
        return sum(layer.mlp.merge_gate_up() for layer in self.layers)

    def to_out_major(self) -> int:
        """`DecoderLayer.to_out_major` in every layer (in place; merge q/k/v and gate/up first); returns
        how many layers converted. The lm_head stays: XLA's one-row GEMM over it already streams at the
        copy rate (H200, 2026-11-24: 1B 117.6 us vs the GEMV kernel's 122, benchmarks/gemv_om_bench.py)."""
        return sum(layer.to_out_major() for layer in self.layers)

    def compute_logits(self, hidden_XD) -> jax.Array:
        """float32 logits for the given rows of hidden states."""
        if self.lm_head is None:
            logits_XV = hidden_XD @ self.embed_tokens.embedding[...].T
        else:
            logits_XV = self.lm_head(hidden_XD)
        return logits_XV.astype(jnp.float32)
