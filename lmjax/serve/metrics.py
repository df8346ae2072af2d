"""Prometheus text exposition of the engine's state (no client library needed): running and waiting
requests, KV cache use and free blocks, prefilled and generated tokens, prefix-cache queries and hits,
finished requests by reason. Where vLLM exports the same quantity, it is also given under vLLM's name
(`vllm:...`, labelled with model_name as vLLM's are): dashboards and autoscalers scrape those."""
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
    ("lmjax_prefix_cache_queries_total", "counter", "Prompt tokens looked up in the prefix cache.",
     "prefix_cache_queries"),
    ("lmjax_prefix_cache_hits_total", "counter", "Prompt tokens served by the prefix cache.", "prefix_cache_hits"),
    ("lmjax_num_compilations", "gauge", "Jitted step compilations so far.", "num_compilations"),
    ("lmjax_spec_decode_num_drafts_total", "counter", "Speculative drafts verified.", "num_drafts"),
    ("lmjax_spec_decode_num_draft_tokens_total", "counter", "Speculative draft tokens verified.", "num_draft_tokens"),
    ("lmjax_spec_decode_num_accepted_tokens_total", "counter", "Speculative draft tokens accepted.",
     "num_accepted_tokens"),
]


# lmjax's name -> vLLM's, for the quantities both count the same way (vLLM's prompt-token counter counts
# every prompt token, lmjax's only the prefilled ones: not aliased)
_VLLM_NAMES = {"lmjax_num_requests_running": "vllm:num_requests_running",
               "lmjax_num_requests_waiting": "vllm:num_requests_waiting",
               "lmjax_kv_cache_usage_perc": "vllm:kv_cache_usage_perc",
               "lmjax_generation_tokens_total": "vllm:generation_tokens_total",
               "lmjax_num_preemptions_total": "vllm:num_preemptions_total",
               "lmjax_prefix_cache_queries_total": "vllm:prefix_cache_queries_total",
               "lmjax_prefix_cache_hits_total": "vllm:prefix_cache_hits_total",
               "lmjax_request_finished_total": "vllm:request_success_total",
               "lmjax_spec_decode_num_drafts_total": "vllm:spec_decode_num_drafts_total",
               "lmjax_spec_decode_num_draft_tokens_total": "vllm:spec_decode_num_draft_tokens_total",
               "lmjax_spec_decode_num_accepted_tokens_total": "vllm:spec_decode_num_accepted_tokens_total"}


def render_metrics(engine, model_name: str) -> str:
    """`engine` is an AsyncEngine: its `stats()` and its engine thread's finished-request counts; `model_name`
    labels vLLM's names (the name the server serves, as vLLM's served_model_name)."""
    stats, model = engine.stats(), _label(model_name)
    lines = []
    for name, kind, help_text, key in _METRICS:
        lines += _metric(name, kind, help_text, [("", float(stats[key]))], model)
    reasons = [(f'finished_reason="{reason}"', float(count))
               for reason, count in sorted(engine.finished_reasons().items())]
    lines += _metric("lmjax_request_finished_total", "counter", "Finished completions by finish reason.", reasons,
                     model)
    return "\n".join(lines) + "\n"


def _metric(name: str, kind: str, help_text: str, samples: list[tuple[str, float]], model: str) -> list[str]:
    """The metric's lines under lmjax's name, then under vLLM's (with the model_name label) if it has one."""
    lines = [f"# HELP {name} {help_text}", f"# TYPE {name} {kind}"]
    lines += [f"{name}{{{labels}}} {value}" if labels else f"{name} {value}" for labels, value in samples]
    vllm = _VLLM_NAMES.get(name)
    if vllm:
        lines += [f"# HELP {vllm} {help_text}", f"# TYPE {vllm} {kind}"]
        lines += [f'{vllm}{{model_name="{model}"{"," + labels if labels else ""}}} {value}'
                  for labels, value in samples]
    return lines


def _label(value: str) -> str:
    """A Prometheus label value: backslash, quote and newline escaped."""
    return value.replace("\\", "\\\\").replace('"', '\\"').replace("\n", "\\n")
