"""Where lmjax's time goes in a throughput run: `StepProfile` times each part of LLMEngine.step on one
engine instance (`--breakdown`), `profile_decode` traces a window of decode calls and summarizes the
GPU's kernels (`--profile`, benchmarks/trace_summary.py).
"""
from __future__ import annotations

import os
import time


def profile_decode(llm, requests: list, args) -> dict:
    """Trace `--profile-calls` engine steps of a batch of `--profile-batch` decoding requests (prefill done
    before the trace starts) and summarize GPU 0's kernels: idle = span - busy, per decode step."""
    import jax

    import trace_summary  # benchmarks/trace_summary.py
    from lmjax import SamplingParams

    engine, k = llm.llm_engine, llm.llm_engine.config.num_scheduler_steps
    batch = requests[:args.profile_batch]
    room = engine.session_len - max(len(r.prompt_ids) for r in batch) - 1
    params = SamplingParams(temperature=0.0, max_tokens=min(room, 1 + k * (args.profile_calls + 2)), ignore_eos=True)
    reqs = [engine.add_request(r.prompt_ids, params) for r in batch]
    while not all(q.completions[0].token_ids for q in reqs):  # prefill, untraced
        engine.step()
    engine.step()  # one decode call untraced: compiles its bucket if the timed pass never reached it
    trace_dir, loops, steps = os.path.join(args.profile, "decode_trace"), engine.num_decode_loops, 0
    start = time.perf_counter()
    with jax.profiler.trace(trace_dir, create_perfetto_trace=True):
        for _ in range(args.profile_calls):
            before = engine.num_decode_loops
            engine.step()
            steps += k if engine.num_decode_loops > before else 1
    wall = time.perf_counter() - start
    for q in reqs:
        engine.abort(q.request_id)
    out = {"batch": len(batch), "engine_calls": args.profile_calls, "decode_steps": steps,
           "multi_step_calls": engine.num_decode_loops - loops, "wall_ms_per_step": 1e3 * wall / steps,
           "trace_dir": trace_dir}
    try:
        s = trace_summary.summarize(trace_dir, steps=steps, top=8)
    except (ValueError, FileNotFoundError) as e:  # e.g. on CPU: no GPU kernels in the trace
        return {**out, "error": str(e)[:300]}
    return {**out, "span_us_per_step": s["span_us"] / steps, "busy_us_per_step": s["busy_us"] / steps,
            "idle_fraction": 1 - s["busy_us"] / s["span_us"], "kernels_per_step": s["kernels"] / steps,
            "idle_gaps_per_step": [(label, n / steps, round(us / steps, 1)) for label, n, us in s["gaps"]],
            "top_kernels_us_per_step": [(name, round(us / steps, 1), n / steps) for name, us, n in s["top"]]}


class StepProfile:
    """Wall time of each part of LLMEngine.step, by wrapping the engine's methods on this instance only
    (engine code untouched). device_wait = execute minus host input/metadata building and dispatch."""

    PARTS = ("step", "schedule", "sampling_rows", "build_inputs", "sampling_metadata", "dispatch", "execute",
             "postprocess")

    def __init__(self, engine, clock):  # clock: compile_clock.CompileClock
        import lmjax.engine.model_runner as model_runner

        self.clock, self._compile_at_start, self._compile_base = clock, 0.0, clock.seconds
        self.t = dict.fromkeys(self.PARTS, 0.0)
        self.steps, self.real_T, self.padded_T, self.real_B, self.padded_B = 0, 0, 0, 0, 0
        self.buckets: dict[str, tuple[int, float]] = {}
        self._key = None
        runner = engine.runner
        self._wrap(engine, "step", engine.step, on_result=self._record_step)
        self._wrap(engine.scheduler, "schedule", engine.scheduler.schedule)
        self._wrap(engine, "sampling_rows", engine._row, attr="_row")
        self._wrap(runner, "build_inputs", runner.build_inputs, on_result=self._record_shapes)
        self._wrap(runner, "dispatch", runner._step, attr="_step")
        self._wrap(runner, "execute", runner.dispatch_step, attr="dispatch_step")  # a one-step call: its dispatch
        self._wrap(runner, "execute", runner.read_step, attr="read_step")  # and its read, as one part
        self._wrap(engine, "postprocess", engine._postprocess, attr="_postprocess")
        self._wrap(model_runner, "sampling_metadata", model_runner.build_sampling_metadata,
                   attr="build_sampling_metadata")

    def _wrap(self, owner, part, fn, attr=None, on_result=None):
        def timed(*a, **kw):
            if part == "step":
                self._compile_at_start = self.clock.seconds
            start = time.perf_counter()
            out = fn(*a, **kw)
            seconds = time.perf_counter() - start
            self.t[part] += seconds
            if on_result:
                on_result(a, out, seconds)
            return out
        setattr(owner, attr or part, timed)

    def _record_step(self, args, out, seconds) -> None:
        self.steps += 1
        compiling = self.clock.seconds - self._compile_at_start
        if self._key and not compiling:  # model steps, compilation excluded: time per (T, B, M) bucket
            n, total = self.buckets.get(self._key, (0, 0.0))
            self.buckets[self._key] = (n + 1, total + seconds)
        self._key = None

    def _record_shapes(self, args, inputs, _) -> None:
        batch = args[0]
        T, B, M = inputs.ids_T.shape[0], inputs.last_rows_B.shape[0], inputs.attn.block_tables_BM.shape[1]
        self.real_T += batch.num_tokens
        self.padded_T += T
        self.real_B += len(batch.items)
        self.padded_B += B
        self._key = f"T{T}/B{B}/M{M}"

    def report(self, elapsed: float) -> dict:
        t = self.t
        compile_s = self.clock.seconds - self._compile_base  # jit compiles inside dispatch: split them out
        device_wait = t["execute"] - t["build_inputs"] - t["sampling_metadata"] - t["dispatch"]
        host_other = t["step"] - t["schedule"] - t["sampling_rows"] - t["execute"] - t["postprocess"]
        parts = {"schedule": t["schedule"], "sampling_rows": t["sampling_rows"], "build_inputs": t["build_inputs"],
                 "sampling_metadata": t["sampling_metadata"], "compile": compile_s,
                 "dispatch": t["dispatch"] - compile_s, "device_wait": device_wait,
                 "postprocess": t["postprocess"], "step_other": host_other, "outside_step": elapsed - t["step"]}
        return {"steps": self.steps, "ms_per_step": 1e3 * t["step"] / max(self.steps, 1),
                "seconds": {k: round(v, 3) for k, v in parts.items()},
                "token_padding_ratio": self.padded_T / max(self.real_T, 1),
                "batch_padding_ratio": self.padded_B / max(self.real_B, 1),
                "buckets_steps_ms": {k: [n, round(1e3 * sec / n, 1)]
                                     for k, (n, sec) in sorted(self.buckets.items(), key=lambda kv: -kv[1][1])}}
