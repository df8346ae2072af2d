"""One process of a two-process run (LMJAX_* coordinator variables set by the test): `python mp_driver.py CKPT
DEVICES TP CASE`. It never calls initialize_distributed itself: the facades must join the processes from the
environment alone. CASE: llm / pipeline (start an engine, greedy tokens), kv4 (int4 KV cache: its calibration
reads arrays spread over both processes), get_logits (every process calls it), leader_get_logits (process 0
leads, process 1 follows: get_logits must be refused on the leader). Prints "OK <result>" last."""
import os
import sys

ckpt, devices, tp, case = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), sys.argv[4]
os.environ["XLA_FLAGS"] = f"--xla_force_host_platform_device_count={devices}"
os.environ.setdefault("JAX_PLATFORMS", "cpu")
from lmjax import LLM, GenerationConfig, SamplingParams, TurbomindEngineConfig, pipeline  # noqa: E402

greedy = GenerationConfig(max_new_tokens=3, do_sample=False)
if case == "llm":
    llm = LLM(ckpt, tensor_parallel_size=tp, dtype="float32", max_model_len=64, max_num_seqs=2, block_size=8)
    print("OK", llm.generate([[3, 4, 5]], SamplingParams(temperature=0, max_tokens=3), use_tqdm=False)[0]
          .outputs[0].token_ids, flush=True)
    sys.exit(0)
pipe = pipeline(ckpt, backend_config=TurbomindEngineConfig(tp=tp, dtype="float32", session_len=64, cache_block_seq_len=8,
                                                           max_batch_size=2, quant_policy=4 if case == "kv4" else 0))
if case == "get_logits":
    print("OK", pipe.get_logits([[3, 4, 5, 6]])[0].shape, flush=True)
elif case == "leader_get_logits":
    import jax

    runner = pipe.engine.runner
    if jax.process_index() > 0:
        print("OK followed", runner.follow(), "steps", flush=True)
    else:
        runner.lead()
        try:
            pipe.get_logits([[3, 4, 5, 6]])
        except NotImplementedError as e:
            print("OK refused:", e, flush=True)
        finally:
            runner.release_followers()
else:
    print("OK", pipe(["t3 t4 t5"], gen_config=greedy, do_preprocess=False)[0].token_ids, flush=True)
