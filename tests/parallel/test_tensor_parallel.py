"""Tensor parallelism on CPU with forced host devices: greedy tokens at tp in {1, 2, 4, 8} (tiny
checkpoints, KV heads fewer than tp included) and tp = 3 on SmolLM2 equal tp = 1's; each device holds
1/tp of the sharded parameters; two processes joined by jax.distributed give the same tokens as one.

Forced devices must be set before jax is imported, so every multi-device check runs
tests/parallel/tp_driver.py in a subprocess (this pytest process has imported jax already).
"""
import json
import os
import subprocess
import sys

import pytest
import torch
import transformers

from processes import run_joined

DRIVER = os.path.join(os.path.dirname(__file__), "tp_driver.py")
PROMPTS = [list(range(3, 12)), list(range(20, 61)), [7]]  # 41 tokens: prefilled in two chunks
TINY = dict(vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=2, head_dim=16,
            max_position_embeddings=256, rms_norm_eps=1e-5)
CHECKPOINTS = {
    # 8 q heads over 2 KV heads: tp 4 and 8 repeat KV heads in the cache.
    "llama-kv2": (transformers.LlamaConfig, dict(num_attention_heads=8, num_key_value_heads=2)),
    # q/k/v biases, tied embeddings (vocab-parallel logits through the embedding), K == N.
    "qwen2-tied": (transformers.Qwen2Config, dict(num_attention_heads=8, num_key_value_heads=8,
                                                  tie_word_embeddings=True)),
}


def _write_tokenizer(vocab_size: int, out_dir: str) -> None:
    from tokenizers import Tokenizer, models, pre_tokenizers

    tok = Tokenizer(models.WordLevel({f"t{i}": i for i in range(vocab_size)}, unk_token="t2"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    transformers.PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="t0", bos_token="t1",
                                         unk_token="t2").save_pretrained(out_dir)


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory) -> dict[str, str]:
    paths = {}
    for name, (cfg_cls, overrides) in CHECKPOINTS.items():
        path = str(tmp_path_factory.mktemp(name))
        torch.manual_seed(0)
        config = cfg_cls(**TINY, **overrides, bos_token_id=1, eos_token_id=0)
        transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32).save_pretrained(path)
        _write_tokenizer(TINY["vocab_size"], path)
        paths[name] = path
    return paths


def _drive(spec: dict, env: dict | None = None, timeout: int = 300) -> dict:
    proc = subprocess.run([sys.executable, DRIVER, json.dumps(spec)], capture_output=True, text=True,
                          timeout=timeout, env={**os.environ, **(env or {})})
    assert proc.returncode == 0, proc.stderr[-4000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


def _check_param_bytes(run: dict, tp: int) -> None:
    """Every device holds replicated pieces whole and 1/tp of everything else."""
    sharded = run["total_bytes"] - run["replicated_bytes"]
    assert run["device_bytes"] == [sharded // tp + run["replicated_bytes"]] * tp
    assert run["replicated_bytes"] < 0.2 * run["total_bytes"], run


@pytest.mark.parametrize("name", sorted(CHECKPOINTS))
def test_tiny_engine_tp_matches_tp1(checkpoints, name):
    out = _drive({"model": checkpoints[name], "tp": [1, 2, 4, 8], "prompts": PROMPTS})
    runs = {int(tp): run for tp, run in out["runs"].items()}
    for tp, run in runs.items():
        assert run["tokens"] == runs[1]["tokens"], f"{name} tp={tp}"
        if tp > 1:
            _check_param_bytes(run, tp)


def test_sampling_apart_and_background_compiles_under_tp(checkpoints):
    """Non-basic sampling runs apart from the model step on replicated logits, and its multi-step variant
    compiles on the worker thread under the mesh: tp = 2 draws tp = 1's tokens, before and after it is ready."""
    out = _drive({"model": checkpoints["llama-kv2"], "tp": [1, 2], "prompts": PROMPTS, "mode": "background"},
                 env={"LMJAX_ATTENTION_IMPL": "tiled", "LMJAX_BACKGROUND_COMPILE": "1"})  # one width: one variant
    runs = {int(tp): run for tp, run in out["runs"].items()}
    for run in runs.values():
        assert run["tokens"] == run["again"] == runs[1]["tokens"]
        assert run["background"] == 1 and run["loops_after"] > 0


def test_notebook_shard_model_runs_same_step(checkpoints):
    """The public rules applied to an already built model (lmjax.parallel.shard_model), run through
    lmjax.models.forward.greedy_generate: the researcher's path."""
    out = _drive({"model": checkpoints["llama-kv2"], "tp": [1, 4], "prompts": PROMPTS, "mode": "notebook"})
    assert out["runs"]["4"]["tokens"] == out["runs"]["1"]["tokens"]
    _check_param_bytes(out["runs"]["4"], 4)


def test_fused_add_norm_kernel_under_tp(checkpoints):
    """LMJAX_NORM_IMPL=kernel: the fused add + RMSNorm kernel (interpret mode) runs on every device's
    replicated hidden states in shard_map; tp = 4 gives tp = 1's tokens."""
    out = _drive({"model": checkpoints["llama-kv2"], "tp": [1, 4], "prompts": PROMPTS, "mode": "notebook"},
                 env={"LMJAX_NORM_IMPL": "kernel"})
    runs = out["runs"]
    assert runs["4"]["tokens"] == runs["1"]["tokens"]
    per_trace = 2 * TINY["num_hidden_layers"] + 1  # two per layer and the final norm
    assert runs["1"]["norm_kernel_calls"] == runs["4"]["norm_kernel_calls"] == 2 * per_trace  # prefill, decode


def test_fused_rope_kv_write_kernel_under_tp(checkpoints):
    """LMJAX_KV_WRITE_IMPL=kernel (the GPU default; interpret mode here): q/k/v merge into one weight in
    per-device blocks and the fused RoPE + KV-write kernel runs in shard_map on each device's heads (q/k/v
    biases included); tp = 4 gives tp = 1's tokens and each device still holds 1/tp of the weights."""
    out = _drive({"model": checkpoints["qwen2-tied"], "tp": [1, 4], "prompts": PROMPTS},
                 env={"LMJAX_KV_WRITE_IMPL": "kernel"})
    runs = out["runs"]
    assert runs["1"]["qkv_shards"] == [1] and runs["4"]["qkv_shards"] == [4]
    assert runs["4"]["tokens"] == runs["1"]["tokens"]
    _check_param_bytes(runs["4"], 4)


def test_step_communicates_activations_only(checkpoints):
    """The compiled engine step at tp = 4 (tied embedding, vocab-parallel logits) all-reduces [T, D]
    activations (embedding, then o_proj and down_proj per layer) and gathers only the [B, V] logits:
    no collective ever moves a weight."""
    out = _drive({"model": checkpoints["qwen2-tied"], "tp": [4], "prompts": PROMPTS, "mode": "collectives"})
    collectives = out["runs"]["4"]["collectives"]
    T, B, D, V = 16, 4, TINY["hidden_size"], TINY["vocab_size"]
    assert sorted(collectives) == sorted([["all-reduce", T * D]] * (1 + 2 * TINY["num_hidden_layers"])
                                         + [["all-gather", B * V]]), collectives


def test_pallas_kernel_in_shard_map_matches_reference():
    out = _drive({"tp": [4], "mode": "kernel", "devices": 4})
    assert out["runs"]["4"]["max_abs_diff"] < 1e-5


def test_smollm2_tp3_matches_tp1(smollm2_pruned):
    """9 q heads, 3 KV heads, tied 49152-token vocabulary: tp = 3 (real weights; six of SmolLM2's layers, as
    the sharding of one is that of all)."""
    tokenizer_prompts = [[504, 3575, 282, 4649, 314], [1029, 28860, 30, 94, 46, 1]]
    out = _drive({"model": smollm2_pruned, "tp": [1, 3], "prompts": tokenizer_prompts, "max_tokens": 16,
                  "devices": 3})
    assert out["runs"]["3"]["tokens"] == out["runs"]["1"]["tokens"]
    _check_param_bytes(out["runs"]["3"], 3)


@pytest.fixture(scope="module")
def one_process_tokens(checkpoints):
    return _drive({"model": checkpoints["llama-kv2"], "tp": [1], "prompts": PROMPTS, "devices": 1})["runs"]["1"]["tokens"]


@pytest.mark.parametrize("leader", [False, True], ids=["same-program", "one-scheduler"])
def test_two_processes_match_one(checkpoints, one_process_tokens, leader):
    """Two processes of 2 CPU devices each, joined by jax.distributed (LMJAX_* environment), run tp = 4
    over all four devices and produce the tokens one process produces at tp = 1: either both run the
    same engine calls, or process 0's scheduler drives process 1 (ModelRunner.lead / follow)."""
    path = checkpoints["llama-kv2"]
    spec = json.dumps({"model": path, "tp": [4], "prompts": PROMPTS, "devices": 2, "leader": leader})
    results = []
    for returncode, stdout, stderr in run_joined([sys.executable, DRIVER, spec]):
        assert returncode == 0, stderr[-4000:]
        results.append(json.loads(stdout.strip().splitlines()[-1]))
    assert [r["process"] for r in results] == [0, 1]
    assert all(r["devices"] == 4 for r in results)
    assert results[0]["runs"]["4"]["tokens"] == one_process_tokens
    if leader:
        assert results[1]["runs"]["4"]["followed_steps"] >= 8
    else:
        assert results[1]["runs"]["4"]["tokens"] == one_process_tokens


def test_head_count_that_does_not_fit_is_a_clear_error(checkpoints):
    from lmjax import LLM

    with pytest.raises(ValueError, match=r"num_attention_heads=8 is not divisible by tp=3"):
        LLM(checkpoints["llama-kv2"], tensor_parallel_size=3, dtype="float32")


def test_rules_are_public_and_kept_apart_from_the_model():
    from jax.sharding import AbstractMesh, PartitionSpec as P

    from lmjax import parallel
    from lmjax.models.config import ModelConfig

    mesh = AbstractMesh((4,), ("tp",))
    assert parallel.param_spec(("layers", 0, "self_attn", "q_proj", "kernel"), (64, 128), mesh) == P(None, "tp")
    assert parallel.param_spec(("layers", 0, "self_attn", "o_proj", "kernel"), (128, 64), mesh) == P("tp")
    assert parallel.param_spec(("layers", 0, "mlp", "down_proj", "kernel"), (128, 64), mesh) == P("tp")
    assert parallel.param_spec(("layers", 0, "mlp", "up_proj", "kernel"), (64, 128), mesh) == P(None, "tp")
    assert parallel.param_spec(("embed_tokens", "embedding"), (256, 64), mesh) == P("tp")
    assert parallel.param_spec(("lm_head", "kernel"), (64, 256), mesh) == P(None, "tp")
    assert parallel.param_spec(("norm", "weight"), (64,), mesh) == P()
    assert parallel.param_spec(("embed_tokens", "embedding"), (257, 64), mesh) == P()  # uneven: replicated
    # a quantized layer's scales follow its kernel: w8 [O], w4 [groups, O] (groups along o/down's input)
    q_scale = ("layers", 0, "self_attn", "q_proj", "scale")
    assert parallel.param_spec(q_scale, (128,), mesh) == P("tp")
    assert parallel.param_spec(q_scale, (4, 128), mesh) == P(None, "tp")
    assert parallel.param_spec(("layers", 0, "mlp", "down_proj", "offset"), (8, 64), mesh) == P("tp")
    assert parallel.param_spec(("layers", 0, "mlp", "down_proj", "scale"), (64,), mesh) == P()
    assert parallel.param_spec(("lm_head", "scale"), (2, 256), mesh) == P(None, "tp")
    assert parallel.param_spec(("layers", 0, "mlp", "down_proj", "offset"), (6, 64), mesh) == P()  # 6 groups
    cfg = ModelConfig("LlamaForCausalLM", 256, 64, 128, 2, num_heads=8, num_kv_heads=2, head_dim=16,
                      rms_norm_eps=1e-5, rope=None, max_position_embeddings=256)
    k_path = ("layers", 0, "self_attn", "k_proj", "kernel")
    assert parallel.param_spec(k_path, (64, 32), mesh, cfg) == P()  # 2 KV heads < tp: replicated
    assert parallel.kv_cache_heads(2, 4) == 4 and parallel.kv_cache_heads(8, 4) == 8
    custom = {**parallel.DEFAULT_RULES, "mlp": None}  # a notebook's own rules
    assert parallel.param_spec(("layers", 0, "mlp", "up_proj", "kernel"), (64, 128), mesh, rules=custom) == P()
    parallel.check_tp(cfg, 8)
    with pytest.raises(ValueError, match=r"num_attention_heads=8 is not divisible by tp=6.*\[1, 2, 4, 8\]"):
        parallel.check_tp(cfg, 6)


def test_kv_cache_sizing_counts_one_device_share():
    from lmjax.engine.cache_sizing import bytes_per_block
    from lmjax.models.config import ModelConfig

    def cfg(kv_heads):
        return ModelConfig("LlamaForCausalLM", 256, 64, 128, 2, num_heads=8, num_kv_heads=kv_heads, head_dim=16,
                           rms_norm_eps=1e-5, rope=None, max_position_embeddings=256)

    one = bytes_per_block(cfg(8), 16, "float32")
    assert bytes_per_block(cfg(8), 16, "float32", tp=4) == one // 4  # 2 of 8 KV heads per device
    # 2 KV heads over 4 devices: each device keeps the one KV head its query heads read.
    assert bytes_per_block(cfg(2), 16, "float32", tp=4) == bytes_per_block(cfg(2), 16, "float32") // 2
