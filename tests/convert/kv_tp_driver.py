"""Greedy tokens of the engine with a quantized KV cache at tp = 1 and tp = 3 (SmolLM2: 9 q heads, 3
KV heads), in a fresh process with 3 forced CPU devices (the device count must be set before jax is
imported). Prints one JSON line: {"policy": {"tp": {"tokens", "shard_shapes", "map_shard_shapes", "devices"}}}
(map_shard_shapes: the int4 K cache's calibrated maps, sharded like its heads).

    python tests/convert/kv_tp_driver.py '{"model": GGUF, "policies": [8, 4], "prompts": [[1, 2]]}'
"""
import json
import os
import sys

SPEC = json.loads(sys.argv[1])
os.environ["XLA_FLAGS"] = "--xla_force_host_platform_device_count=3"
os.environ.setdefault("JAX_PLATFORMS", "cpu")

from lmjax.config import EngineConfig, SamplingParams  # noqa: E402
from lmjax.engine.engine import LLMEngine  # noqa: E402


def run(policy: int, tp: int) -> dict:
    engine = LLMEngine(SPEC["model"], EngineConfig(dtype="float32", tp=tp, quant_policy=policy, block_size=16,
                                                   num_gpu_blocks=32, max_batch_size=4, session_len=128))
    params = SamplingParams(temperature=0, max_tokens=SPEC.get("max_tokens", 12), ignore_eos=True)
    reqs = [engine.add_request(p, params) for p in SPEC["prompts"]]
    while engine.has_unfinished():
        engine.step()
    k_cache = engine.runner.caches[0][0]
    shards = [s.data.shape for s in k_cache.data_PSKW.addressable_shards]
    maps = [] if k_cache.k_map_KHH is None else [s.data.shape for s in k_cache.k_map_KHH.addressable_shards]
    return {"tokens": [list(r.completions[0].token_ids) for r in reqs], "shard_shapes": shards, "map_shard_shapes": maps,
            "devices": len({s.device for s in k_cache.scale_PSK.addressable_shards})}


print(json.dumps({p: {tp: run(p, tp) for tp in (1, 3)} for p in SPEC["policies"]}), flush=True)
