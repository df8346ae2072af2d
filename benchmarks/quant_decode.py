"""quant_gpu's decode part: batch-1 decode step time of w4 and w8 conversions against bf16, each row in a
fresh child (`--side decode`, latency.py's engine measurement), with the roofline; and its table."""
from __future__ import annotations

import argparse
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from quant_runner import Run, fmt_num, convert, drop  # noqa: E402

QUANTS = {"bf16": None, "w8": "w8", "w4": "w4"}  # decode rows -> `lmjax convert --quant`


def weight_bytes(path: str, dtype: str) -> dict:
    """Parameter bytes of the model `path` holds as lmjax builds it (abstractly: nothing is allocated),
    quantized or not, and those of its input embedding when untied (a step gathers one row of it; a tied
    one is read whole as the lm_head)."""
    import jax.numpy as jnp
    from flax import nnx

    from lmjax.loader.orbax_loader import build_abstract
    from lmjax.loader.safetensors_loader import read_config

    _, _, state = build_abstract(read_config(path), jnp.dtype(dtype))
    sizes = {".".join(map(str, p)): v.size * jnp.dtype(v.dtype).itemsize for p, v in nnx.to_flat_state(state)}
    tied = not any("lm_head" in k for k in sizes)
    embed = 0 if tied else sum(n for k, n in sizes.items() if "embed_tokens" in k)
    return {"param_bytes": sum(sizes.values()), "embedding_bytes": embed}


def decode_child(args) -> dict:
    """--side decode: latency.py's engine measurement (start, one warm-up request, --decode-repeats)."""
    from latency import fixed_prompt, run_lmjax

    settings = argparse.Namespace(dtype=args.dtype, prompt_len=args.prompt_len, new_tokens=args.new_tokens,
                                  repeats=args.decode_repeats, warmup=1, start_only=False)
    result = run_lmjax(args.model, fixed_prompt(args.model, args.prompt_len, args.seed), settings)
    return {**result, **weight_bytes(args.model, args.dtype)}


def decode_part(run: Run, safetensors: str) -> None:
    a = run.args
    for weights in a.decode:
        quant = QUANTS[weights]
        if quant and not run.skip_unless_fits(f"decode-{weights}", "convert", "decode"):
            run.record["decode"][weights] = {"status": "skipped (budget)"}
            continue
        path = safetensors if quant is None else convert(run, safetensors, quant)
        if path is None:
            run.record["decode"][weights] = {"status": "skipped: no conversion"}
            run.save()
            continue
        extra = ["--model", path, "--prompt-len", str(a.prompt_len), "--new-tokens", str(a.new_tokens),
                 "--decode-repeats", str(a.decode_repeats)]
        status, out = run.child(f"decode-{weights}", run.side("decode", *extra), "decode")
        row = {"status": status, "path": path, **(out or {})}
        if "param_bytes" in row:
            row["roofline_ms"] = 1e3 * row["param_bytes"] / a.bandwidth
        run.record["decode"][weights] = row
        run.save()
        if quant and status == "ok":  # a failed row keeps its conversion for the next run
            drop(run, f"orbax-{quant}")
    ratios(run.record["decode"])
    run.save()


def ratios(decode: dict) -> None:
    """bf16 step time / each row's, next to the ideal one (the ratio of the parameter bytes)."""
    base = decode.get("bf16", {})
    for row in decode.values():
        if "step_ms" in row and "step_ms" in base:
            row["speedup_vs_bf16"] = base["step_ms"] / row["step_ms"]
            row["bytes_ratio_vs_bf16"] = base["param_bytes"] / row["param_bytes"]


def decode_table(record: dict) -> list[str]:
    st, rows = record["settings"], record["decode"]
    lines = [f"batch 1, prompt {st['prompt_len']}, {st['new_tokens']} new tokens, greedy, roofline = parameter "
             f"bytes / {st['bandwidth']:.3g} B/s", "",
             "| weights | param GB | roofline ms | step ms | p10 | p90 | x roofline | bf16 / this | ideal (bytes) "
             "| engine start s |", "|---|---|---|---|---|---|---|---|---|---|"]
    lines += [decode_row(name, r) for name, r in rows.items()]
    w4 = rows.get("w4", {}).get("speedup_vs_bf16")
    lines.append(f"\nw4 vs bf16: **{fmt_num(w4)}x** (target >= 2.5x). K = num_scheduler_steps "
                 f"{_first(rows, 'num_scheduler_steps')} (engine default). Parameter bytes include the input "
                 "embedding table, of which a step reads one row when untied (latency.py's convention); without it: "
                 + ", ".join(f"{k} {fmt_num((r['param_bytes'] - r['embedding_bytes']) / 1e9, 3)} GB"
                             for k, r in rows.items() if "embedding_bytes" in r) + ".")
    return lines


def decode_row(name: str, r: dict) -> str:
    if "step_ms" not in r:
        return f"| {name} | {r.get('status')} |||||||||"
    p, start = r.get("step_ms_pct", {}), r.get("start", {})
    cells = [name, fmt_num(r["param_bytes"] / 1e9, 3), fmt_num(r["roofline_ms"], 3), fmt_num(r["step_ms"], 3),
             fmt_num(p.get("p10"), 3), fmt_num(p.get("p90"), 3), fmt_num(r["step_ms"] / r["roofline_ms"]),
             fmt_num(r.get("speedup_vs_bf16")), fmt_num(r.get("bytes_ratio_vs_bf16")),
             fmt_num(start.get("load_s", 0) + start.get("first_request_s", 0), 1)]
    return "| " + " | ".join(cells) + " |"


def _first(rows: dict, key: str):
    return next((r[key] for r in rows.values() if key in r), "?")
