"""InternLM2 (not in transformers): a Llama checkpoint repacked into InternLM2's layout (packed, grouped
wqkv; w1/w2/w3; tok_embeddings; output) must give transformers' Llama logits on the same weights."""
import json

import numpy as np
import torch
import transformers
from safetensors.torch import save_file

from lmjax.loader.model_loader import load_model
from lmjax.models.forward import prompt_logits

HEADS, KV_HEADS, HEAD_DIM = 4, 2, 16
CFG = dict(vocab_size=128, hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=HEADS,
           num_key_value_heads=KV_HEADS, max_position_embeddings=32, rms_norm_eps=1e-5, tie_word_embeddings=False)


def _pack_wqkv(q, k, v):
    """InternLM2 groups rows per kv head: its query heads, then its key head, then its value head."""
    group = HEADS // KV_HEADS
    q = q.reshape(KV_HEADS, group, HEAD_DIM, -1)
    k, v = k.reshape(KV_HEADS, 1, HEAD_DIM, -1), v.reshape(KV_HEADS, 1, HEAD_DIM, -1)
    return torch.cat([q, k, v], dim=1).reshape(-1, q.shape[-1]).contiguous()


def _internlm2_state(sd):
    out = {"model.tok_embeddings.weight": sd["model.embed_tokens.weight"],
           "model.norm.weight": sd["model.norm.weight"], "output.weight": sd["lm_head.weight"]}
    for i in range(CFG["num_hidden_layers"]):
        p, a = f"model.layers.{i}.", f"model.layers.{i}.self_attn."
        out[p + "attention.wqkv.weight"] = _pack_wqkv(sd[a + "q_proj.weight"], sd[a + "k_proj.weight"],
                                                       sd[a + "v_proj.weight"])
        out[p + "attention.wo.weight"] = sd[a + "o_proj.weight"]
        for new, old in (("w1", "gate_proj"), ("w3", "up_proj"), ("w2", "down_proj")):
            out[p + f"feed_forward.{new}.weight"] = sd[p + f"mlp.{old}.weight"]
        out[p + "attention_norm.weight"] = sd[p + "input_layernorm.weight"]
        out[p + "ffn_norm.weight"] = sd[p + "post_attention_layernorm.weight"]
    return {k: v.contiguous() for k, v in out.items()}


def test_internlm2_layout_matches_llama(tmp_path):
    torch.manual_seed(0)
    llama = transformers.LlamaForCausalLM(transformers.LlamaConfig(
        **CFG, rope_scaling={"rope_type": "dynamic", "factor": 2.0})).eval()
    save_file(_internlm2_state(llama.state_dict()), str(tmp_path / "model.safetensors"))
    config = {**CFG, "architectures": ["InternLM2ForCausalLM"], "model_type": "internlm2", "bias": False,
              "rope_theta": 10000.0, "rope_scaling": {"type": "dynamic", "factor": 2.0}, "hidden_act": "silu"}
    (tmp_path / "config.json").write_text(json.dumps(config))
    loaded = load_model(str(tmp_path), dtype="float32")
    ids = np.random.default_rng(0).integers(0, 128, 45).tolist()  # past max_position_embeddings: dynamic NTK
    got = prompt_logits(loaded.model, [ids])[0]
    with torch.no_grad():
        want = llama(torch.tensor([ids])).logits[0].numpy()
    assert np.max(np.abs(got - want)) <= 1e-4
