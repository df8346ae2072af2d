"""quant_gpu's load part: cold and warm load of the Orbax conversion against the safetensors it came from,
each sample in a fresh child (`--side load`), and its table."""
from __future__ import annotations

import importlib
import os
import statistics
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from page_cache import bytes_on_disk, evict, filesystem_of, prewarm, resident_fraction  # noqa: E402
from quant_runner import Run, fmt_num, convert, drop  # noqa: E402


def load_child(args) -> dict:
    """--side load: imports, backend start and load_model timed apart; load ends when every parameter
    is on the device. The persistent compilation cache is on, as in the engine (which turns it on before
    it loads): the safetensors path jits a transpose per weight shape."""
    t0 = time.perf_counter()
    import jax
    from flax import nnx

    from lmjax.engine.compile_cache import enable_compilation_cache
    from lmjax.loader.model_loader import load_model
    t1 = time.perf_counter()
    importlib.import_module("orbax.checkpoint")  # the Orbax reader imports it on first use: an import
    t2 = time.perf_counter()
    device = jax.devices()[0]
    enable_compilation_cache()
    t3 = time.perf_counter()
    loaded = load_model(args.model, args.dtype)
    jax.block_until_ready(jax.tree.leaves(nnx.state(loaded.model)))
    t4 = time.perf_counter()
    params = jax.tree.leaves(nnx.state(loaded.model))
    return {"import_s": t1 - t0, "orbax_import_s": t2 - t1, "backend_init_s": t3 - t2, "load_s": t4 - t3,
            "param_bytes": sum(p.nbytes for p in params), "device": device.device_kind, "jax": jax.__version__}


def load_part(run: Run, safetensors: str) -> None:
    if not run.skip_unless_fits("load", "convert", "load", "load"):
        return
    orbax = convert(run, safetensors, None)
    if orbax is None:
        run.record["load"]["status"] = "skipped: no Orbax conversion"
        return
    formats = {"safetensors": safetensors, "orbax": orbax}
    run.record["load"]["bytes_on_disk"] = {f: bytes_on_disk(p) for f, p in formats.items()}
    fs = run.record["load"]["filesystem"] = filesystem_of(run.args.checkpoint_root)
    if fs == "tmpfs":
        run.record["notes"].append(f"--checkpoint-root {run.args.checkpoint_root} is on tmpfs: the files live in "
                                   "memory, no cold load is possible (point it at a disk)")
    for mode in ("cold", "warm"):
        for i in range(run.args.load_repeats):
            for fmt, path in formats.items():
                load_sample(run, fmt, path, mode, i + 1)
    samples = run.record["load"]["samples"]
    run.record["load"]["summary"] = load_summary(samples)
    run.save()
    if all(s["status"] == "ok" for s in samples):  # else kept for the next run
        drop(run, f"orbax-{run.args.dtype}")


def load_sample(run: Run, fmt: str, path: str, mode: str, repeat: int) -> None:
    (evict if mode == "cold" else prewarm)(path)
    resident = resident_fraction(path)
    t0 = time.perf_counter()
    status, out = run.child(f"load-{mode}-{fmt}-{repeat}", run.side("load", "--model", path), "load")
    sample = {"format": fmt, "mode": mode, "repeat": repeat, "status": status, "page_cache_resident": resident,
              "process_s": round(time.perf_counter() - t0, 2), **(out or {})}
    run.record["load"]["samples"].append(sample)
    run.save()


def load_summary(samples: list[dict]) -> dict:
    """Per (format, mode): median and every sample of the load time, median import and backend start."""
    summary = {}
    for s in samples:
        if "load_s" in s:
            summary.setdefault(f"{s['format']}-{s['mode']}", []).append(s)
    out = {k: {"load_s_median": statistics.median(x["load_s"] for x in v),
               "load_s_samples": [round(x["load_s"], 3) for x in v],
               "import_s_median": statistics.median(x["import_s"] + x["orbax_import_s"] for x in v),
               "backend_init_s_median": statistics.median(x["backend_init_s"] for x in v),
               "process_s_median": statistics.median(x["process_s"] for x in v),
               "resident_before": [x["page_cache_resident"] for x in v]} for k, v in summary.items()}
    for mode in ("cold", "warm"):
        st, ob = out.get(f"safetensors-{mode}"), out.get(f"orbax-{mode}")
        if st and ob:
            out[f"speedup_{mode}"] = st["load_s_median"] / ob["load_s_median"]
    return out


def load_table(load: dict) -> list[str]:
    s, disk = load["summary"], load.get("bytes_on_disk", {})
    lines = ["| format | GB on disk | cold load s (median) | cold samples | warm load s (median) | warm samples "
             "| import s | backend start s | page cache before cold / warm |", "|---|---|---|---|---|---|---|---|---|"]
    for fmt in ("safetensors", "orbax"):
        cold, warm = s.get(f"{fmt}-cold", {}), s.get(f"{fmt}-warm", {})
        resident = f"{fmt_num(_most(cold.get('resident_before')))} / {fmt_num(_most(warm.get('resident_before')))}"
        lines.append(f"| {fmt} | {fmt_num(disk.get(fmt, 0) / 1e9, 3)} | {fmt_num(cold.get('load_s_median'))} | "
                     f"{', '.join(map(fmt_num, cold.get('load_s_samples', [])))} | {fmt_num(warm.get('load_s_median'))} | "
                     f"{', '.join(map(fmt_num, warm.get('load_s_samples', [])))} | {fmt_num(cold.get('import_s_median'))} | "
                     f"{fmt_num(cold.get('backend_init_s_median'))} | {resident} |")
    cold_resident = [_most(s.get(f"{f}-cold", {}).get("resident_before")) for f in ("safetensors", "orbax")]
    if any(x is not None and x > 0.05 for x in cold_resident):
        lines.append("\n**warning**: up to " + f"{max(x for x in cold_resident if x is not None):.0%} of a "
                     "checkpoint was still in the page cache before a cold sample: not fully cold")
    lines.append(f"\ncold load safetensors / orbax: **{fmt_num(s.get('speedup_cold'))}x** (target >= 2x); "
                 f"warm: {fmt_num(s.get('speedup_warm'))}x. Load = load_model() until every parameter is on the "
                 "device; imports (jax, lmjax, orbax) and backend start are apart; page cache column: the "
                 "largest resident fraction of the checkpoint's pages before a sample.")
    return lines


def _most(fractions: list | None) -> float | None:
    known = [x for x in fractions or [] if x is not None]
    return max(known) if known else None
