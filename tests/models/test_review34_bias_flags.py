"""transformers reads `attention_bias` in Llama and Qwen3 only and `mlp_bias` in Llama only: a Mistral or Qwen2
config.json that says true for either (a config copied from a Llama one) loads with the biases those models have,
matching transformers' float32 logits (lmjax asked for q/k/v/o/MLP bias tensors the checkpoint has not)."""
import json
import os

import numpy as np
import pytest
import torch
import transformers

from lmjax.loader.model_loader import load_model
from lmjax.models.forward import prompt_logits

BASE = dict(vocab_size=128, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, max_position_embeddings=64, initializer_range=0.1, tie_word_embeddings=False)
PROMPT = list(np.random.default_rng(3).integers(0, 128, 12))


@pytest.mark.parametrize("config_cls,model_cls", [(transformers.MistralConfig, transformers.MistralForCausalLM),
                                                  (transformers.Qwen2Config, transformers.Qwen2ForCausalLM)])
def test_bias_flags_other_models_ignore_are_ignored(tmp_path, config_cls, model_cls):
    torch.manual_seed(0)
    model = model_cls(config_cls(**BASE)).eval()
    model.save_pretrained(tmp_path)
    with open(os.path.join(tmp_path, "config.json")) as f:
        config = json.load(f)
    config.update(attention_bias=True, mlp_bias=True)
    with open(os.path.join(tmp_path, "config.json"), "w") as f:
        json.dump(config, f)
    hf = transformers.AutoModelForCausalLM.from_pretrained(tmp_path, dtype=torch.float32).eval()
    with torch.no_grad():
        want = hf(torch.tensor([PROMPT])).logits[0].numpy()
    ours = prompt_logits(load_model(str(tmp_path), dtype="float32").model, [PROMPT])[0]
    assert np.abs(ours - want).max() < 1e-4
