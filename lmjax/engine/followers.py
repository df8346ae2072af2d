"""Tensor parallelism across processes (jax.distributed): process 0 runs the scheduler and sends every step's
inputs to the others, which run the same jitted step on their shards (lmjax.parallel's send_step /
receive_step). Mixed into ModelRunner (its `_run` and `leading`)."""
from __future__ import annotations

import dataclasses

import numpy as np

from lmjax import parallel
from lmjax.config import SamplingParams
from lmjax.layers.attention import AttentionMetadata
from lmjax.layers.sampler import SamplingFlags, SamplingMetadata, SamplingRow, build_sampling_metadata


def step_kind(smeta: SamplingMetadata) -> int:
    """The kind of step a leader sends its followers (lmjax.parallel.send_step): 1 + one bit per optional
    sampling input present (allowed-token mask, logit bias), since each combination is a pytree of another
    structure, which a follower must know to receive it."""
    return 1 + sum(present << i for i, present in enumerate(smeta.optional_inputs()))


def _follower_sampling_templates() -> dict[int, SamplingMetadata]:
    """{step kind: a one-row SamplingMetadata of that kind's structure}, every kind a leader may send."""
    greedy = SamplingParams(temperature=0.0)
    with_input = [{"allowed_W": np.zeros(1, np.uint32)},  # in SamplingMetadata.optional_inputs() order
                  {"params": dataclasses.replace(greedy, logit_bias={0: 0.0})}]
    templates = {}
    for bits in range(1 << len(with_input)):
        row = SamplingRow(greedy, seed=0)
        for i, extra in enumerate(with_input):
            row = dataclasses.replace(row, **extra) if bits >> i & 1 else row
        smeta, _ = build_sampling_metadata([row], pad_to=1)
        templates[step_kind(smeta)] = smeta
    return templates


class FollowersMixin:
    def lead(self) -> None:
        """On process 0: send every step's inputs to the processes in `follow()` (lmjax.parallel)."""
        self.leading = True

    def release_followers(self) -> None:
        """On the leader, when done: end the followers' `follow()` loops."""
        if self.leading:
            parallel.send_stop()
            self.leading = False

    def follow(self) -> int:
        """On processes other than the leader: run the leader's steps until it releases us; returns
        how many steps ran. The results are the leader's to read (they are replicated)."""
        from lmjax.engine.model_runner import StepInputs  # deferred: model_runner imports this module

        _, flags = build_sampling_metadata([SamplingRow(SamplingParams(temperature=0.0), seed=0)], pad_to=1)
        one, table = np.zeros(1, np.int32), np.zeros((1, 1), np.int32)
        inputs = StepInputs(one, one, AttentionMetadata(one, one, one, table, one), one, one)
        # One entry per kind of jitted call the leader may send: (input template, how to run it).
        kinds = {kind: ((inputs, smeta), self._run) for kind, smeta in _follower_sampling_templates().items()}
        steps = 0
        while (step := parallel.receive_step({k: t for k, (t, _) in kinds.items()})) is not None:
            kind, (step_inputs, step_smeta), static = step
            step_flags = SamplingFlags(*(type(f)(v) for f, v in zip(flags, static[:-1])))
            kinds[kind][1](step_inputs, step_smeta, step_flags, static[-1])
            steps += 1
        return steps
