"""Engine decode step time with and without multi-step decode on a random-weight model (GPU smoke run).

    STEPS=8 LMJAX_ATTENTION_IMPL=kernel python benchmarks/decode_steps.py llama-3.2-1b bfloat16 32 64

Args: shape dtype num_prompts max_tokens. Prints end-to-end tok/s of a 2nd pass and, at batch 1 and 32,
decode ms/step = (time for 129 new tokens - time for 1) / 128. Warm-up only reaches 4 tokens: a
block-table bucket crossed later compiles inside the timed pass (see BENCHMARKS.md).
"""
import sys, time, logging, os
logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(message)s")
for n in ("jax", "absl"): logging.getLogger(n).setLevel(logging.WARNING)
sys.path.insert(0, "benchmarks")
from random_model import write_random_checkpoint, SHAPES
shape, dtype, n, T = sys.argv[1], sys.argv[2], int(sys.argv[3]), int(sys.argv[4])
d = f"/tmp/ckpt_{shape}_{dtype}"
t = time.time()
if not os.path.exists(d): write_random_checkpoint(shape, d, dtype=dtype)
print("ckpt", time.time() - t, flush=True)
import numpy as np
from lmjax import LLM, SamplingParams
t = time.time()
llm = LLM(d, dtype=dtype, max_model_len=1024, max_num_seqs=64, gpu_memory_utilization=0.3, num_scheduler_steps=int(os.environ.get("STEPS", "8")), enable_prefix_caching=False)
print("load", time.time() - t, flush=True)
rng = np.random.default_rng(0)
V = SHAPES[shape]["vocab_size"]
prompts = [rng.integers(10, V, int(k)).tolist() for k in rng.integers(16, 256, n)]
p = SamplingParams(temperature=0, max_tokens=T, ignore_eos=True)
for rep in range(2):
    t = time.time(); outs = llm.generate(prompts, p, use_tqdm=False); dt = time.time() - t
    print(f"run{rep} steps={os.environ.get('STEPS')} {dt:.2f}s  {n*T/dt:.1f} tok/s compiles={llm.llm_engine.runner.num_compilations}", flush=True)
for B in (1, 32):
    q = prompts[:B]
    llm.generate(q, SamplingParams(temperature=0, max_tokens=4, ignore_eos=True), use_tqdm=False)
    t = time.time(); llm.generate(q, SamplingParams(temperature=0, max_tokens=129, ignore_eos=True), use_tqdm=False)
    t1 = time.time() - t
    t = time.time(); llm.generate(q, SamplingParams(temperature=0, max_tokens=1, ignore_eos=True), use_tqdm=False)
    t0 = time.time() - t
    print(f"B={B} steps={os.environ.get('STEPS')} decode ms/step {(t1 - t0) / 128 * 1000:.2f} (prefill+1 {t0*1000:.1f} ms)", flush=True)
print("TOKENS", os.environ.get("LMJAX_ATTENTION_IMPL"), [o.outputs[0].token_ids[:12] for o in outs[:4]], flush=True)
