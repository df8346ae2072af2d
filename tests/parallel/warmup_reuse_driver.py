"""A warmed engine under tp on forced CPU devices: the decode call's jit cache size after warm-up and after each of
three greedy batches, printed as one JSON line (tests/engine/test_padded_steps_fixes.py)."""
import json
import os
import sys

os.environ["XLA_FLAGS"] = "--xla_force_host_platform_device_count=2"
os.environ["JAX_PLATFORMS"] = "cpu"
os.environ["LMJAX_BACKGROUND_COMPILE"] = "0"
from lmjax import LLM, SamplingParams  # noqa: E402

llm = LLM(sys.argv[1], tensor_parallel_size=int(sys.argv[2]), max_model_len=128, block_size=8, enforce_eager=False,
          max_num_seqs=8, num_scheduler_steps=4)
runner = llm.llm_engine.runner
warmed = runner._decode.jitted._cache_size()
greedy = SamplingParams(max_tokens=20, ignore_eos=True, temperature=0)
sizes = []
for n in (1, 3, 6):
    llm.generate([[5, 9, 12, 30, 41 + i] for i in range(n)], greedy, use_tqdm=False)
    sizes.append(runner._decode.jitted._cache_size())
print(json.dumps({"warmed": warmed, "after": sizes, "chained": llm.llm_engine.num_chained_loops}))
