"""The sampler's allowed-token mask (guided decoding, allowed_token_ids): a packed bitmask that restricts
greedy and sampled rows alike, leaves unmasked rows of the same batch alone, and is absent (no extra input,
no extra work) when no row has one."""
import jax
import numpy as np

from lmjax.config import SamplingParams
from lmjax.layers.sampler import SamplingRow, build_sampling_metadata, pack_token_ids, sample

V = 70  # not a multiple of 32: the mask's last word is partly padding


def _sample(rows, logits_BV):
    meta, flags = build_sampling_metadata(rows, pad_to=4)
    return meta, np.asarray(jax.jit(sample, static_argnames=flags._fields)(logits_BV, meta, **flags._asdict())[0])


def test_pack_token_ids_sets_exactly_their_bits():
    mask_W = pack_token_ids([0, 31, 32, 69], 3)
    bits = np.unpackbits(mask_W.view(np.uint8), bitorder="little")
    assert mask_W.dtype == np.uint32 and np.flatnonzero(bits).tolist() == [0, 31, 32, 69]


def test_mask_restricts_greedy_and_sampled_rows_only_where_given():
    logits_BV = np.tile(np.arange(V, dtype=np.float32), (4, 1))  # argmax: the last id
    allowed = pack_token_ids([5, 40], 3)
    rows = [SamplingRow(SamplingParams(temperature=0), 0, allowed_W=allowed),
            SamplingRow(SamplingParams(temperature=1.0, seed=1), 1, allowed_W=allowed),
            SamplingRow(SamplingParams(temperature=0), 0)]
    meta, tokens = _sample(rows, logits_BV)
    assert meta.allowed_BW.shape == (4, 3) and (meta.allowed_BW[2:] == 0xFFFFFFFF).all()
    assert tokens[0] == 40 and tokens[1] in (5, 40) and tokens[2] == V - 1
    for seed in range(8):  # sampling never leaves the mask
        rows[1] = SamplingRow(SamplingParams(temperature=5.0), seed, allowed_W=allowed)
        assert _sample(rows, logits_BV)[1][1] in (5, 40)


def test_no_mask_when_no_row_has_one():
    meta, _ = build_sampling_metadata([SamplingRow(SamplingParams(temperature=0), 0)], pad_to=4)
    assert meta.allowed_BW is None and jax.tree.leaves(meta.allowed_BW) == []
