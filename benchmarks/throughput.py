"""Offline throughput: lmjax's `LLM.generate` against transformers' batched `generate` on the same prompts.

    python benchmarks/throughput.py --num-prompts 64                    # SmolLM2-135M-Instruct GGUF, float32
    python benchmarks/throughput.py --shape llama-3.2-1b --dtype bfloat16
    python benchmarks/throughput.py --model /path/to/hf_dir_or.gguf --hf-batch-size 16 64

Workload (seeded): `--num-prompts` prompts of random token ids (special tokens excluded, no BOS added) with
lengths uniform in `--input-len` and per-request output budgets uniform in `--output-len`. Both sides decode
greedily and generate exactly the budget: lmjax with `ignore_eos=True`, transformers with
`min_new_tokens = max_new_tokens`.

Metrics (vLLM's): requests/s, output tokens/s, total tokens/s = (prompt + output tokens) / elapsed, where
prompt tokens are the real prompt lengths and output tokens are the sum of the budgets each request asked
for, on both sides. transformers' `generate` takes one max_new_tokens per call, so its requests are sorted
by budget and cut into batches of `--hf-batch-size`; each batch runs to its largest budget, and the extra
tokens the shorter requests generate (and the left padding) are work it does but are NOT counted; they are
reported as `hf_discarded_tokens` / `hf_pad_tokens`. Several `--hf-batch-size` values: each is measured and
the fastest is the baseline.

Warm-up: lmjax runs the same prompts once with budgets capped at `--warmup-tokens` (this compiles the
prefill and first decode buckets; its compile time is reported separately), then the timed pass runs.
Compilations still happening in the timed pass are counted and timed (`compile_s_in_timed_pass`): they are
part of the timed pass. transformers warms up on one small batch. Model loading is never timed.
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import os
import random
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from random_model import SHAPES, write_random_checkpoint  # noqa: E402


@dataclasses.dataclass
class Request:
    prompt_ids: list[int]
    max_tokens: int


@dataclasses.dataclass
class Result:
    name: str
    elapsed_s: float
    num_requests: int
    prompt_tokens: int
    output_tokens: int
    extra: dict = dataclasses.field(default_factory=dict)

    def rates(self) -> dict:
        t = self.elapsed_s
        return {"requests_per_s": self.num_requests / t, "output_tokens_per_s": self.output_tokens / t,
                "total_tokens_per_s": (self.prompt_tokens + self.output_tokens) / t}


# ------------------------------------------------------------------ workload
def make_workload(tokenizer, vocab_size: int, num: int, in_range, out_range, seed: int) -> list[Request]:
    rng = random.Random(seed)
    special = set(getattr(tokenizer, "all_special_ids", []) or [])
    pool = [i for i in range(min(vocab_size, len(tokenizer))) if i not in special]
    return [Request([rng.choice(pool) for _ in range(rng.randint(*in_range))], rng.randint(*out_range))
            for _ in range(num)]


def model_path(args) -> str:
    if args.shape:
        # Random weights of a named shape; transformers writes them, both engines read the same files.
        out = os.path.join(tempfile.mkdtemp(prefix=f"lmjax-{args.shape}-"), "model")
        return write_random_checkpoint(args.shape, out, args.dtype, args.seed)
    from lmjax.loader.resolve import resolve_model_path

    return resolve_model_path(args.model)


# ------------------------------------------------------------------ compile-time accounting
class CompileClock:
    """Sums JAX's own trace/lower/compile durations (jax.monitoring), so compile time is separable."""

    def __init__(self):
        from jax import monitoring

        self.seconds, self.count = 0.0, 0
        monitoring.register_event_duration_secs_listener(self._on_event)

    def _on_event(self, event: str, duration: float, **_) -> None:
        if event.startswith("/jax/core/compile/"):
            self.seconds += duration
            self.count += event.endswith("backend_compile_duration")

    def snapshot(self) -> tuple[float, int]:
        return self.seconds, self.count


# ------------------------------------------------------------------ lmjax
def _lmjax_generate(llm, requests, cap: int | None = None):
    from lmjax import SamplingParams

    params = [SamplingParams(temperature=0.0, max_tokens=min(r.max_tokens, cap or r.max_tokens), ignore_eos=True)
              for r in requests]
    return llm.generate([{"prompt_token_ids": r.prompt_ids} for r in requests], params, use_tqdm=False)


def run_lmjax(path: str, requests: list[Request], args) -> tuple[Result, list[list[int]]]:
    from lmjax import LLM

    clock = CompileClock()
    longest = max(len(r.prompt_ids) + r.max_tokens for r in requests)
    kwargs = {k: v for k, v in (("max_num_seqs", args.max_num_seqs),
                                ("max_num_batched_tokens", args.max_num_batched_tokens)) if v}
    llm = LLM(path, dtype=args.dtype, max_model_len=longest, **kwargs)
    load_compile_s, load_n = clock.snapshot()
    start = time.perf_counter()
    _lmjax_generate(llm, requests, cap=args.warmup_tokens)
    warm_s, (warm_compile_s, warm_n) = time.perf_counter() - start, clock.snapshot()
    profile = StepProfile(llm.llm_engine, clock) if args.breakdown else None
    start = time.perf_counter()
    outputs = _lmjax_generate(llm, requests)
    elapsed = time.perf_counter() - start
    compile_s, compile_n = clock.snapshot()
    tokens = [o.outputs[0].token_ids for o in outputs]
    _check_counts("lmjax", tokens, requests)
    extra = {"warmup_s": warm_s, "warmup_compile_s": warm_compile_s - load_compile_s,
             "warmup_compilations": warm_n - load_n,
             "compile_s_in_timed_pass": compile_s - warm_compile_s, "compilations_in_timed_pass": compile_n - warm_n,
             "preemptions": llm.llm_engine.scheduler.num_preemptions}
    if profile:
        extra["breakdown"] = profile.report(elapsed)
    return Result("lmjax", elapsed, len(requests), _prompt_tokens(requests), _budget(requests), extra), tokens


def _check_counts(name: str, tokens: list[list[int]], requests: list[Request]) -> None:
    wrong = [(len(t), r.max_tokens) for t, r in zip(tokens, requests) if len(t) != r.max_tokens]
    if wrong:
        raise RuntimeError(f"{name} generated the wrong number of tokens (got, wanted): {wrong[:5]}")


def _prompt_tokens(requests) -> int:
    return sum(len(r.prompt_ids) for r in requests)


def _budget(requests) -> int:
    return sum(r.max_tokens for r in requests)


class StepProfile:
    """Wall time of each part of LLMEngine.step, by wrapping the engine's methods on this instance only
    (engine code untouched). device_wait = execute minus host input/metadata building and dispatch."""

    PARTS = ("step", "schedule", "sampling_rows", "build_inputs", "sampling_metadata", "dispatch", "execute",
             "postprocess")

    def __init__(self, engine, clock: CompileClock):
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
        self._wrap(runner, "execute", runner.execute)
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


# ------------------------------------------------------------------ transformers
def load_hf(path: str, dtype: str, device: str):
    import torch
    from transformers import AutoModelForCausalLM

    torch_dtype = getattr(torch, dtype)
    if path.endswith(".gguf"):
        model = AutoModelForCausalLM.from_pretrained(os.path.dirname(path), gguf_file=os.path.basename(path),
                                                     dtype=torch_dtype)
    else:
        model = AutoModelForCausalLM.from_pretrained(path, dtype=torch_dtype)
    return model.to(device).eval()


def _hf_batch(model, prompts: list[list[int]], new_tokens: int, pad_id: int, static: bool = False):
    """One left-padded greedy batch; returns the generated ids (batch, new_tokens) and the pad count.

    static: transformers' StaticCache (`cache_implementation="static"`); on CUDA, `generate` then
    torch.compiles the decode step by itself (mode "reduce-overhead": CUDA graphs), on the first call
    of each shape (batch, prompt + new tokens). `hf_compiled(model)` tells whether it did."""
    import torch

    width = max(map(len, prompts))
    ids = torch.tensor([[pad_id] * (width - len(p)) + p for p in prompts], device=model.device)
    mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts], device=model.device)
    cache = {"cache_implementation": "static"} if static else {}
    with torch.inference_mode():
        out = model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=new_tokens,
                             min_new_tokens=new_tokens, do_sample=False, pad_token_id=pad_id,
                             temperature=None, top_p=None, top_k=None, **cache)
    return out[:, width:].tolist(), sum(width - len(p) for p in prompts)


def hf_compiled(model) -> bool:
    """Whether transformers' generate torch.compiled the forward (it keeps it as `_compiled_call`)."""
    return getattr(model, "_compiled_call", None) is not None


def hf_pad_id(model) -> int:
    pad_id = model.generation_config.pad_token_id or model.generation_config.eos_token_id or 0
    return pad_id[0] if isinstance(pad_id, list) else pad_id


def run_hf(model, requests: list[Request], batch_size: int, pad_id: int) -> tuple[Result, list[list[int]]]:
    _hf_batch(model, [r.prompt_ids for r in requests[:2]], 4, pad_id)  # warm-up: one small batch
    order = sorted(range(len(requests)), key=lambda i: requests[i].max_tokens)
    tokens: list[list[int]] = [[] for _ in requests]
    discarded = padded = 0
    start = time.perf_counter()
    for s in range(0, len(order), batch_size):
        group = order[s:s + batch_size]
        budget = max(requests[i].max_tokens for i in group)
        out, pads = _hf_batch(model, [requests[i].prompt_ids for i in group], budget, pad_id)
        for i, ids in zip(group, out):
            tokens[i] = ids[:requests[i].max_tokens]  # count only what the request asked for
            discarded += budget - requests[i].max_tokens
        padded += pads
    elapsed = time.perf_counter() - start
    _check_counts("transformers", tokens, requests)
    extra = {"hf_batch_size": batch_size, "hf_discarded_tokens": discarded, "hf_pad_tokens": padded}
    return Result("transformers", elapsed, len(requests), _prompt_tokens(requests), _budget(requests), extra), tokens


# ------------------------------------------------------------------ report
def agreement(a: list[list[int]], b: list[list[int]]) -> dict:
    """Greedy sanity check: same weights, same prompts -> mostly the same tokens (ties may differ)."""
    same = sum(x == y for x, y in zip(a, b))
    prefix = [next((k for k, (u, v) in enumerate(zip(x, y)) if u != v), len(x)) / max(len(x), 1)
              for x, y in zip(a, b)]
    return {"identical_outputs": f"{same}/{len(a)}", "mean_common_prefix": round(sum(prefix) / len(prefix), 3)}


def print_table(results: list[Result]) -> None:
    print(f"{'engine':<14}{'elapsed s':>11}{'req/s':>9}{'out tok/s':>12}{'total tok/s':>13}")
    for r in results:
        x = r.rates()
        print(f"{r.name:<14}{r.elapsed_s:>11.2f}{x['requests_per_s']:>9.3f}{x['output_tokens_per_s']:>12.2f}"
              f"{x['total_tokens_per_s']:>13.2f}")


def summary(args, path, requests, results, agree) -> dict:
    out = {"model": args.shape or path, "dtype": args.dtype, "num_prompts": len(requests),
           "prompt_tokens": _prompt_tokens(requests), "output_tokens": _budget(requests),
           "threads": args.threads, "loadavg": os.getloadavg()}
    for r in results:
        out[r.name] = {"elapsed_s": round(r.elapsed_s, 3), **{k: round(v, 3) for k, v in r.rates().items()},
                       **r.extra}
    if "lmjax" in out and "transformers" in out:
        out["output_tps_ratio"] = round(out["lmjax"]["output_tokens_per_s"]
                                        / out["transformers"]["output_tokens_per_s"], 3)
        out["agreement"] = agree
    return out


# ------------------------------------------------------------------ main
def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    src = p.add_mutually_exclusive_group()
    src.add_argument("--model", help="HF checkpoint directory or .gguf file (default: SmolLM2-135M-Instruct)")
    src.add_argument("--shape", choices=sorted(SHAPES), help="random-weight Llama of this shape")
    p.add_argument("--dtype", choices=("float32", "bfloat16", "float16"), default="float32")
    p.add_argument("--num-prompts", type=int, default=64)
    p.add_argument("--input-len", type=int, nargs=2, default=(8, 512), metavar=("MIN", "MAX"))
    p.add_argument("--output-len", type=int, nargs=2, default=(16, 256), metavar=("MIN", "MAX"))
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--max-num-seqs", type=int, default=None, help="LLM(max_num_seqs=...) (default: LLM's)")
    p.add_argument("--max-num-batched-tokens", type=int, default=None, help="LLM(max_num_batched_tokens=...)")
    p.add_argument("--warmup-tokens", type=int, default=4, help="lmjax warm-up pass: budget cap per request")
    p.add_argument("--hf-batch-size", type=int, nargs="+", default=[16],
                   help="transformers batch size(s); with several, the fastest is the baseline")
    p.add_argument("--hf-device", default=None, help="torch device for the baseline (default: cuda if available)")
    p.add_argument("--threads", type=int, default=0,
                   help="CPU threads for both XLA and torch (0: library defaults); 1 avoids thread "
                        "oversubscription on a shared machine")
    p.add_argument("--skip-hf", action="store_true")
    p.add_argument("--skip-lmjax", action="store_true")
    p.add_argument("--breakdown", action="store_true", help="time each part of lmjax's engine step")
    p.add_argument("--json-out", help="append the JSON summary line to this file")
    return p.parse_args(argv)


def set_threads(n: int) -> None:
    """Must run before jax is imported: XLA reads its flags once."""
    if n <= 0:
        return
    flag = "--xla_cpu_multi_thread_eigen=false" if n == 1 else ""
    os.environ["XLA_FLAGS"] = f"{os.environ.get('XLA_FLAGS', '')} {flag} intra_op_parallelism_threads={n}"
    import torch

    torch.set_num_threads(n)


def main(argv=None) -> dict:
    args = parse_args(argv)
    set_threads(args.threads)
    path = model_path(args)
    from lmjax.loader.tokenizer import load_tokenizer
    from lmjax.loader.safetensors_loader import read_config

    tokenizer = load_tokenizer(path)
    vocab = read_config(path)["vocab_size"] if os.path.isdir(path) else len(tokenizer)
    requests = make_workload(tokenizer, vocab, args.num_prompts, args.input_len, args.output_len, args.seed)
    results, outputs = [], {}
    if not args.skip_lmjax:
        res, outputs["lmjax"] = run_lmjax(path, requests, args)
        results.append(res)
    if not args.skip_hf:
        res, outputs["transformers"] = best_hf(path, requests, args)
        results.append(res)
    agree = agreement(outputs["lmjax"], outputs["transformers"]) if len(outputs) == 2 else None
    print_table(results)
    out = summary(args, path, requests, results, agree)
    line = json.dumps(out)
    print(line)
    if args.json_out:
        with open(args.json_out, "a") as f:
            f.write(line + "\n")
    return out


def best_hf(path: str, requests: list[Request], args) -> tuple[Result, list[list[int]]]:
    import torch

    device = args.hf_device or ("cuda" if torch.cuda.is_available() else "cpu")
    model = load_hf(path, args.dtype, device)
    pad_id = model.generation_config.pad_token_id or model.generation_config.eos_token_id or 0
    pad_id = pad_id[0] if isinstance(pad_id, list) else pad_id
    runs = [run_hf(model, requests, bs, pad_id) for bs in args.hf_batch_size]
    for res, _ in runs:
        print(f"transformers batch {res.extra['hf_batch_size']}: {res.elapsed_s:.2f} s, "
              f"{res.rates()['output_tokens_per_s']:.2f} out tok/s", file=sys.stderr)
    return min(runs, key=lambda run: run[0].elapsed_s)


if __name__ == "__main__":
    main()
