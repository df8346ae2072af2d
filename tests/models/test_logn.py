"""Qwen-style logN attention scaling (TurboMind's use_logn_attn): queries past the trained length are
scaled by log_{train_len}(position + 1); within it nothing changes."""
import math

import numpy as np
import torch
import transformers

from lmjax.layers.rope import logn_scale_T
from lmjax.loader.model_loader import load_model
from lmjax.models.forward import prompt_logits


def test_logn_scale_matches_qwen_formula():
    train_len = 16
    positions = np.arange(40)
    # Qwen's table: logn_list[i] = log(i, seq_length) if i > seq_length else 1, indexed by position + 1.
    qwen = [math.log(p + 1, train_len) if p + 1 > train_len else 1.0 for p in positions]
    np.testing.assert_allclose(np.asarray(logn_scale_T(positions, train_len)), qwen, rtol=1e-6)


def test_logn_changes_logits_only_past_trained_length(tmp_path):
    torch.manual_seed(0)
    cfg = transformers.LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=48, num_hidden_layers=2,
                                   num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=16)
    transformers.LlamaForCausalLM(cfg).save_pretrained(tmp_path)
    ids = np.random.default_rng(0).integers(0, 64, 30).tolist()
    plain = prompt_logits(load_model(str(tmp_path), dtype="float32").model, [ids])[0]
    logn = load_model(str(tmp_path), dtype="float32", use_logn_attn=True)
    assert logn.config.use_logn_attn
    scaled = prompt_logits(logn.model, [ids])[0]
    np.testing.assert_allclose(scaled[:16], plain[:16], atol=1e-6)
    assert np.max(np.abs(scaled[16:] - plain[16:])) > 1e-4
