"""throughput.py's transformers side: batched `generate` over the workload sorted by budget (optionally a
subset of whole batches, extrapolated), every --hf-batch-size measured and the fastest kept, in this
process or in a child process bounded by --hf-timeout."""
from __future__ import annotations

import dataclasses
import json
import math
import os
import subprocess
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from hf_baseline import _hf_batch, hf_compiled, hf_pad_id, load_hf, run_bounded  # noqa: E402
from throughput_workload import Request, Result, _budget, _check_counts, _prompt_tokens  # noqa: E402

SCRIPT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "throughput.py")  # its child reruns it


def _timed_groups(groups: list[list[int]], max_requests: int) -> list[list[int]]:
    """All batches, or (max_requests > 0) about max_requests' worth of whole batches spread evenly over the
    full-size ones (a smaller last batch is another shape: with --hf-compile it would compile in the clock)."""
    n = min(len(groups), max(1, max_requests // len(groups[0]))) if max_requests else len(groups)
    if n >= len(groups):
        return groups
    full = [g for g in groups if len(g) == len(groups[0])]
    n = min(n, len(full))
    return [full[round(i * (len(full) - 1) / max(n - 1, 1))] for i in range(n)]


def run_hf(model, requests: list[Request], batch_size: int, pad_id: int, static: bool = False,
           max_requests: int = 0) -> tuple[Result, list[list[int] | None]]:
    order = sorted(range(len(requests)), key=lambda i: requests[i].max_tokens)
    groups = _timed_groups([order[s:s + batch_size] for s in range(0, len(order), batch_size)], max_requests)
    if static:  # compiles this batch size's shapes (and records its CUDA graphs) before the clock starts
        first = groups[0]
        _hf_batch(model, [requests[i].prompt_ids for i in first], max(requests[i].max_tokens for i in first),
                  pad_id, static=True)
    else:
        _hf_batch(model, [r.prompt_ids for r in requests[:2]], 4, pad_id)  # warm-up: one small batch
    tokens: list[list[int] | None] = [None] * len(requests)
    discarded = padded = 0
    start = time.perf_counter()
    for group in groups:
        budget = max(requests[i].max_tokens for i in group)
        out, pads = _hf_batch(model, [requests[i].prompt_ids for i in group], budget, pad_id, static=static)
        for i, ids in zip(group, out):
            tokens[i] = ids[:requests[i].max_tokens]  # count only what the request asked for
            discarded += budget - requests[i].max_tokens
        padded += pads
    elapsed = time.perf_counter() - start
    timed = [i for g in groups for i in g]
    _check_counts("transformers", [tokens[i] for i in timed], [requests[i] for i in timed])
    extra = {"hf_batch_size": batch_size, "hf_static_cache": static, "hf_compiled": static and hf_compiled(model),
             "hf_discarded_tokens": discarded, "hf_pad_tokens": padded}
    if len(timed) < len(requests):  # extrapolate from the timed (full) batches to every batch the run needs
        # (review 33: by output tokens, a partial last batch counted as its share of one; transformers runs it
        # as a batch of its own, whose decode steps cost about a full one's when bound by the weights' bytes)
        by_tokens = elapsed * _budget(requests) / sum(requests[i].max_tokens for i in timed)
        extra.update({"hf_extrapolated_from_requests": len(timed), "hf_timed_s": round(elapsed, 3),
                      "hf_extrapolated_by": "batches", "hf_elapsed_by_tokens_s": round(by_tokens, 3)})
        elapsed *= math.ceil(len(requests) / batch_size) / len(groups)
    return Result("transformers", elapsed, len(requests), _prompt_tokens(requests), _budget(requests), extra), tokens


def best_hf(path: str, requests: list[Request], args) -> tuple[Result, list[list[int] | None]] | None:
    """Every --hf-batch-size in this process (each result also appended to --hf-result as it finishes);
    the fastest is the baseline."""
    import torch

    device = args.hf_device or ("cuda" if torch.cuda.is_available() else "cpu")
    model = load_hf(path, args.dtype, device)
    pad_id = hf_pad_id(model)
    runs = []
    for bs in args.hf_batch_size:
        run = _run_hf_guarded(model, requests, bs, pad_id, args)
        res = run[0]
        print(f"transformers batch {bs}{' static+compile' if res.extra['hf_compiled'] else ''}: {res.elapsed_s:.2f} s"
              f"{' (extrapolated)' if 'hf_timed_s' in res.extra else ''}, "
              f"{res.rates()['output_tokens_per_s']:.2f} out tok/s", file=sys.stderr, flush=True)
        if args.hf_result:
            with open(args.hf_result, "a") as f:
                f.write(json.dumps({"result": dataclasses.asdict(res), "tokens": run[1]}) + "\n")
        runs.append(run)
    return min(runs, key=lambda run: run[0].elapsed_s) if runs else None


def _run_hf_guarded(model, requests, bs: int, pad_id: int, args):
    """--hf-compile where it works; a failure is recorded and the batch size rerun eager."""
    if not args.hf_compile:
        return run_hf(model, requests, bs, pad_id, max_requests=args.hf_max_requests)
    try:
        return run_hf(model, requests, bs, pad_id, static=True, max_requests=args.hf_max_requests)
    except Exception as e:  # noqa: BLE001 - torch.compile / StaticCache failures vary by version
        message = f"{type(e).__name__}: {str(e).strip()[-300:]}"
        print(f"transformers batch {bs}: static+compile failed ({message}); eager instead", file=sys.stderr)
        res, tokens = run_hf(model, requests, bs, pad_id, max_requests=args.hf_max_requests)
        res.extra["hf_compile_error"] = message
        return res, tokens


def hf_in_subprocess(argv: list[str], args) -> tuple[Result, list[list[int] | None]] | None:
    """Run this script's transformers side in a child (--skip-lmjax --hf-result FILE) under --hf-timeout;
    returns the fastest batch size it finished, or None."""
    fd, result_file = tempfile.mkstemp(prefix="lmjax-throughput-hf-", suffix=".jsonl")
    os.close(fd)
    child = [a for a in argv if a != "--hf-subprocess"]
    cmd = [sys.executable, SCRIPT, *child, "--skip-lmjax", "--hf-result", result_file]
    code, _ = run_bounded(cmd, args.hf_timeout, stdout=subprocess.DEVNULL)
    status = f"timed out after {args.hf_timeout} s" if code is None else "ok" if code == 0 else f"exit code {code}"
    with open(result_file) as f:
        runs = [json.loads(line) for line in f if line.strip()]
    os.unlink(result_file)
    print(f"transformers child: {status}, {len(runs)} of {len(args.hf_batch_size)} batch sizes measured",
          file=sys.stderr)
    if not runs:
        return None
    best = min(runs, key=lambda r: r["result"]["elapsed_s"])
    res = Result(**best["result"])
    res.extra.update({"hf_child_status": status, "hf_all_batch_sizes": {
        r["result"]["extra"]["hf_batch_size"]: round(Result(**r["result"]).rates()["output_tokens_per_s"], 1)
        for r in runs}})
    return res, best["tokens"]
