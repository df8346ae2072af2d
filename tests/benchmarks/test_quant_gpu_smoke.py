"""benchmarks/quant_gpu.py end to end on the tiny shape (CPU, ~20 s): the plumbing of issue 7's GPU command
(children, page-cache handling, conversions, budget, JSON and tables), never its figures."""
import json
import os
import subprocess
import sys

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def test_quant_gpu_smoke_runs_every_part(tmp_path):
    out, root = tmp_path / "out", tmp_path / "ckpt"
    cmd = [sys.executable, os.path.join(REPO, "benchmarks", "quant_gpu.py"), str(out), "--shape", "tiny", "--smoke",
           "--checkpoint-root", str(root), "--load-repeats", "1", "--decode", "bf16", "w4", "--budget", "300"]
    env = {**os.environ, "JAX_PLATFORMS": "cpu", "PYTHONPATH": REPO}
    done = subprocess.run(cmd, capture_output=True, text=True, env=env, cwd=REPO, timeout=280)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    record = json.loads((out / "quant_gpu-tiny-load+decode.json").read_text())

    assert [s["name"] for s in record["steps"] if s["status"] != "ok"] == []
    samples = record["load"]["samples"]
    assert [(s["mode"], s["format"]) for s in samples] == [
        ("cold", "safetensors"), ("cold", "orbax"), ("warm", "safetensors"), ("warm", "orbax")]
    assert all(s["load_s"] > 0 and s["param_bytes"] == samples[0]["param_bytes"] for s in samples)
    assert all(s["page_cache_resident"] == 1.0 for s in samples if s["mode"] == "warm")
    assert {"speedup_cold", "speedup_warm"} <= set(record["load"]["summary"])

    bf16, w4 = record["decode"]["bf16"], record["decode"]["w4"]
    assert bf16["step_ms"] > 0 and w4["step_ms"] > 0 and w4["xla_compiles_in_timed"] == 0
    assert w4["param_bytes"] < bf16["param_bytes"] and w4["speedup_vs_bf16"] > 0
    # conversions are gone once used; the safetensors checkpoint stays for the next run
    assert all(c.get("deleted") for c in record["conversions"].values())
    assert [p.name for p in root.iterdir()] == [os.path.basename(record["checkpoint"]["path"])]
    assert "w4 vs bf16" in (out / "quant_gpu-tiny-load+decode.md").read_text() and "| orbax |" in done.stdout
