"""How many KV-cache blocks to allocate: LMDeploy's rules (num_gpu_blocks, else cache_max_entry_count as
a block count when > 1 or a fraction of free device memory), capped at what the engine can ever use."""
from __future__ import annotations

import jax
import jax.numpy as jnp

from lmjax import parallel
from lmjax.config import EngineConfig
from lmjax.layers.kv_quant import kv_bytes_per_token
from lmjax.models.config import ModelConfig

# CPU devices report no memory limit; the fraction then applies to this budget (host RAM is shared
# with everything else, and CPU runs are small).
CPU_CACHE_BUDGET_BYTES = 2 << 30


def bytes_per_block(model: ModelConfig, block_size: int, dtype, tp: int = 1, quant_policy: int = 0) -> int:
    """Bytes one block takes on each device: with tp > 1 the cache is sharded on KV heads (each KV head
    repeated when tp does not divide them, see lmjax.parallel.kv_cache_heads). quant_policy 8 / 4: codes
    plus per-token scale and zero point (`kv_bytes_per_token`), so the same memory holds more blocks."""
    heads = parallel.kv_cache_heads(model.num_kv_heads, tp) // tp if tp > 1 else model.num_kv_heads
    return block_size * kv_bytes_per_token(model.num_layers, heads, model.head_dim, quant_policy, dtype)


def device_memory() -> tuple[int, int]:
    """(limit, in use) bytes of the first local device (a CPU: the budget, nothing in use)."""
    stats = jax.local_devices()[0].memory_stats() or {}
    if "bytes_limit" in stats:
        return int(stats["bytes_limit"]), int(stats.get("bytes_in_use", 0))
    return CPU_CACHE_BUDGET_BYTES, 0


def cache_budget_bytes(cfg: EngineConfig) -> int:
    """Free memory, or with vLLM's gpu_memory_utilization the engine's share of the device less what is in use
    (the weights, placed by now): what cache_max_entry_count's fraction applies to."""
    limit, in_use = device_memory()
    if cfg.gpu_memory_utilization is None:
        return limit - in_use
    budget = int(limit * cfg.gpu_memory_utilization) - in_use
    if budget <= 0:
        share = limit * cfg.gpu_memory_utilization / 2**30
        raise ValueError(f"gpu_memory_utilization={cfg.gpu_memory_utilization} leaves no memory for the KV cache: "
                         f"{in_use / 2**30:.2f} GiB are in use (the weights) of its {share:.2f} GiB")
    return budget


def kv_cache_blocks(cfg: EngineConfig, model: ModelConfig, dtype, session_len: int) -> int:
    """Block count, block 0 (the padding sink) included."""
    per_block = bytes_per_block(model, cfg.block_size, dtype, cfg.tp, cfg.quant_policy)
    requested = cfg.num_gpu_blocks or cfg.cache_max_entry_count > 1
    blocks = cfg.num_blocks(cache_budget_bytes(cfg), per_block)
    if jax.process_count() > 1:  # every process must allocate the same cache (one SPMD program)
        from jax.experimental import multihost_utils

        blocks = int(multihost_utils.process_allgather(jnp.int32(blocks)).min())
    if not requested:  # a fraction: never more than every sequence at full session length needs
        blocks = min(blocks, 1 + cfg.max_batch_size * -(-session_len // cfg.block_size))
    if blocks < 2:
        raise ValueError(f"KV cache of {blocks} blocks is too small: raise cache_max_entry_count "
                         f"({cfg.cache_max_entry_count}) or num_gpu_blocks ({cfg.num_gpu_blocks})")
    return blocks
