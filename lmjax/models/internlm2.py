"""InternLM2 checkpoints, mapped onto the Llama module tree.

InternLM2 is Llama with other tensor names and one packed `wqkv`. The packing groups heads by KV head:
for each of the K kv heads, its G = N / K query heads, then its key head, then its value head, each H rows.
Unpacking once at load time lets the same decoder (and the same kernels) serve it.
"""
from __future__ import annotations

from collections.abc import Iterable, Iterator

import numpy as np

from lmjax.models.config import ModelConfig

_RENAMES = {
    "model.tok_embeddings.weight": "model.embed_tokens.weight",
    "output.weight": "lm_head.weight",
}
_W4_LEAVES = ("kernel", "scale", "offset")
_LAYER_RENAMES = {
    "attention.wo": "self_attn.o_proj",
    "feed_forward.w1": "mlp.gate_proj",
    "feed_forward.w3": "mlp.up_proj",
    "feed_forward.w2": "mlp.down_proj",
    "attention_norm": "input_layernorm",
    "ffn_norm": "post_attention_layernorm",
}


def unpack_wqkv(wqkv: np.ndarray, cfg: ModelConfig) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """[K*(G+2)*H, ...] packed rows -> q [N*H, ...], k [K*H, ...], v [K*H, ...] (bias vectors too)."""
    K, H = cfg.num_kv_heads, cfg.head_dim
    G = cfg.num_heads // K
    grouped = wqkv.reshape(K, G + 2, H, *wqkv.shape[1:])
    q = grouped[:, :G].reshape(K * G * H, *wqkv.shape[1:])
    return q, grouped[:, G].reshape(K * H, *wqkv.shape[1:]), grouped[:, G + 1].reshape(K * H, *wqkv.shape[1:])


def _rename(name: str) -> str:
    if name in _RENAMES:
        return _RENAMES[name]
    for old, new in _LAYER_RENAMES.items():
        name = name.replace(f".{old}.", f".{new}.")
    return name


def internlm2_to_hf(tensors: Iterable[tuple[str, np.ndarray]], cfg: ModelConfig) -> Iterator[tuple[str, np.ndarray]]:
    """Rename InternLM2 tensors to HF Llama names, splitting each packed wqkv into q/k/v projections."""
    for name, array in tensors:
        if ".attention.wqkv." in name:
            prefix, kind = name.split(".attention.wqkv.")
            # torch's weight / bias are [out, ...]; an AWQ checkpoint's unpacked w4 leaves [in, out] (lmjax.loader.awq)
            out_last = kind in _W4_LEAVES
            parts = unpack_wqkv(array.T if out_last else array, cfg)
            for proj, part in zip(("q_proj", "k_proj", "v_proj"), parts):
                yield f"{prefix}.self_attn.{proj}.{kind}", part.T if out_last else part
        else:
            yield _rename(name), array
