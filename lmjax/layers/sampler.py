"""Sampling on device: one batch of logits in, one token per row out, each row with its own params.

Shape letters: B batch rows (padding rows included), V vocabulary, L penalty-token slots,
X banned-id slots, N logit-bias slots, K top logprobs returned per row, W 32-bit words of a packed token
mask (ceil(V / 32)).

Data flow: each step the engine calls `build_sampling_metadata(rows, pad_to)` on the host (numpy
only), gets a `SamplingMetadata` pytree plus `SamplingFlags`, and calls
`sample(logits_BV, meta, **flags._asdict())` inside its jitted step with the flags static, so a
greedy-only batch compiles to a plain argmax. The logits pipeline follows vLLM V1's sampler:
logit bias -> penalties -> banned ids -> allowed-token mask -> temperature -> min-p -> top-k -> top-p ->
Gumbel-max draw; greedy rows (temperature 0) take the argmax after the bias, penalties, bans and the mask.
A sampled row's logits are first shifted by its best one, so any temperature > 0 samples as asked (vLLM
clamps one below 0.01 to 0.01, against its own overflow: here 1e-38 picks among the best logits' ties).
(vLLM masks first, then bans, then biases, then penalizes: a -inf stays -inf under a bias or a penalty,
so the two orders agree.) The bias (a request's logit_bias, sparse: ids and values) and the mask (guided
decoding, allowed_token_ids: lmjax.engine.guided; a packed bitmask) are present only when some row has
one, so every other batch compiles and runs as if they did not exist.

Logprobs are those of the raw model output, before any of the above (vLLM V1's default logprobs_mode,
"raw_logprobs"): a biased or banned token keeps the logprob the model gave it. A guided row's are over the
tokens its guide allows (vLLM V1 applies the structured-output mask to the logits before its sampler).

Reproducibility: row b's noise comes from fold_in(key(seed_b), step_b), step_b being the number
of tokens the request has generated, so a request draws the same tokens whatever else shares
its batch, at whatever row, and again after a preemption recomputes it.
"""
from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from lmjax.config import SamplingParams
from lmjax.validation import FLOAT32_TINY

NO_TOKEN = -1  # the token id of a row that had nothing to sample (every logit -inf after bans and masks)


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class SamplingMetadata:
    """Per-row sampling inputs (padding: greedy rows with neutral values, ids -1)."""
    temperature_B: jax.Array          # float32, 0 = greedy
    top_k_B: jax.Array                # int32, 0 = off
    top_p_B: jax.Array                # float32, 1 = off
    min_p_B: jax.Array                # float32, 0 = off
    min_p_last_B: jax.Array           # bool: LMDeploy's order (top-k, top-p, then min-p), else vLLM's
    repetition_penalty_B: jax.Array   # float32, over prompt + output tokens
    presence_penalty_B: jax.Array     # float32, over output tokens
    frequency_penalty_B: jax.Array    # float32, over output tokens
    seeds_B: jax.Array                # uint32
    steps_B: jax.Array                # int32, tokens generated so far
    prompt_tokens_BL: jax.Array       # int32, -1 padded
    output_tokens_BL: jax.Array       # int32, -1 padded
    banned_BX: jax.Array              # int32, -1 padded
    # uint32 packed bitmask, bit j of word w allows token 32 w + j; None when no row restricts its tokens
    # (a different pytree, hence its own compilation: unguided batches never pay for the mask).
    allowed_BW: jax.Array | None = None
    # bool: the row's mask is a guide's (structured output), present with allowed_BW: its logprobs are over
    # the tokens the guide allows (vLLM V1 masks those logits before its sampler; allowed_token_ids it applies
    # inside, after taking the raw logprobs)
    guided_B: jax.Array | None = None
    # logit_bias: int32 ids (-1 padded) and the float32 biases added to their logits; both None when no row
    # has one (as allowed_BW: unbiased batches never pay for it).
    bias_ids_BN: jax.Array | None = None
    bias_values_BN: jax.Array | None = None

    def optional_inputs(self) -> tuple[bool, ...]:
        """Which optional inputs are present (mask, bias): each combination is a pytree of its own
        structure, so a jitted step of its own (and a step kind of its own for tp followers)."""
        return self.allowed_BW is not None, self.bias_ids_BN is not None


class SamplingFlags(NamedTuple):
    """Static (compile-time) switches: each distinct value is one compilation.
    max_top_k > 0: every sampling row has top_k in [1, max_top_k] (a power of two), so top-k/top-p
    needs only lax.top_k(max_top_k) instead of sorting the vocabulary."""
    all_greedy: bool
    use_penalties: bool
    use_top_k_top_p: bool
    num_logprobs: int
    max_top_k: int = 0
    ranks: bool = False  # some row asked for logprobs: the sampled token's rank in the vocabulary too


def is_basic(flags: SamplingFlags, meta: SamplingMetadata) -> bool:
    """Greedy or plain temperature sampling: no penalties, top-k / top-p, logprobs, mask, bias, and at most one
    banned id. The engine fuses only these into its model step (lmjax.engine.background_compile says why)."""
    return (not (flags.use_penalties or flags.use_top_k_top_p or flags.num_logprobs or flags.ranks)
            and not any(meta.optional_inputs()) and meta.banned_BX.shape[1] == 1)


class SamplerOutput(NamedTuple):
    token_ids_B: jax.Array        # int32
    logprobs_B: jax.Array         # float32, chosen token under log_softmax(raw logits)
    top_ids_BK: jax.Array         # int32
    top_logprobs_BK: jax.Array    # float32
    rank_B: jax.Array             # int32, the chosen token's rank (1 = most likely; 0 when not asked)


# ---------------------------------------------------------------- device side

def _scatter_rows(x_BV: jax.Array, ids_BN: jax.Array, value, add: bool = False) -> jax.Array:
    """x[b, ids[b, n]] = value (or += value); ids < 0 are padding and dropped."""
    rows_B1 = jnp.arange(x_BV.shape[0])[:, None]
    # JAX wraps negative indices, so send padding out of bounds where mode="drop" discards it.
    ids_BN = jnp.where(ids_BN < 0, x_BV.shape[1], ids_BN)
    ref = x_BV.at[rows_B1, ids_BN]
    return ref.add(value, mode="drop") if add else ref.set(value, mode="drop")


def apply_penalties(logits_BV: jax.Array, meta: SamplingMetadata) -> jax.Array:
    """HF's repetition penalty over prompt + output, then OpenAI presence/frequency over output."""
    zeros_BV = jnp.zeros(logits_BV.shape, jnp.int32)
    out_counts_BV = _scatter_rows(zeros_BV, meta.output_tokens_BL, 1, add=True)
    seen_BV = (_scatter_rows(zeros_BV, meta.prompt_tokens_BL, 1) + out_counts_BV) > 0
    rep_B1 = meta.repetition_penalty_B[:, None]
    penalized_BV = jnp.where(logits_BV < 0, logits_BV * rep_B1, logits_BV / rep_B1)
    logits_BV = jnp.where(seen_BV, penalized_BV, logits_BV)
    return (logits_BV - meta.frequency_penalty_B[:, None] * out_counts_BV
            - meta.presence_penalty_B[:, None] * (out_counts_BV > 0))


def apply_logit_bias(logits_BV: jax.Array, bias_ids_BN: jax.Array, bias_values_BN: jax.Array) -> jax.Array:
    """logits[b, ids[b, n]] += values[b, n] (ids -1: padding). A request's ids are distinct (dict keys)."""
    return _scatter_rows(logits_BV, bias_ids_BN, bias_values_BN, add=True)


def apply_banned(logits_BV: jax.Array, banned_BX: jax.Array) -> jax.Array:
    return _scatter_rows(logits_BV, banned_BX, -jnp.inf)


def unpack_allowed(allowed_BW: jax.Array, V: int) -> jax.Array:
    """bool [B, V] of a packed mask. The mask crosses to the device packed (V / 8 bytes a row instead of V)
    and is unpacked here, where it is a few elementwise ops."""
    bits_BW32 = (allowed_BW[:, :, None] >> jnp.arange(32, dtype=jnp.uint32)) & 1
    return bits_BW32.reshape(allowed_BW.shape[0], -1)[:, :V].astype(bool)


def apply_allowed(logits_BV: jax.Array, allowed_BW: jax.Array) -> jax.Array:
    """-inf where the row's packed mask bit is 0."""
    return jnp.where(unpack_allowed(allowed_BW, logits_BV.shape[1]), logits_BV, -jnp.inf)


def apply_temperature(logits_BV: jax.Array, temperature_B: jax.Array) -> jax.Array:
    # Greedy rows divide by 1: their argmax is taken before this step anyway.
    safe_B = jnp.where(temperature_B > 0, temperature_B, 1.0)
    return logits_BV / safe_B[:, None]


def apply_top_k_top_p(logits_BV: jax.Array, top_k_B: jax.Array, top_p_B: jax.Array,
                      max_top_k: int = 0) -> jax.Array:
    """Keep the top_k largest, then the smallest head whose mass reaches top_p. Ties with the last
    kept value are kept (as HF's top-k does). One descending head of S values serves both: the
    whole sorted row (S = V), or, when every row's top_k is in [1, max_top_k], just
    lax.top_k(max_top_k), which is far cheaper than sorting a large vocabulary."""
    if max_top_k:
        head_BS = jax.lax.top_k(logits_BV, min(max_top_k, logits_BV.shape[-1]))[0]
    else:
        head_BS = jnp.flip(jnp.sort(logits_BV, axis=-1), axis=-1)
    S = head_BS.shape[-1]
    k_B = jnp.where(top_k_B > 0, jnp.minimum(top_k_B, S), S)
    in_top_k_BS = jnp.arange(S)[None, :] < k_B[:, None]
    probs_BS = jax.nn.softmax(jnp.where(in_top_k_BS, head_BS, -jnp.inf), axis=-1)
    mass_before_BS = jnp.cumsum(probs_BS, axis=-1) - probs_BS
    # top_p == 1 keeps everything explicitly: float rounding of the cumsum must not trim the tail.
    in_top_p_BS = (mass_before_BS < top_p_B[:, None]) | (top_p_B[:, None] >= 1.0)
    keep_B = jnp.sum(in_top_k_BS & in_top_p_BS, axis=-1)
    threshold_B1 = jnp.take_along_axis(head_BS, keep_B[:, None] - 1, axis=-1)
    return jnp.where(logits_BV < threshold_B1, -jnp.inf, logits_BV)


def apply_min_p(logits_BV: jax.Array, min_p_B: jax.Array) -> jax.Array:
    """Drop tokens with prob < min_p * max prob, i.e. logit < max logit + log(min_p)."""
    max_B1 = jnp.max(logits_BV, axis=-1, keepdims=True)
    return jnp.where(logits_BV < max_B1 + jnp.log(min_p_B)[:, None], -jnp.inf, logits_BV)


def _gumbel_BV(seeds_B: jax.Array, steps_B: jax.Array, V: int) -> jax.Array:
    """Gumbel noise from 32 random bits an element, as -log(-log1p(-u)) with u = (bits + 1/2) / 2**32: a token
    wins against one up to ~22.9 logits above it (u's smallest value). jax.random.gumbel's default draws u on
    float32's 2**-23 grid, capping the noise at 15.9: a token more than ~16 below the top one (a confident
    step's 100k-token tail) was drawn ~5x too rarely. (Its mode="high" would draw twice the bits.)"""
    def row(seed, step):
        bits_V = jax.random.bits(jax.random.fold_in(jax.random.key(seed), step), (V,), jnp.uint32)
        u_V = (bits_V.astype(jnp.float32) + 0.5) * (2.0 ** -32)  # in (0, 1]; 1 (rounded up) is noise -inf
        return -jnp.log(-jnp.log1p(-u_V))
    return jax.vmap(row)(seeds_B, steps_B)


def token_rank(logprobs_BV: jax.Array, chosen_B: jax.Array) -> jax.Array:
    """How many tokens are at least as likely as the chosen one, itself included (vLLM V1's Logprob.rank: 1 for
    the likeliest; a tie counts against the chosen token, as vLLM counts >=), int32 [B]."""
    return jnp.sum(logprobs_BV >= chosen_B[:, None], axis=-1, dtype=jnp.int32)


def _logprob_outputs(raw_BV: jax.Array, token_ids_B: jax.Array, num_logprobs: int, ranks: bool) -> SamplerOutput:
    logprobs_BV = jax.nn.log_softmax(raw_BV, axis=-1)
    chosen_B = jnp.take_along_axis(logprobs_BV, jnp.maximum(token_ids_B, 0)[:, None], axis=-1)[:, 0]
    B = raw_BV.shape[0]
    if num_logprobs:
        top_logprobs_BK, top_ids_BK = jax.lax.top_k(logprobs_BV, num_logprobs)
    else:
        top_logprobs_BK, top_ids_BK = jnp.zeros((B, 0), jnp.float32), jnp.zeros((B, 0), jnp.int32)
    rank_B = token_rank(logprobs_BV, chosen_B) if ranks else jnp.zeros((B,), jnp.int32)
    return SamplerOutput(token_ids_B, chosen_B, top_ids_BK.astype(jnp.int32), top_logprobs_BK, rank_B)


def warp(logits_BV: jax.Array, meta: SamplingMetadata, use_top_k_top_p: bool, max_top_k: int = 0) -> jax.Array:
    """Temperature, then vLLM's (V1) order: min_p on the temperature-scaled distribution, then top-k and
    top-p on what it left (V0 applied min_p last); rows with `min_p_last` take LMDeploy's: top-k and top-p
    on the whole distribution, then min_p. (min_p's test, p >= min_p * max p, keeps the same tokens before
    or after the others renormalise, so LMDeploy's order is min_p's mask over top-k/top-p of the whole.)"""
    scaled_BV = apply_temperature(logits_BV, meta.temperature_B)
    logits_BV = apply_min_p(scaled_BV, meta.min_p_B)
    if use_top_k_top_p:
        last_B1 = meta.min_p_last_B[:, None]
        kept_BV = apply_top_k_top_p(jnp.where(last_B1, scaled_BV, logits_BV), meta.top_k_B, meta.top_p_B, max_top_k)
        logits_BV = jnp.where(last_B1 & (logits_BV == -jnp.inf), -jnp.inf, kept_BV)
    return logits_BV


def sample(logits_BV: jax.Array, meta: SamplingMetadata, *, all_greedy: bool, use_penalties: bool,
           use_top_k_top_p: bool, num_logprobs: int, max_top_k: int = 0, ranks: bool = False,
           raw_BV: jax.Array | None = None) -> SamplerOutput:
    """One token per row. Call inside jit with the flags static (see SamplingFlags). `raw_BV`: the model's
    logits when `logits_BV` went through logits processors first (logprobs are the raw ones)."""
    if logits_BV.shape[0] != meta.temperature_B.shape[0]:
        raise ValueError(f"logits_BV has {logits_BV.shape[0]} rows but the metadata has "
                         f"{meta.temperature_B.shape[0]}: pad both to the same batch bucket")
    logits_BV = logits_BV.astype(jnp.float32)
    raw_BV = logits_BV if raw_BV is None else raw_BV.astype(jnp.float32)
    if meta.bias_ids_BN is not None:
        logits_BV = apply_logit_bias(logits_BV, meta.bias_ids_BN, meta.bias_values_BN)
    logits_BV = apply_penalties(logits_BV, meta) if use_penalties else logits_BV
    logits_BV = apply_banned(logits_BV, meta.banned_BX)
    if meta.allowed_BW is not None:
        allowed_BV = unpack_allowed(meta.allowed_BW, logits_BV.shape[1])
        logits_BV = jnp.where(allowed_BV, logits_BV, -jnp.inf)
        raw_BV = jnp.where(meta.guided_B[:, None] & ~allowed_BV, -jnp.inf, raw_BV)  # (a guide's: see guided_B)
    # A row whose bans, mask and processors left no finite logit has nothing to sample: NO_TOKEN, which
    # the engine turns into that request's "error" (an argmax over all -inf would say token 0 silently).
    # (Read at the argmax, which is -inf only when every logit is: no second pass over the vocabulary.)
    token_ids_B = jnp.argmax(logits_BV, axis=-1).astype(jnp.int32)
    stuck_B = jnp.take_along_axis(logits_BV, token_ids_B[:, None], axis=-1)[:, 0] == -jnp.inf
    if not all_greedy:
        # Relative to the row's best logit: a huge logit_bias (1e9) would make float32's step there dwarf the
        # noise (argmax then took the lowest of the biased ids every time); the shift changes no winner.
        best_B1 = jnp.take_along_axis(logits_BV, token_ids_B[:, None], axis=-1)
        logits_BV = warp(logits_BV - jnp.where(stuck_B[:, None], 0.0, best_B1), meta, use_top_k_top_p, max_top_k)
        noisy_BV = logits_BV + _gumbel_BV(meta.seeds_B, meta.steps_B, logits_BV.shape[-1])
        sampled_B = jnp.argmax(noisy_BV, axis=-1).astype(jnp.int32)
        token_ids_B = jnp.where(meta.temperature_B > 0, sampled_B, token_ids_B)
    token_ids_B = jnp.where(stuck_B, NO_TOKEN, token_ids_B)
    return _logprob_outputs(raw_BV, token_ids_B, num_logprobs, ranks)


# ---------------------------------------------------------------- host side

@dataclasses.dataclass
class SamplingRow:
    """One running request as the sampler sees it. `step` defaults to len(output_ids). `allowed_W`: a
    packed mask of the ids it may sample (uint32 [W]; None: any)."""
    params: SamplingParams
    seed: int
    prompt_ids: Sequence[int] = ()
    output_ids: Sequence[int] = ()
    banned_ids: Sequence[int] = ()
    step: int | None = None
    allowed_W: np.ndarray | None = None
    guided: bool = False  # allowed_W is a guide's (its logprobs are over the allowed tokens)


_MASK64 = (1 << 64) - 1


def seed32(seed: int) -> int:
    """A request's seed as the sampler's uint32 key seed. Seeds in [0, 2**32) are themselves (their outputs stay
    what they were); any other int (vLLM takes int64) is mixed down from all its bits (splitmix64's finalizer),
    so seed and seed + 2**32 draw differently instead of wrapping to the same tokens."""
    if 0 <= seed < 1 << 32:
        return seed
    x = seed & _MASK64
    x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
    x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & _MASK64
    return (x ^ (x >> 31)) & 0xFFFFFFFF


def _bucket(n: int) -> int:
    """Next power of two >= max(n, 1): bounds the number of distinct shapes (compilations)."""
    return 1 << max(n - 1, 0).bit_length()


def _pad_ids(seqs: list[Sequence[int]], B: int, width: int) -> np.ndarray:
    out_BW = np.full((B, width), -1, np.int32)
    for b, ids in enumerate(seqs):
        out_BW[b, :len(ids)] = ids
    return out_BW


def sampling_flags(rows: Sequence[SamplingRow], max_top_k_limit: int = 1024) -> SamplingFlags:
    sampling = [r.params for r in rows if not r.params.is_greedy]
    most_logprobs = max((r.params.logprobs or 0 for r in rows), default=0)
    top_ks = [p.top_k for p in sampling]
    bounded = bool(top_ks) and min(top_ks) >= 1 and max(top_ks) <= max_top_k_limit
    return SamplingFlags(
        all_greedy=not sampling,
        use_penalties=any(r.params.uses_penalties for r in rows),
        use_top_k_top_p=any(p.top_k > 0 or p.top_p < 1.0 for p in sampling),
        num_logprobs=_bucket(most_logprobs) if most_logprobs else 0,
        max_top_k=_bucket(max(top_ks)) if bounded else 0,
        ranks=any(r.params.logprobs is not None for r in rows))


def build_sampling_metadata(rows: Sequence[SamplingRow], pad_to: int
                            ) -> tuple[SamplingMetadata, SamplingFlags]:
    """Numpy metadata for `rows` padded to `pad_to` rows, plus the static flags.
    Token arrays are only filled when some row uses penalties (else they are (B, 1) of -1)."""
    if pad_to < len(rows):
        raise ValueError(f"{pad_to=} must be >= the number of rows ({len(rows)})")
    flags, B = sampling_flags(rows), pad_to

    def column(fn, dtype, pad):
        return np.array([fn(r) for r in rows] + [pad] * (B - len(rows)), dtype)

    penalized = [r if r.params.uses_penalties else None for r in rows]
    prompts = [r.prompt_ids if r else () for r in penalized]
    outputs = [r.output_ids if r else () for r in penalized]
    L = _bucket(max(map(len, prompts + outputs), default=1))
    X = _bucket(max((len(r.banned_ids) for r in rows), default=1))
    bias_ids_BN, bias_values_BN = _logit_bias([r.params.logit_bias for r in rows], B)
    allowed_BW = _allowed_mask([r.allowed_W for r in rows], B)
    meta = SamplingMetadata(
        temperature_B=column(lambda r: 0.0 if r.params.is_greedy else r.params.temperature, np.float32, 0.0),
        top_k_B=column(lambda r: max(r.params.top_k, 0), np.int32, 0),
        # a top_p below float32's smallest normal would round to 0, which keeps no token: keep the top one
        top_p_B=column(lambda r: max(r.params.top_p, FLOAT32_TINY), np.float32, 1.0),
        min_p_B=column(lambda r: r.params.min_p, np.float32, 0.0),
        min_p_last_B=column(lambda r: r.params.min_p_after_top_p, np.bool_, False),
        repetition_penalty_B=column(lambda r: r.params.repetition_penalty, np.float32, 1.0),
        presence_penalty_B=column(lambda r: r.params.presence_penalty, np.float32, 0.0),
        frequency_penalty_B=column(lambda r: r.params.frequency_penalty, np.float32, 0.0),
        seeds_B=column(lambda r: r.seed & 0xFFFFFFFF, np.uint32, 0),
        steps_B=column(lambda r: len(r.output_ids) if r.step is None else r.step, np.int32, 0),
        prompt_tokens_BL=_pad_ids(prompts, B, L),
        output_tokens_BL=_pad_ids(outputs, B, L),
        banned_BX=_pad_ids([r.banned_ids for r in rows], B, X),
        allowed_BW=allowed_BW, guided_B=None if allowed_BW is None else column(lambda r: r.guided, np.bool_, False),
        bias_ids_BN=bias_ids_BN, bias_values_BN=bias_values_BN)
    return meta, flags


def _logit_bias(biases: list[dict[int, float] | None], B: int) -> tuple[np.ndarray | None, np.ndarray | None]:
    """The rows' logit_bias as ids (int32, -1 padded) and values (float32), both [B, N] with N a power of two
    (bounded compilations); (None, None) when no row has one."""
    if not any(biases):
        return None, None
    N = _bucket(max(len(bias or ()) for bias in biases))
    ids_BN, values_BN = np.full((B, N), -1, np.int32), np.zeros((B, N), np.float32)
    for b, bias in enumerate(biases):
        if bias:
            ids_BN[b, :len(bias)] = np.fromiter(bias.keys(), np.int32, len(bias))
            values_BN[b, :len(bias)] = np.fromiter(bias.values(), np.float32, len(bias))
    return ids_BN, values_BN


def _allowed_mask(masks: list[np.ndarray | None], B: int) -> np.ndarray | None:
    """The rows' packed masks as uint32 [B, W], all bits set for rows without one; None if no row has one."""
    given = [m for m in masks if m is not None]
    if not given:
        return None
    allowed_BW = np.full((B, len(given[0])), 0xFFFFFFFF, np.uint32)
    for b, mask_W in enumerate(masks):
        if mask_W is not None:
            allowed_BW[b] = mask_W
    return allowed_BW


def pack_token_ids(ids: Sequence[int], num_words: int) -> np.ndarray:
    """A packed mask (uint32 [W], W = num_words) with the bits of `ids` set."""
    ids = np.asarray(ids, np.int64)
    mask_W = np.zeros(num_words, np.uint32)
    np.bitwise_or.at(mask_W, ids >> 5, (np.uint32(1) << (ids & 31).astype(np.uint32)))
    return mask_W
