"""Decode step time at tensor-parallel sizes (tp=2 vs tp=1 by default) on a Llama-3-8B-shaped model.

Run on a machine with >= 2 GPUs (e.g. 2 x H200):

    python benchmarks/tp_decode.py                       # llama-3-8b shape, random bf16 weights, tp 1 and 2
    python benchmarks/tp_decode.py --shape tiny --tp 1 2 # quick check (on CPU: XLA_FLAGS=--xla_force_host_platform_device_count=2)
    python benchmarks/tp_decode.py --checkpoint DIR      # a checkpoint (e.g. written by benchmarks/random_model.py)
    python benchmarks/tp_decode.py --tp 1 --quant w4     # int4 weights (RTN of the random ones, g128)

What is timed: the engine's own jitted step (`ModelRunner._step`: forward over the padded decode batch,
lm_head on the last rows, greedy sampling, KV cache donated), batch 1 at a context of `--context`
tokens, each step's token read back to the host before the next is dispatched (as the engine does).
Median and p10/p90 of `--iters` steps after `--warmup`. Weights: the shape's config from
benchmarks/random_model.py (SHAPES), random normal * 0.02 generated on the devices straight into their
shards by lmjax.parallel's rules (no checkpoint, no host copy: an 8B model is ready in seconds); with
--checkpoint, lmjax's loader loads it at each tp instead.
Prints one JSON line per tp and a summary line with the tp=2 / tp=1 speedup.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.sharding import NamedSharding

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from random_model import SHAPES  # noqa: E402

from lmjax import parallel  # noqa: E402
from lmjax.config import SamplingParams  # noqa: E402
from lmjax.engine.decode_loop import DecodeInputs  # noqa: E402
from lmjax.engine.model_runner import ModelRunner, StepInputs, bucket  # noqa: E402
from lmjax.layers.attention import AttentionMetadata  # noqa: E402
from lmjax.layers.quant import QuantSpec, quantize_model  # noqa: E402
from lmjax.layers.sampler import SamplingRow, build_sampling_metadata  # noqa: E402
from lmjax.loader.model_loader import load_model  # noqa: E402
from lmjax.models.llama import LlamaForCausalLM  # noqa: E402
from lmjax.models.registry import parse_config  # noqa: E402


def random_model(shape: str, dtype, tp: int):
    """The shape's model with random weights created on the devices, already sharded for tp."""
    hf = {**SHAPES[shape], "architectures": ["LlamaForCausalLM"], "rms_norm_eps": 1e-5}
    cfg = parse_config(hf)
    mesh = parallel.make_mesh(tp) if tp > 1 else None
    if mesh is not None:
        parallel.check_tp(cfg, tp)
    graphdef, abstract = nnx.split(nnx.eval_shape(lambda: LlamaForCausalLM(cfg, dtype=dtype)))
    flat = nnx.to_flat_state(abstract)
    key, makers = jax.random.key(0), {}
    for i, (path, var) in enumerate(flat):
        shape_, is_norm = tuple(var.shape), path[-1] == "weight"
        spec = parallel.param_spec(path, shape_, mesh, cfg) if mesh is not None else None
        if (shape_, is_norm, spec) not in makers:  # one compilation per distinct parameter kind
            sharding = NamedSharding(mesh, spec) if mesh is not None \
                else jax.sharding.SingleDeviceSharding(jax.devices()[0])

            def make(k, shape_=shape_, is_norm=is_norm):
                if is_norm:
                    return jnp.ones(shape_, dtype)
                return (jax.random.normal(k, shape_, jnp.float32) * 0.02).astype(dtype)

            makers[shape_, is_norm, spec] = jax.jit(make, out_shardings=sharding)
        var.set_value(makers[shape_, is_norm, spec](jax.random.fold_in(key, i)))
    return nnx.merge(graphdef, nnx.from_flat_state(flat)), cfg


def context_blocks(context: int, block_size: int) -> tuple[int, int]:
    """(cache blocks the sequence holds, block-table width M)."""
    blocks = -(-context // block_size)
    return blocks, bucket(blocks, 1)


def decode_inputs(context: int, block_size: int, vocab: int, min_decode_B: int):
    """Numpy StepInputs for one decode token of one sequence at position context - 1 (T padded as build_inputs
    pads; B as the multi-step decode call pads (the runner's `min_decode_B`), which time_multi_step reuses)."""
    T, B = bucket(1, 16), bucket(1, min_decode_B)
    blocks, M = context_blocks(context, block_size)
    table = np.zeros((B, M), np.int32)
    table[0, :blocks] = np.arange(1, blocks + 1)
    pos = context - 1
    ids, positions, slots = np.zeros(T, np.int32), np.zeros(T, np.int32), np.zeros(T, np.int32)
    seq_lens = np.ones(T, np.int32)
    ids[0], positions[0], seq_lens[0] = 7 % vocab, pos, context
    slots[0] = table[0, pos // block_size] * block_size + pos % block_size
    kv_lens = np.zeros(B, np.int32)
    kv_lens[0] = context
    cu = np.array([0] + [1] * B, np.int32)
    attn = AttentionMetadata(slot_mapping_T=slots, seq_lens_T=seq_lens, kv_lens_B=kv_lens, block_tables_BM=table,
                             cu_q_lens_B1=cu)
    return StepInputs(ids_T=ids, positions_T=positions, attn=attn, last_rows_B=np.zeros(B, np.int32),
                      next_ids_T=np.full(T, -1, np.int32))


def time_multi_step(runner, caches, inputs: StepInputs, smeta, flags, args):
    """Per-step time of the engine's multi-step decode (`--steps` steps per call, tokens fed back on the
    device, read back once per call): the device step without the host round trip."""
    B = inputs.last_rows_B.shape[0]
    pos = int(np.asarray(inputs.positions_T)[0])
    dec = DecodeInputs(ids_B=inputs.ids_T[:B], positions_B=jnp.zeros(B, jnp.int32).at[0].set(pos - args.steps),
                       block_tables_BM=inputs.attn.block_tables_BM, num_valid=jnp.int32(1))
    if runner.mesh is not None:
        dec = parallel.replicate(dec, runner.mesh)
    calls, tokens = [], None
    for i in range(3 + max(args.iters // args.steps, 5)):
        t0 = time.perf_counter()
        out, caches = runner._decode.jitted(runner.params, caches, dec, smeta, flags=flags, num_steps=args.steps)
        step_tokens = np.asarray(out.token_ids_B)[:, 0].tolist()
        tokens = tokens or step_tokens  # every call decodes the same positions from the same token
        if i >= 3:  # the first call compiles
            calls.append(time.perf_counter() - t0)
    if args.profile:
        import trace_summary  # benchmarks/trace_summary.py
        tp = len(jax.devices()) if runner.mesh is not None else 1
        trace_dir = os.path.join(args.profile, f"tp{tp}" + (f"-p{jax.process_index()}" if jax.process_count() > 1 else ""))
        with jax.profiler.trace(trace_dir, create_perfetto_trace=True):
            for _ in range(2):
                out, caches = runner._decode.jitted(runner.params, caches, dec, smeta, flags=flags, num_steps=args.steps)
                np.asarray(out.token_ids_B)
        print(f"profile of 2 calls x {args.steps} steps ({trace_dir}):")
        try:
            trace_summary.print_summary(trace_summary.summarize(trace_dir, steps=2 * args.steps))
        except ValueError as e:  # e.g. on CPU: no GPU kernels in the trace
            print(e)
    return statistics.median(calls) * 1e3 / args.steps, tokens, caches


def bench(args, tp: int) -> dict:
    dtype = jnp.dtype(args.dtype)
    t0 = time.perf_counter()
    if args.checkpoint:
        loaded = load_model(args.checkpoint, args.dtype, tp=tp)
        model, cfg = loaded.model, loaded.config
    else:
        model, cfg = random_model(args.shape, dtype, tp)
    if args.quant:  # round to nearest on the device: the bytes a step reads are those of any w4 / w8 conversion
        quantize_model(model, QuantSpec(args.quant, lm_head=args.quant_lm_head))
    jax.block_until_ready(nnx.state(model))
    load_s = time.perf_counter() - t0
    blocks, M = context_blocks(args.context, args.block_size)
    runner = ModelRunner(model, blocks + 1, args.block_size, 1, 1, M, dtype)  # + the sink block 0
    inputs = decode_inputs(args.context, args.block_size, cfg.vocab_size, runner.min_decode_B)
    smeta, flags = build_sampling_metadata([SamplingRow(SamplingParams(temperature=0), seed=0)],
                                           pad_to=inputs.last_rows_B.shape[0])
    inputs, smeta = parallel.replicate((inputs, smeta), runner.mesh) if runner.mesh is not None \
        else jax.device_put((inputs, smeta))
    caches = runner.caches
    times = []
    with parallel.use_mesh(runner.mesh):
        t0 = time.perf_counter()
        out, _, _, caches = runner._step(runner.params, caches, inputs, smeta, flags=flags, num_prompt_logprobs=-1)
        np.asarray(out.token_ids_B)
        compile_s = time.perf_counter() - t0
        for i in range(args.warmup + args.iters):
            t0 = time.perf_counter()
            out, _, _, caches = runner._step(runner.params, caches, inputs, smeta, flags=flags, num_prompt_logprobs=-1)
            np.asarray(out.token_ids_B)  # the engine reads every step's tokens back
            if i >= args.warmup:
                times.append(time.perf_counter() - t0)
        multi_ms, tokens, caches = time_multi_step(runner, caches, inputs, smeta, flags, args)
    runner.caches = caches
    per_device = parallel.per_device_bytes(runner.state)
    ms = sorted(t * 1e3 for t in times)
    return {"tp": tp, "shape": args.checkpoint or args.shape, "dtype": args.dtype, "quant": args.quant,
            "quant_lm_head": args.quant_lm_head, "batch": 1,
            "context": args.context, "step_ms_median": round(statistics.median(ms), 3),
            "step_ms_p10": round(ms[len(ms) // 10], 3), "step_ms_p90": round(ms[(9 * len(ms)) // 10], 3),
            "multi_step_ms_per_step": round(multi_ms, 3), "steps_per_call": args.steps, "greedy_tokens": tokens,
            "param_gib_per_device": round(max(per_device.values()) / 2**30, 3),
            "load_s": round(load_s, 1), "compile_s": round(compile_s, 1),
            "device": jax.devices()[0].device_kind, "jax": jax.__version__}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--shape", choices=sorted(SHAPES), default="llama-3-8b")
    parser.add_argument("--checkpoint", default=None, help="load this checkpoint instead of random weights")
    parser.add_argument("--tp", type=int, nargs="+", default=[1, 2])
    parser.add_argument("--dtype", choices=("bfloat16", "float16", "float32"), default="bfloat16")
    parser.add_argument("--context", type=int, default=512, help="tokens in the sequence's KV cache")
    parser.add_argument("--quant", choices=("w4", "w8"), default=None, help="quantize the weights first (tp 1)")
    parser.add_argument("--quant-lm-head", choices=("w4", "w8"), default=None,
                        help="with --quant, quantize the lm_head too (lmjax convert --quant-lm-head)")
    parser.add_argument("--block-size", type=int, default=16)
    parser.add_argument("--warmup", type=int, default=10)
    parser.add_argument("--iters", type=int, default=100)
    parser.add_argument("--steps", type=int, default=8, help="decode steps per call in the multi-step timing")
    parser.add_argument("--profile", default=None, help="also trace 2 multi-step calls into this directory and "
                        "print where GPU 0's time goes (benchmarks/trace_summary.py)")
    parser.add_argument("--json", default=None, help="also append the result lines to this file")
    args = parser.parse_args()
    if args.quant_lm_head and not args.quant:
        parser.error(f"--quant-lm-head {args.quant_lm_head} needs --quant (w4 or w8) for the rest of the model")
    if args.quant and args.tp != [1]:
        parser.error(f"--quant {args.quant} runs at --tp 1 only (the w4 kernels serve one device), got --tp {args.tp}")
    parallel.initialize_distributed()
    results = []
    for tp in args.tp:
        result = bench(args, tp)
        results.append(result)
        print(json.dumps(result), flush=True)
    base = next((r for r in results if r["tp"] == 1), None)
    summary = {r["tp"]: round(base["step_ms_median"] / r["step_ms_median"], 3) for r in results} if base else {}
    multi = {r["tp"]: round(r["multi_step_ms_per_step"] / base["multi_step_ms_per_step"], 3)
             for r in results} if base else {}
    same = {r["tp"]: r["greedy_tokens"] == base["greedy_tokens"] for r in results} if base else {}
    print(json.dumps({"speedup_vs_tp1": summary, "multi_step_time_vs_tp1": multi, "tokens_equal_tp1": same}),
          flush=True)
    if args.json:
        with open(args.json, "a") as f:
            for line in results + [{"speedup_vs_tp1": summary, "multi_step_time_vs_tp1": multi}]:
                f.write(json.dumps(line) + "\n")


if __name__ == "__main__":
    main()
