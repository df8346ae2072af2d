"""throughput.py's workload and its accounting: the seeded random requests both engines run, the result
record each engine's run produces, and the token counts its rates are computed from."""
from __future__ import annotations

import dataclasses
import random


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


# ------------------------------------------------------------------ accounting
def _check_counts(name: str, tokens: list[list[int]], requests: list[Request]) -> None:
    wrong = [(len(t), r.max_tokens) for t, r in zip(tokens, requests) if len(t) != r.max_tokens]
    if wrong:
        raise RuntimeError(f"{name} generated the wrong number of tokens (got, wanted): {wrong[:5]}")


def _prompt_tokens(requests) -> int:
    return sum(len(r.prompt_ids) for r in requests)


def _budget(requests) -> int:
    return sum(r.max_tokens for r in requests)
