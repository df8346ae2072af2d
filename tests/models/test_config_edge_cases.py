"""config.json corners where lmjax must read what transformers reads (float32 logits of tiny random models).
Each case failed before its fix (a read-only probe found them): attention_factor scaled cos/sin for RoPE types
that ignore it; a Qwen2 config without max_window_layers slid no layer (transformers' default is 28); a tied
checkpoint that also stores lm_head.weight was refused; llama3 RoPE without original_max_position_embeddings
was refused (transformers fills in max_position_embeddings)."""
import glob
import json

import numpy as np
import pytest
import torch
import transformers
from safetensors.torch import load_file, save_file

from lmjax.loader.model_loader import load_model
from lmjax.models.forward import prompt_logits

BASE = dict(vocab_size=128, hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, max_position_embeddings=64, rms_norm_eps=1e-5, tie_word_embeddings=False)


def _edit_config(path, edit) -> None:
    cfg = json.loads((path / "config.json").read_text())
    edit(cfg)
    (path / "config.json").write_text(json.dumps(cfg))


def _max_diff(path, n: int = 30) -> float:
    ids = np.random.default_rng(0).integers(0, 128, n).tolist()
    hf = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    got = prompt_logits(load_model(str(path), dtype="float32").model, [ids], block_size=8)[0]
    with torch.no_grad():
        want = hf(torch.tensor([ids])).logits[0].numpy()
    return float(np.max(np.abs(got - want)))


@pytest.mark.parametrize("rope", [
    {"rope_type": "linear", "factor": 2.0, "attention_factor": 2.0},
    {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
     "original_max_position_embeddings": 16, "attention_factor": 0.5},
    {"rope_type": "default", "attention_factor": 2.0},
])
def test_attention_factor_is_ignored_where_transformers_ignores_it(tmp_path, rope):
    torch.manual_seed(0)
    transformers.LlamaForCausalLM(transformers.LlamaConfig(**BASE, rope_scaling=rope)).save_pretrained(tmp_path)
    assert _max_diff(tmp_path) <= 1e-4


def test_qwen2_without_max_window_layers_slides_from_layer_28(tmp_path):
    torch.manual_seed(0)
    cfg = transformers.Qwen2Config(**{**BASE, "hidden_size": 32, "num_hidden_layers": 30, "num_attention_heads": 2,
                                      "num_key_value_heads": 1, "initializer_range": 0.1},
                                   use_sliding_window=True, sliding_window=4, max_window_layers=28)
    transformers.Qwen2ForCausalLM(cfg).save_pretrained(tmp_path)
    _edit_config(tmp_path, lambda c: [c.pop(k, None) for k in ("max_window_layers", "layer_types")])  # legacy file
    assert _max_diff(tmp_path) <= 1e-4


def test_a_tied_checkpoint_that_stores_lm_head_too_loads(tmp_path):
    torch.manual_seed(0)
    transformers.LlamaForCausalLM(transformers.LlamaConfig(**{**BASE, "tie_word_embeddings": True})
                                  ).save_pretrained(tmp_path)
    (file,) = glob.glob(str(tmp_path / "*.safetensors"))
    tensors = load_file(file)
    tensors["lm_head.weight"] = tensors["model.embed_tokens.weight"].clone()
    save_file(tensors, file, metadata={"format": "pt"})
    assert _max_diff(tmp_path) <= 1e-4


def test_llama3_rope_without_original_max_position_embeddings(tmp_path):
    torch.manual_seed(0)
    rope = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0}
    transformers.LlamaForCausalLM(transformers.LlamaConfig(**{**BASE, "max_position_embeddings": 16},
                                                           rope_scaling=rope)).save_pretrained(tmp_path)

    def drop_original(cfg):
        for key in ("rope_parameters", "rope_scaling"):
            if cfg.get(key):
                cfg[key].pop("original_max_position_embeddings", None)
    _edit_config(tmp_path, drop_original)
    assert _max_diff(tmp_path) <= 1e-4


def test_qwen2_with_its_window_off_slides_no_layer_whatever_layer_types_say():
    """Review 35: use_sliding_window=false with layer_types naming sliding layers (a hand-edited or mixed
    config) slid them; transformers' Qwen2Config drops the window then (every layer full attention)."""
    from lmjax.models.config import model_config_from_hf

    hf = {**BASE, "use_sliding_window": False, "sliding_window": 4, "max_window_layers": 0,
          "layer_types": ["sliding_attention", "full_attention"]}
    assert model_config_from_hf(hf, "Qwen2ForCausalLM").sliding_windows == ()
    on = model_config_from_hf({**hf, "use_sliding_window": True}, "Qwen2ForCausalLM")
    assert on.sliding_windows == (4, None)  # (on, layer_types decide, as in transformers)
