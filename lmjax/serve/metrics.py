"""Prometheus text exposition of the engine's state (no client library needed): running and waiting
requests, KV cache use and free blocks, prefilled and generated tokens, finished requests by reason."""
from __future__ import annotations

_METRICS = [  # (name, type, help, stats key)
    ("lmjax_num_requests_running", "gauge", "Sequences in the running batch.", "num_running"),
    ("lmjax_num_requests_waiting", "gauge", "Sequences waiting to be scheduled.", "num_waiting"),
    ("lmjax_kv_cache_usage_perc", "gauge", "Fraction of KV cache blocks in use (1 = full).", "kv_cache_usage"),
    ("lmjax_kv_cache_free_blocks", "gauge", "KV cache blocks free to hand out.", "num_free_blocks"),
    ("lmjax_kv_cache_total_blocks", "gauge", "KV cache blocks in all (padding block excluded).",
     "num_usable_blocks"),
    ("lmjax_num_sessions", "gauge", "Interactive sessions holding a history.", "num_sessions"),
    ("lmjax_prompt_tokens_total", "counter", "Prompt tokens prefilled (KV reused from a session or the "
     "prefix cache is not counted).", "num_prefill_tokens"),
    ("lmjax_generation_tokens_total", "counter", "Tokens generated.", "num_generated_tokens"),
    ("lmjax_num_preemptions_total", "counter", "Sequences preempted (recomputed later).", "num_preemptions"),
    ("lmjax_prefix_cache_hits_total", "counter", "Prompt tokens served by the prefix cache.", "prefix_cache_hits"),
    ("lmjax_num_compilations", "gauge", "Jitted step compilations so far.", "num_compilations"),
]


def render_metrics(engine) -> str:
    """`engine` is an AsyncEngine: its `stats()` and its engine thread's finished-request counts."""
    stats = engine.stats()
    lines = []
    for name, kind, help_text, key in _METRICS:
        lines += [f"# HELP {name} {help_text}", f"# TYPE {name} {kind}", f"{name} {float(stats[key])}"]
    name = "lmjax_request_finished_total"
    lines += [f"# HELP {name} Finished completions by finish reason.", f"# TYPE {name} counter"]
    for reason, count in sorted(engine.finished_reasons().items()):
        lines.append(f'{name}{{finished_reason="{reason}"}} {float(count)}')
    return "\n".join(lines) + "\n"
