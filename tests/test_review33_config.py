"""Review 33 of the engine configs against LMDeploy's and vLLM's: vLLM's gpu_memory_utilization is the engine's
whole share of device memory (was a fraction of free memory for the KV cache alone); quant_policy=4 (int4 since
LMDeploy 0.4; the seed docs' older "4 for 8-bit k/v") warns unless kv_bits=4 says so, and a kv_bits that
contradicts it is refused; vLLM's max_num_batched_tokens >= max_num_seqs; bool fields are bools; zero or negative
block counts and an infinite rope_scaling_factor are refused; the old and new names of the prefill budget must
agree; PytorchEngineConfig(eager_mode=True) is accepted with no effect."""
import types

import jax
import jax.numpy as jnp
import pytest

from lmjax import EngineConfig, PytorchEngineConfig, TurbomindEngineConfig
from tiny_llama import write_tiny_llama

GiB = 1 << 30


def _blocks_on_fake_device(monkeypatch, cfg: EngineConfig, limit: int, in_use: int) -> int:
    import lmjax.engine.cache_sizing as cs
    from lmjax.models.config import ModelConfig  # noqa: F401  (the tiny config below)

    device = types.SimpleNamespace(memory_stats=lambda: {"bytes_limit": limit, "bytes_in_use": in_use})
    monkeypatch.setattr(cs, "jax", types.SimpleNamespace(local_devices=lambda: [device],
                                                         process_count=jax.process_count))
    model = types.SimpleNamespace(num_kv_heads=2, num_layers=2, head_dim=16)
    per_block = cs.bytes_per_block(model, cfg.block_size, jnp.bfloat16)
    return cs.kv_cache_blocks(cfg, model, jnp.bfloat16, 512) * per_block


def test_gpu_memory_utilization_is_the_engines_share(monkeypatch):
    cfg = EngineConfig(gpu_memory_utilization=0.9, cache_max_entry_count=1.0, max_batch_size=10**6)
    kv = _blocks_on_fake_device(monkeypatch, cfg, 60 * GiB, 40 * GiB)
    assert 13.9 * GiB < kv <= 14 * GiB  # 0.9 x 60 - 40, not 0.9 x (60 - 40)
    with pytest.raises(ValueError, match="gpu_memory_utilization=0.5 leaves no memory for the KV cache"):
        _blocks_on_fake_device(monkeypatch, EngineConfig(gpu_memory_utilization=0.5, cache_max_entry_count=1.0),
                               60 * GiB, 40 * GiB)
    lmdeploy = EngineConfig(cache_max_entry_count=0.5, max_batch_size=10**6)  # LMDeploy's: free memory's share
    assert 9.9 * GiB < _blocks_on_fake_device(monkeypatch, lmdeploy, 60 * GiB, 40 * GiB) <= 10 * GiB


def test_llm_passes_vllms_memory_and_batch_limits(tmp_path):
    from lmjax import LLM

    path = write_tiny_llama(tmp_path / "tiny")
    llm = LLM(path, gpu_memory_utilization=0.5, max_num_seqs=4, max_num_batched_tokens=64)
    assert llm.llm_engine.config.gpu_memory_utilization == 0.5
    with pytest.raises(ValueError, match=r"max_num_batched_tokens \(4\) must be greater than or equal to "
                                         r"max_num_seqs \(8\)"):
        LLM(path, max_num_batched_tokens=4, max_num_seqs=8)
    for name in ("max_num_seqs", "max_num_batched_tokens"):
        with pytest.raises(ValueError, match=f"{name} must be an int >= 1, got 0"):
            LLM(path, **{name: 0})


def test_quant_policy_4_and_kv_bits(caplog):
    with caplog.at_level("WARNING", logger="lmjax"):
        assert TurbomindEngineConfig(quant_policy=4).to_engine_config().quant_policy == 4
    assert "quant_policy=4 is an int4 KV cache" in caplog.text
    caplog.clear()
    with caplog.at_level("WARNING", logger="lmjax"):
        assert TurbomindEngineConfig(quant_policy=4, kv_bits=4).to_engine_config().quant_policy == 4
    assert "int4" not in caplog.text
    for policy in (8, 0):  # (kv_bits=4 alone would quantize nothing: LMDeploy's bits need quant_policy)
        with pytest.raises(ValueError, match=f"kv_bits=4 does not fit quant_policy={policy}"):
            TurbomindEngineConfig(quant_policy=policy, kv_bits=4).to_engine_config()


@pytest.mark.parametrize("fields,message", [
    ({"use_logn_attn": "False"}, "use_logn_attn must be True or False, got str 'False'"),
    ({"enable_prefix_caching": "no"}, "enable_prefix_caching must be True or False"),
    ({"cache_max_entry_count": 0}, "cache_max_entry_count must be a fraction in"),
    ({"cache_max_entry_count": -2}, "cache_max_entry_count must be a fraction in"),
    ({"rope_scaling_factor": float("inf")}, "rope_scaling_factor must be a finite number >= 0, got inf"),
])
def test_bad_engine_values_refused(fields, message):
    with pytest.raises(ValueError, match=message):
        EngineConfig(**fields)
    with pytest.raises(ValueError, match=message):
        TurbomindEngineConfig(**fields).to_engine_config()


def test_old_and_new_prefill_budget_names_must_agree():
    assert TurbomindEngineConfig(max_context_token_num=2048).to_engine_config().max_prefill_token_num == 2048
    with pytest.raises(ValueError, match="max_context_token_num=2048 .* max_prefill_token_num=512 differ"):
        TurbomindEngineConfig(max_context_token_num=2048, max_prefill_token_num=512).to_engine_config()


def test_pytorch_eager_mode_has_no_effect(caplog):
    from lmjax.validation import warn_once

    warn_once.cache_clear()  # (logged once a process)
    with caplog.at_level("WARNING", logger="lmjax"):  # (a pipeline's log_level may have raised lmjax's level)
        assert PytorchEngineConfig(eager_mode=True).to_engine_config().warmup is False
    assert "eager_mode=True) has no effect" in caplog.text


def test_cli_gpu_memory_utilization_is_vllms(monkeypatch):
    from lmjax import cli

    built = {}
    monkeypatch.setattr("lmjax.api.async_engine.AsyncEngine.__init__",
                        lambda self, model, backend_config=None, **kw: built.update(config=backend_config))
    for flags, want in ((["--gpu-memory-utilization", "0.3"], (0.3, 1.0)), ([], (None, 0.5)),
                        (["--cache-max-entry-count", "0.2"], (None, 0.2))):
        args = cli.build_parser().parse_args(["serve", "api_server", "./m", *flags])
        built.clear()
        cli._async_engine(args, "ERROR")
        config = built["config"]
        assert (config.gpu_memory_utilization, config.cache_max_entry_count) == want, flags
