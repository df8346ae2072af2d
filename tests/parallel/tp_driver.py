"""Run greedy generation at several tensor-parallel sizes in a fresh process and print JSON.

The device count must be forced before jax is imported, so the tests in this folder run this script
in a subprocess:

    python tests/parallel/tp_driver.py '{"model": DIR, "tp": [1, 2], "devices": 8, "prompts": [[1, 2]]}'

Spec keys: model, tp (list), devices (forced host devices), prompts (token-id lists), max_tokens,
mode ("engine": LLM.generate; "notebook": load at tp=1, then lmjax.parallel.shard_model and
lmjax.models.forward.greedy_generate, counting fused add + norm kernel calls; "collectives": the collectives in the compiled engine step;
"kernel": the Pallas attention kernel in shard_map, interpret mode; "background": sampled variants compiled
on the worker thread),
leader (with several processes: process 0 alone schedules and drives the others' steps). With LMJAX_COORDINATOR_ADDRESS & co. set, the processes join
through jax.distributed first. Prints one JSON line: {"runs": {tp: {"tokens", "device_bytes",
"replicated_bytes", "total_bytes"}}, "process": i, "devices": n}.
"""
import json
import os
import sys

SPEC = json.loads(sys.argv[1])
os.environ["XLA_FLAGS"] = f"--xla_force_host_platform_device_count={SPEC.get('devices', 8)}"
os.environ.setdefault("JAX_PLATFORMS", "cpu")

import jax  # noqa: E402
import numpy as np  # noqa: E402
from flax import nnx  # noqa: E402

from lmjax import LLM, SamplingParams, parallel  # noqa: E402


def _bytes(model, mesh) -> dict:
    """Per-device parameter bytes, and the bytes of parameters the rules leave replicated."""
    state = nnx.state(model)
    per_device = parallel.per_device_bytes(state)
    replicated = sum(v[...].nbytes for _, v in nnx.to_flat_state(state)
                     if mesh is None or v[...].sharding.is_fully_replicated)
    total = sum(v[...].nbytes for _, v in nnx.to_flat_state(state))
    return {"device_bytes": sorted(per_device.values()), "replicated_bytes": int(replicated), "total_bytes": int(total)}


def run_engine(tp: int) -> dict:
    llm = LLM(SPEC["model"], tensor_parallel_size=tp, dtype="float32", max_model_len=256, max_num_seqs=4,
              block_size=8, max_num_batched_tokens=32)  # small steps: chunked prefill, mixed batches
    runner = llm.llm_engine.runner
    if SPEC.get("leader") and jax.process_index() > 0:  # one scheduler: process 0's drives this one
        return {"tokens": None, "followed_steps": runner.follow(), **_bytes(nnx.merge(runner.graphdef, runner.state),
                                                                            runner.mesh)}
    if SPEC.get("leader"):
        runner.lead()
    outs = llm.generate([{"prompt_token_ids": p} for p in SPEC["prompts"]],
                        SamplingParams(temperature=0, max_tokens=SPEC.get("max_tokens", 8), ignore_eos=True),
                        use_tqdm=False)
    runner.release_followers()
    model = nnx.merge(runner.graphdef, runner.state)
    merged = sorted({layer.self_attn.qkv_shards for layer in model.layers if layer.self_attn.qkv_proj is not None})
    return {"tokens": [o.outputs[0].token_ids for o in outs], "qkv_shards": merged, **_bytes(model, runner.mesh)}


def run_background(tp: int) -> dict:
    """Seeded top-k sampling with logprobs (a sampler apart from the model step; a multi-step variant compiled
    on the worker thread, under the mesh): the tokens while it compiles, and again once it has."""
    llm = LLM(SPEC["model"], tensor_parallel_size=tp, dtype="float32", max_model_len=256, block_size=8,
              num_scheduler_steps=4)
    params = SamplingParams(temperature=0.9, top_k=20, seed=4, logprobs=2, max_tokens=16, ignore_eos=True)

    def tokens():
        return [o.outputs[0].token_ids for o in llm.generate([{"prompt_token_ids": p} for p in SPEC["prompts"]],
                                                             params, use_tqdm=False)]
    engine = llm.llm_engine
    first = tokens()
    engine.runner.wait_for_compiles()
    loops = engine.num_decode_loops
    return {"tokens": first, "again": tokens(), "loops_after": engine.num_decode_loops - loops,
            "background": engine.runner._decode.num_background}


def run_notebook(tp: int) -> dict:
    from lmjax.loader.model_loader import load_model
    from lmjax.models.forward import greedy_generate
    from pallas_kernels import add_rms_norm as norm_kernel

    calls, kernel = [], norm_kernel._add_rms_norm_pallas  # traced fused add + norm calls (LMJAX_NORM_IMPL)
    norm_kernel._add_rms_norm_pallas = lambda *a, **kw: calls.append(1) or kernel(*a, **kw)
    model = load_model(SPEC["model"], dtype="float32").model
    mesh = parallel.make_mesh(tp) if tp > 1 else None
    if mesh is not None:
        parallel.shard_model(model, mesh)
    try:
        tokens = greedy_generate(model, SPEC["prompts"], SPEC.get("max_tokens", 8), block_size=8)
    finally:
        norm_kernel._add_rms_norm_pallas = kernel
    return {"tokens": tokens, "norm_kernel_calls": len(calls), **_bytes(model, mesh)}


def run_collectives(tp: int) -> dict:
    """The collectives XLA put in the engine's compiled decode step: [op, element count] each."""
    import re

    from lmjax.config import SamplingParams as SP
    from lmjax.engine.model_runner import ModelRunner, StepInputs
    from lmjax.layers.attention import contiguous_metadata
    from lmjax.layers.sampler import SamplingRow, build_sampling_metadata
    from lmjax.loader.model_loader import load_model

    loaded = load_model(SPEC["model"], dtype="float32", tp=tp)
    runner = ModelRunner(loaded.model, 8, 8, 16, 4, 4, loaded.dtype)
    attn = contiguous_metadata([3, 5, 8, 0], 8, 8)
    inputs = StepInputs(ids_T=np.zeros(16, np.int32), positions_T=np.zeros(16, np.int32), attn=attn,
                        last_rows_B=np.zeros(4, np.int32), next_ids_T=np.full(16, -1, np.int32))
    smeta, flags = build_sampling_metadata([SamplingRow(SP(temperature=0), seed=0)], pad_to=4)
    inputs, smeta = parallel.replicate((inputs, smeta), runner.mesh)
    with parallel.use_mesh(runner.mesh):
        hlo = runner._step.lower(runner.params, runner.caches, inputs, smeta, flags=flags,
                                 num_prompt_logprobs=-1).compile().as_text()
    found = re.findall(r"= \w+\[([\d,]*)\][^ ]* (all-reduce|all-gather|reduce-scatter|all-to-all)(?:-start)?\(", hlo)
    return {"collectives": [[op, int(np.prod([int(d) for d in dims.split(",") if d]))] for dims, op in found]}


def run_kernel(tp: int) -> dict:
    """The Pallas attention kernel (interpret mode) in lmjax.parallel.shard_map over heads vs the
    unsharded jnp reference: the GPU path of the tp step, minus the GPU."""
    import jax.numpy as jnp
    from jax.sharding import PartitionSpec as P

    from pallas_kernels.ragged_paged_attention import ragged_paged_attention, ragged_paged_attention_reference

    rng = np.random.default_rng(0)
    T, N, K, H, num_blocks, S = 8, 2 * tp, tp, 16, 6, 8
    q = jnp.asarray(rng.standard_normal((T, N, H)), jnp.float32)
    k, v = (jnp.asarray(rng.standard_normal((num_blocks, S, K, H)), jnp.float32) for _ in range(2))
    meta = (jnp.array([5, 12], jnp.int32), jnp.array([[1, 0], [2, 3]], jnp.int32), jnp.array([0, 5, 8], jnp.int32))
    want = ragged_paged_attention_reference(q, k, v, *meta, sm_scale=0.25)
    q_spec, cache_spec = P(None, "tp", None), P(None, None, "tp", None)
    sharded = parallel.shard_map(
        lambda *a: ragged_paged_attention(*a, sm_scale=0.25, impl="kernel", interpret=True),
        parallel.make_mesh(tp), (q_spec, cache_spec, cache_spec, P(), P(), P()), q_spec)
    return {"max_abs_diff": float(jnp.max(jnp.abs(jax.jit(sharded)(q, k, v, *meta) - want)))}


def main() -> None:
    parallel.initialize_distributed()
    run = {"engine": run_engine, "background": run_background, "notebook": run_notebook, "collectives": run_collectives,
           "kernel": run_kernel}[SPEC.get("mode", "engine")]
    runs = {tp: run(tp) for tp in SPEC["tp"]}
    print(json.dumps({"runs": runs, "process": jax.process_index(), "devices": jax.device_count()}), flush=True)


if __name__ == "__main__":
    main()
