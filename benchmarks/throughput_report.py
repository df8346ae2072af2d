"""throughput.py's report: the greedy agreement of the two engines, the results table, the device
profile's summary and the JSON summary line."""
from __future__ import annotations

import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from throughput_workload import Result, _budget, _prompt_tokens  # noqa: E402


def agreement(a: list[list[int]], b: list[list[int] | None]) -> dict:
    """Greedy sanity check: same weights, same prompts -> mostly the same tokens (ties may differ).
    Only requests both engines ran (transformers may have timed a subset)."""
    pairs = [(x, y) for x, y in zip(a, b) if y is not None]
    if not pairs:
        return {"identical_outputs": "0/0", "mean_common_prefix": None}
    same = sum(x == y for x, y in pairs)
    prefix = [next((k for k, (u, v) in enumerate(zip(x, y)) if u != v), len(x)) / max(len(x), 1) for x, y in pairs]
    return {"identical_outputs": f"{same}/{len(pairs)}", "mean_common_prefix": round(sum(prefix) / len(prefix), 3)}


def print_table(results: list[Result]) -> None:
    print(f"{'engine':<14}{'elapsed s':>11}{'req/s':>9}{'out tok/s':>12}{'total tok/s':>13}  note")
    for r in results:
        x = r.rates()
        print(f"{r.name:<14}{r.elapsed_s:>11.2f}{x['requests_per_s']:>9.3f}{x['output_tokens_per_s']:>12.2f}"
              f"{x['total_tokens_per_s']:>13.2f}  {_note(r)}")


def _note(r: Result) -> str:
    e = r.extra
    if r.name == "lmjax":
        return (f"warm-up {e['warmup_s']:.1f} s ({e['warmup_compilations']} compiles); in timed pass "
                f"{e['compilations_in_timed_pass']} compiles, {e['compile_s_in_timed_pass']:.1f} s")
    note = f"batch {e['hf_batch_size']}, " + ("static+compile" if e.get("hf_compiled") else
                                               "static cache, not compiled" if e.get("hf_static_cache") else "eager")
    if "hf_extrapolated_from_requests" in e:
        note += f", extrapolated from {e['hf_extrapolated_from_requests']} requests ({e['hf_timed_s']:.1f} s)"
    if "hf_compile_error" in e:
        note += f", compile failed: {e['hf_compile_error'][:80]}"
    if "hf_all_batch_sizes" in e:
        note += f"; out tok/s by batch size {e['hf_all_batch_sizes']}"
    return note


def print_profile(p: dict) -> None:
    if "error" in p:
        print(f"profile: {p['error']}")
        return
    wall, span, busy = p["wall_ms_per_step"], p["span_us_per_step"] / 1e3, p["busy_us_per_step"] / 1e3
    print(f"profile (batch {p['batch']}, {p['decode_steps']} decode steps traced): wall {wall:.3f} ms/step, GPU span "
          f"{span:.3f} ms, busy {busy:.3f} ms -> device idle {100 * p['idle_fraction']:.1f}% of the span "
          f"({100 * (1 - busy / wall):.1f}% of the wall time)")
    for name, us, n in p["top_kernels_us_per_step"][:5]:
        print(f"  {us:9.1f} us/step {n:6.1f}x  {name[:70]}")


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
