"""One process of a two-process, same-program run (every process runs the same engine calls: lmjax.parallel's
first mode), pad on. Process 1's compile worker is slower (another host, another load): its background
compilations take 3 s longer. Prints JSON tokens last. (tests/parallel/test_same_program_padding.py)"""
import json
import os
import sys
import time

os.environ["XLA_FLAGS"] = "--xla_force_host_platform_device_count=2"
os.environ.setdefault("JAX_PLATFORMS", "cpu")
os.environ["LMJAX_BACKGROUND_COMPILE"] = "1"
os.environ["LMJAX_PAD_TO_COMPILED"] = sys.argv[2]
import jax  # noqa: E402
from lmjax import LLM, SamplingParams  # noqa: E402
from lmjax.engine import background_compile as bc  # noqa: E402

llm = LLM(sys.argv[1], tensor_parallel_size=4, dtype="float32", max_model_len=128, block_size=8, enforce_eager=False,
          enable_prefix_caching=False, max_num_seqs=4, max_num_batched_tokens=256, num_scheduler_steps=1)
if jax.process_index() == 1:
    real = bc._compile
    bc._compile = lambda lowered: (time.sleep(3), real(lowered))[1]
runner = llm.llm_engine.runner
params = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)
prompts = [{"prompt_token_ids": list(range(5, 5 + 20 + i))} for i in range(3)]
toks = [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]
time.sleep(1.5)  # process 0's worker is done with the new shapes, process 1's is not
toks += [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]
print(json.dumps({"process": jax.process_index(), "tokens": toks, "padded": runner.num_padded_steps}), flush=True)
