"""`convert_checkpoint` / `lmjax convert`: HF or GGUF in, a converted (Orbax) directory out that loads
like any model path, gives the same greedy tokens as its source, never exists half-written, and
restores at tp = 4 straight into each device's shards."""
import json
import os
import subprocess
import sys

import pytest
import torch
import transformers

import convert.convert as convert_module
from convert import convert_checkpoint
from lmjax.loader.model_loader import load_model
from lmjax.loader.orbax_loader import ORBAX_SUBDIR, is_converted
from lmjax.models.forward import greedy_generate

DRIVER = os.path.join(os.path.dirname(__file__), "tp_restore_driver.py")
TINY = dict(vocab_size=96, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=8,
            num_key_value_heads=4, head_dim=8, max_position_embeddings=128, rms_norm_eps=1e-5,
            bos_token_id=1, eos_token_id=0)
PROMPTS = [[1, 5, 9, 13, 17], [1, 40, 41], [1] + list(range(50, 80))]


def _write_tokenizer(vocab_size: int, out_dir: str) -> None:
    from tokenizers import Tokenizer, models, pre_tokenizers

    tok = Tokenizer(models.WordLevel({f"t{i}": i for i in range(vocab_size)}, unk_token="t2"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    fast = transformers.PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="t0", bos_token="t1", unk_token="t2")
    fast.chat_template = "{% for m in messages %}{{ m['content'] }} {% endfor %}"
    fast.save_pretrained(out_dir)


@pytest.fixture(scope="module")
def tiny(tmp_path_factory) -> str:
    path = str(tmp_path_factory.mktemp("tiny-hf"))
    torch.manual_seed(0)
    transformers.LlamaForCausalLM(transformers.LlamaConfig(**TINY)).save_pretrained(path)
    _write_tokenizer(TINY["vocab_size"], path)
    return path


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_converted_tiny_gives_the_same_greedy_tokens(tiny, tmp_path, dtype):
    out = convert_checkpoint(tiny, tmp_path / "out", dtype=dtype)
    assert is_converted(out) and not is_converted(tiny)
    info = json.loads(open(os.path.join(out, "config.json")).read())["lmjax"]
    assert info["dtype"] == dtype and info["quant"] is None
    original, converted = load_model(tiny, dtype), load_model(out, dtype)
    assert converted.dtype == original.dtype and converted.config == original.config
    assert greedy_generate(converted.model, PROMPTS, 12) == greedy_generate(original.model, PROMPTS, 12)


def test_facades_accept_the_converted_directory(tiny, tmp_path):
    import lmjax

    out = convert_checkpoint(tiny, tmp_path / "out", dtype="float32")
    assert sorted(f for f in os.listdir(out) if f.startswith("tokenizer"))  # tokenizer files travel with it
    params = lmjax.SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
    kwargs = dict(dtype="float32", max_model_len=64, max_num_seqs=4)
    got = [o.outputs[0].token_ids for o in lmjax.LLM(out, **kwargs).generate(
        [{"prompt_token_ids": p} for p in PROMPTS], params, use_tqdm=False)]
    want = [o.outputs[0].token_ids for o in lmjax.LLM(tiny, **kwargs).generate(
        [{"prompt_token_ids": p} for p in PROMPTS], params, use_tqdm=False)]
    assert got == want


def test_converted_loads_without_a_cpu_backend(tiny, tmp_path, monkeypatch):
    """JAX_PLATFORMS=cuda leaves no CPU backend: restoring goes to the device, with or without a placer
    (simulated here by a local_devices that refuses backend="cpu", as JAX then does)."""
    import jax

    out = convert_checkpoint(tiny, tmp_path / "out", dtype="float32")
    want = greedy_generate(load_model(out, "float32").model, PROMPTS, 6)
    real = jax.local_devices

    def no_cpu(*args, backend=None, **kwargs):
        if backend == "cpu":
            raise RuntimeError("Unknown backend cpu. Available backends are ['cuda']")
        return real(*args, backend=backend, **kwargs)

    monkeypatch.setattr(jax, "local_devices", no_cpu)
    placed = []

    def placer(path, value):
        placed.append(path)
        return jax.device_put(value)

    assert greedy_generate(load_model(out, "float32").model, PROMPTS, 6) == want
    assert greedy_generate(load_model(out, "float32", placer=placer).model, PROMPTS, 6) == want
    assert placed  # the placer took every array


def test_interrupted_conversion_leaves_nothing_loadable(tiny, tmp_path, monkeypatch):
    def crash(*args, **kwargs):  # after the weights are written, before the config and tokenizer
        raise KeyboardInterrupt("simulated interruption")

    monkeypatch.setattr(convert_module, "_write_config", crash)
    out = tmp_path / "out"
    with pytest.raises(KeyboardInterrupt):
        convert_checkpoint(tiny, out, dtype="float32")
    assert not out.exists() and os.listdir(tmp_path) == []  # no OUT, no temporary left behind
    with pytest.raises(FileNotFoundError):
        load_model(str(out), "float32")


def test_out_is_never_silently_replaced(tiny, tmp_path):
    out = convert_checkpoint(tiny, tmp_path / "out", dtype="float32")
    with pytest.raises(FileExistsError, match="out"):
        convert_checkpoint(tiny, out, dtype="float32")
    convert_checkpoint(tiny, out, dtype="bfloat16", overwrite=True)
    assert json.load(open(os.path.join(out, "config.json")))["lmjax"]["dtype"] == "bfloat16"
    assert sorted(os.listdir(tmp_path)) == ["out"]


def _tp_restore(spec: dict) -> dict:
    env = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"}
    proc = subprocess.run([sys.executable, DRIVER, json.dumps(spec)], capture_output=True, text=True,
                          timeout=600, env=env)
    assert proc.returncode == 0, proc.stderr[-4000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


@pytest.mark.parametrize("quant", [None, "w4"])
def test_tp4_restore_places_each_shard_on_its_device(tiny, tmp_path, quant):
    run = _tp_restore({"src": tiny, "out": str(tmp_path / "out"), "tp": 4, "devices": 8, "quant": quant,
                       **({"group_size": 16} if quant else {}), "prompts": PROMPTS})
    assert run["devices"] == 8
    params = run["params"]
    assert all(p["sharding_ok"] and p["devices_ok"] and p["shard_shapes_ok"] for p in params), params
    assert sum(p["sharded"] for p in params) >= 5 * TINY["num_hidden_layers"]  # q, k, v, o, gate, up, down...
    if quant:  # and each layer's scales and offsets with them (w4: [groups, O]), none replicated
        quant_params = [p for p in params if p["path"].rsplit(".", 1)[-1] in ("scale", "offset")]
        assert quant_params and all(p["sharded"] for p in quant_params), quant_params
    # No sharded tensor ever went to a device whole: every host->device copy was one shard (or a
    # replicated tensor, which each device holds whole anyway).
    legit = {tuple(p["shape"] if not p["sharded"] else p["shard_shape"]) for p in params}
    whole = {tuple(p["shape"]) for p in params if p["sharded"]} - legit
    assert whole and run["device_put_shapes"] and not whole & {tuple(s) for s in run["device_put_shapes"]}
    assert run["tokens"] == run["tokens_tp1"]


def test_cli_convert(tiny, tmp_path):
    from lmjax.cli import main

    out = tmp_path / "cli-out"
    assert main(["convert", tiny, str(out), "--dtype", "float32", "--quant", "w8", "--quant-lm-head", "w8"]) == 0
    info = json.load(open(out / "config.json"))["lmjax"]
    assert info["quant"] == {"method": "w8", "group_size": 128, "lm_head": "w8", "algorithm": "rtn"}
    assert (out / ORBAX_SUBDIR).is_dir()


@pytest.mark.parametrize("method", ["awq", "gptq"])
def test_calibrated_w4_conversion_restores_what_was_calibrated(tiny, tmp_path, method):
    """A w4 conversion calibrated on --calib-text restores exactly the model that calibrating in memory on
    the same text gives (the tokenizer beside the checkpoint cuts the text into the same prompts)."""
    import numpy as np
    from flax import nnx

    from convert.calibrate import calibrate_w4, calibration_prompts
    from lmjax.layers.quant import QuantSpec
    from lmjax.loader.tokenizer import load_tokenizer
    from lmjax.models.forward import prompt_logits

    words = np.random.default_rng(0).integers(3, TINY["vocab_size"], 300)
    calib = tmp_path / "calib.txt"
    calib.write_text(" ".join(f"t{w}" for w in words))
    out = convert_checkpoint(tiny, tmp_path / "w4", dtype="float32", quant="w4", group_size=32,
                             w4_method=method, calib_text=str(calib))
    info = json.load(open(os.path.join(out, "config.json")))["lmjax"]
    assert info["quant"] == {"method": "w4", "group_size": 32, "algorithm": method, "calibration": str(calib)}
    prompts = calibration_prompts(load_tokenizer(tiny), calib.read_text())
    in_memory = calibrate_w4(nnx.clone(load_model(tiny, "float32").model), QuantSpec("w4", 32), prompts,
                             method=method)
    restored = load_model(out, "float32").model
    for got, want in zip(prompt_logits(restored, PROMPTS), prompt_logits(in_memory, PROMPTS)):
        np.testing.assert_allclose(got, want, rtol=1e-6, atol=1e-6)
    rtn = load_model(convert_checkpoint(tiny, tmp_path / "rtn", dtype="float32", quant="w4", group_size=32,
                                        w4_method="rtn"), "float32").model
    assert not np.allclose(prompt_logits(rtn, PROMPTS)[0], prompt_logits(restored, PROMPTS)[0], atol=1e-6)

@pytest.mark.parametrize("tie, head", [(False, "w8"), (True, "w4")])
def test_quantized_lm_head_restores_and_stays_close(tiny, tmp_path, tie, head):
    """--quant-lm-head: the restored model is the in-memory one exactly; a tied lm_head becomes its own
    quantized weight while the embedding stays float; the logits move by its rounding only."""
    import jax.numpy as jnp
    import numpy as np
    from flax import nnx

    from lmjax.layers.quant import QuantLinear, QuantSpec, quantize_model
    from lmjax.models.forward import prompt_logits

    src = tiny
    if tie:
        src = str(tmp_path / "tied")
        torch.manual_seed(1)
        transformers.LlamaForCausalLM(transformers.LlamaConfig(**TINY, tie_word_embeddings=True)).save_pretrained(src)
        _write_tokenizer(TINY["vocab_size"], src)
    out = convert_checkpoint(src, tmp_path / "q", dtype="float32", quant="w4", group_size=32, w4_method="rtn",
                             quant_lm_head=head)
    info = json.load(open(os.path.join(out, "config.json")))["lmjax"]
    assert info["quant"] == {"method": "w4", "group_size": 32, "lm_head": head, "algorithm": "rtn"}
    restored = load_model(out, "float32").model
    float_model = load_model(src, "float32").model
    assert (float_model.lm_head is None) == tie and isinstance(restored.lm_head, QuantLinear)
    assert restored.lm_head.kernel[...].dtype == (jnp.int8 if head == "w8" else jnp.uint8)
    assert restored.embed_tokens.embedding[...].dtype == jnp.float32
    spec = QuantSpec("w4", 32, head)
    in_memory = quantize_model(nnx.clone(float_model), spec)
    body_only = quantize_model(nnx.clone(float_model), QuantSpec("w4", 32))
    got, want, body = (prompt_logits(m, PROMPTS) for m in (restored, in_memory, body_only))
    for g, w, b in zip(got, want, body):
        np.testing.assert_allclose(g, w, rtol=1e-6, atol=1e-6)
        assert not np.allclose(g, b, atol=1e-7)  # the lm_head was quantized
        scale = np.abs(b).max()
        assert np.abs(g - b).max() < (0.01 if head == "w8" else 0.1) * scale  # by its rounding only
    with pytest.raises(ValueError, match="quant_lm_head='w8' needs quant"):
        convert_checkpoint(src, tmp_path / "bad", quant_lm_head="w8")


# ---------------------------------------------------------------- SmolLM2 (GGUF source)
@pytest.fixture(scope="module")
def smollm2_bf16(smollm2_gguf, tmp_path_factory) -> str:
    return convert_checkpoint(smollm2_gguf, tmp_path_factory.mktemp("smollm2") / "bf16", dtype="bfloat16")


def test_smollm2_converted_gives_the_same_greedy_tokens(smollm2_gguf, smollm2_bf16, smollm2_tokenizer):
    prompts = [smollm2_tokenizer.encode(p) for p in ("The capital of France is", "def fibonacci(n):")]
    original, converted = load_model(smollm2_gguf, "bfloat16"), load_model(smollm2_bf16, "bfloat16")
    assert greedy_generate(converted.model, prompts, 8) == greedy_generate(original.model, prompts, 8)


def test_smollm2_converted_keeps_tokenizer_and_chat_template(smollm2_bf16, smollm2_tokenizer):
    from lmjax.loader.tokenizer import load_tokenizer

    tok = load_tokenizer(smollm2_bf16)
    assert tok.chat_template and tok.chat_template == smollm2_tokenizer.chat_template
    chat = [{"role": "user", "content": "Hi there"}]
    assert tok.apply_chat_template(chat, tokenize=False) == smollm2_tokenizer.apply_chat_template(chat, tokenize=False)
    assert tok.encode("Hello, world") == smollm2_tokenizer.encode("Hello, world")
