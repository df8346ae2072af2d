"""The benchmarks' own helpers: the fast random checkpoint both engines load as the same model, and the
transformers subset/extrapolation arithmetic of throughput.py. (Benchmark figures never come from here.)"""
import os
import sys

import numpy as np
import pytest

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))),
                                "benchmarks"))
from random_model import SHAPES, checkpoint_bytes, write_fast_checkpoint  # noqa: E402
from throughput import Request, _timed_groups  # noqa: E402


@pytest.fixture(scope="module")
def tiny_sharded(tmp_path_factory):
    path = str(tmp_path_factory.mktemp("fast"))
    return write_fast_checkpoint("tiny", path, dtype="float32", seed=3, device="cpu", shard_bytes=150_000)


def test_fast_checkpoint_is_one_model_for_both_engines(tiny_sharded):
    import torch
    import transformers

    from lmjax import LLM, SamplingParams

    files = sorted(f for f in os.listdir(tiny_sharded) if f.endswith(".safetensors"))
    assert len(files) > 1 and os.path.exists(os.path.join(tiny_sharded, "model.safetensors.index.json"))
    hf, info = transformers.AutoModelForCausalLM.from_pretrained(tiny_sharded, dtype=torch.float32,
                                                                 output_loading_info=True)
    assert not any(info.values()), info  # no missing, unexpected or mismatched tensors
    n = sum(p.numel() for p in hf.parameters())
    assert checkpoint_bytes(tiny_sharded) == 4 * n and checkpoint_bytes(tiny_sharded, 2) == 2 * n
    assert hf.config.vocab_size == SHAPES["tiny"]["vocab_size"]
    w = hf.model.layers[0].mlp.up_proj.weight.detach().numpy()
    assert 0.015 < w.std() < 0.025 and (hf.model.norm.weight.detach().numpy() == 1).all()

    prompt = np.random.default_rng(0).integers(3, 1024, 12).tolist()
    want = hf.generate(torch.tensor([prompt]), max_new_tokens=8, min_new_tokens=8, do_sample=False,
                       temperature=None, top_p=None, top_k=None)[0, 12:].tolist()
    llm = LLM(tiny_sharded, dtype="float32", max_model_len=64, block_size=16)
    got = llm.generate([prompt], SamplingParams(temperature=0, max_tokens=8, ignore_eos=True), use_tqdm=False)
    assert got[0].outputs[0].token_ids == want


def test_timed_groups_spread_over_the_workload():
    groups = [list(range(i, i + 4)) for i in range(0, 40, 4)]  # 10 batches of 4
    assert _timed_groups(groups, 0) == groups
    assert _timed_groups(groups, 1000) == groups
    assert _timed_groups(groups, 3) == [groups[0]]  # at least one whole batch
    assert _timed_groups(groups, 12) == [groups[0], groups[4], groups[9]]  # 3 batches, first to last
    ragged = groups + [[40, 41]]  # a smaller last batch is never timed alone (another shape)
    assert _timed_groups(ragged, 8) == [groups[0], groups[9]]


def test_hf_subset_extrapolates_by_output_tokens(monkeypatch):
    import throughput_hf

    calls = []

    def fake_batch(model, prompts, new_tokens, pad_id, static=False):
        calls.append((len(prompts), new_tokens))
        return [[7] * new_tokens for _ in prompts], 0

    monkeypatch.setattr(throughput_hf, "_hf_batch", fake_batch)  # where run_hf calls it
    requests = [Request([1, 2, 3], 10) for _ in range(40)]
    res, tokens = throughput_hf.run_hf(None, requests, 8, 0, max_requests=16)
    assert calls[1:] == [(8, 10), (8, 10)]  # a warm-up, then 2 of the 5 batches
    assert res.extra["hf_extrapolated_from_requests"] == 16
    assert res.elapsed_s == pytest.approx(res.extra["hf_timed_s"] * 40 / 16, rel=1e-2, abs=1e-3)
    assert res.output_tokens == 400 and sum(t is not None for t in tokens) == 16


def test_trace_idle_gaps_are_the_holes_in_the_union_of_kernels():
    import trace_summary

    # two streams overlap on [11, 16); holes: [16, 30) and [31, 200)
    kernels = [dict(ts=0, dur=11), dict(ts=11, dur=5), dict(ts=12, dur=2), dict(ts=30, dur=1), dict(ts=200, dur=1)]
    gaps = trace_summary.idle_gaps_us(kernels)
    assert gaps == [14, 169]
    assert trace_summary.busy_us(kernels) + sum(gaps) == 201  # busy + idle = span
    hist = {label: (n, us) for label, n, us in trace_summary.gap_histogram(gaps)}
    assert hist["5-20 us"] == (1, 14) and hist[">=100 us"] == (1, 169) and hist["0-2 us"] == (0, 0)


def test_decode_levers_runs_a_variant_and_tabulates_failures():
    """decode_levers.py: a variant's environment reaches its tp_decode process (a bad value fails there,
    naming it), its figures reach the table, and a failed variant is a table row, not a crash."""
    import argparse

    import decode_levers

    name, env = decode_levers.parse_extra("broken:LMJAX_MERGE_GATE_UP=maybe,XLA_FLAGS=--a=b")
    assert (name, env) == ("broken", {"LMJAX_MERGE_GATE_UP": "maybe", "XLA_FLAGS": "--a=b"})
    with pytest.raises(ValueError, match="'nameonly'"):
        decode_levers.parse_extra("nameonly")
    args = argparse.Namespace(shape="tiny", steps=2, block_size=16, context=32, iters=2, timeout=300,
                              variant_env={**decode_levers.VARIANTS, "broken": {"LMJAX_MERGE_GATE_UP": "maybe"}})
    ok = decode_levers.run_variant("fused-qkv", args)
    assert ok["multi_step_ms_per_step"] > 0 and len(ok["greedy_tokens"]) == 2
    bad = decode_levers.run_variant("broken", args)
    assert "LMJAX_MERGE_GATE_UP='maybe'" in " ".join(bad["error"])
    text = decode_levers.table([ok, bad], 4.26e12)
    assert "| fused-qkv |" in text and "| 1.000 | True |" in text and "| broken | failed:" in text


def test_latency_counts_every_device_step_of_each_multi_step_call(tiny_sharded):
    """latency.py's per-step time divides by the device steps run: the last K-step call of a request
    runs K steps even when fewer tokens remain (11 decode tokens, K = 4: three calls, 12 steps)."""
    from latency import time_request

    from lmjax import LLM

    engine = LLM(tiny_sharded, dtype="float32", max_model_len=64, num_scheduler_steps=4).llm_engine
    run = time_request(engine, list(range(4, 12)), new_tokens=12)
    assert run["call_steps"] == [4, 4, 4] and run["call_tokens"] == [4, 4, 3]
    assert run["decode_steps"] == 12 and run["decode_calls"] == 3
