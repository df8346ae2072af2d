"""Ragged paged attention's Mosaic GPU (Hopper: wgmma + TMA) kernel for prefill chunks.

Shape letters and semantics: pallas_kernels/ragged_paged_attention.py; here also
  G  tiles of 2W query rows (static bound)     W  rows a compute warpgroup owns (64, wgmma's M)
  E  keys of a kv step (block_kv)               F  the six per-tile scalars (see `prefill_tiles`)

Why a second kernel: the Triton-backend kernel streams the cache for decode at ~91% of copy bandwidth,
but tops out near 25% of the bf16 matmul rate on prefill chunks (no warp specialisation, no TMA, K/V
rows gathered one by one). This one follows the FlashAttention-3 layout on Hopper: each CTA runs two
compute warpgroups (64 query rows of one q head each, wgmma from shared memory) and one memory
warpgroup that streams K/V pages with TMA bulk copies into a ring of `max_steps` shared-memory stages.
Pages make that cheap: a kv step of E keys is one [E, H] box of one page (E divides the block size S)
or E / S whole pages, found through the block table by the memory warpgroup.

Data flow of one call:
  1. `prefill_tiles` (XLA, a few tiny ops; ragged_paged_prefill_tiles.py): the static grid's G tiles
     of 2W query rows -> for each, (sequence, first q row, first and end valid row in the tile,
     position of row 0, live tiles) in an int32 [6, G] array. A tile starts on a multiple of 8 rows (TMA reads 8-row tiles of q), so its first
     rows may belong to the sequence before. Only sequences with q_len >= min_q_len get tiles (decode
     rows are the Triton kernel's job); spare tiles idle.
  2. The kernel: a CTA per (tile, head) item, the longest items first and the heads of one tile side by
     side (they share K/V pages in L2); optionally fewer, persistent CTAs that loop over items
     (`PrefillConfig.num_ctas`; the K/V ring then runs on across items). Compute warpgroup w attends rows
     [w W, (w + 1) W) of the tile over keys [0, its last valid row's position], unmasked steps first, then
     the causal diagonal; the memory warpgroup keeps up to `max_steps` K/V steps in flight. Valid rows
     go back by TMA in power-of-two pieces (a ragged tile has no fixed row count; one descriptor per
     piece size).
  3. Rows of sequences without tiles are left unwritten: the caller merges (ragged_paged_attention).

Preconditions beyond the op's contract (checked where static, else documented): bf16 or f16; head dim a
multiple of 64; block size a multiple of 64; a token count that is a multiple of 8; no sliding window;
cache slots a sequence does not own hold finite values (a TMA step reads whole pages and masks scores, and 0 * NaN in the P @ V product is NaN:
the engine's cache is zero-initialised and written only with K/V, so it never holds NaN).

In Pallas GPU interpret mode (CPU tests) the two products are jnp dots of the same shared-memory tiles
(the interpreter's wgmma takes neither a transposed nor a register operand) and register layouts are
dropped; the pipeline, its barriers, the page walk, the masks and the ragged stores are the same code.
"""
from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl

from pallas_kernels._validate import require
from pallas_kernels.ragged_paged_prefill_tiles import (  # noqa: F401 - re-exported for callers
    MGPU_DTYPES,
    ROWS_PER_WG,
    PrefillConfig,
    mgpu_supported,
    num_prefill_tiles,
    plgpu,
    prefill_tiles,
)

_LOG2E = 1.4426950408889634

# --------------------------------------------------------------------------
# Kernel
# --------------------------------------------------------------------------
def _row_layout():
    """Layout of a per-row vector of a wgmma accumulator: its own name in newer jax, a reduction of
    the accumulator's layout in jax 0.10."""
    row = getattr(plgpu.Layout, "WGMMA_ROW", None)
    return row if row is not None else plgpu.Layout.WGMMA.reduce(1)


# The interpreter has no register layouts: there the casts and the iota are plain jnp.
def _cast(x, layout, interpret):
    return x if interpret else plgpu.layout_cast(x, layout)


def _qk(q_smem_WH, k_smem_EH, after_issue, interpret):
    """Scores q @ k.T in f32 (wgmma from shared memory; `after_issue` runs while it computes)."""
    if interpret:  # the interpreter's wgmma takes no transposed operand
        after_issue()
        return jax.lax.dot_general(q_smem_WH[...], k_smem_EH[...], (((1,), (1,)), ((), ())),
                                   preferred_element_type=jnp.float32)

    def scores(acc_ref):
        plgpu.wgmma(acc_ref, q_smem_WH, plgpu.transpose_ref(k_smem_EH, (1, 0)))
        after_issue()
        return acc_ref[...]

    return pl.run_scoped(scores, plgpu.ACC((q_smem_WH.shape[0], k_smem_EH.shape[0]), jnp.float32))


def _pv_accumulate(acc_WH, p_WE, v_smem_EH, interpret):
    """acc + p @ v, accumulated in place by wgmma (p from registers)."""
    if interpret:  # the interpreter's wgmma takes no register operand, nor has it pl.run_state
        return acc_WH + jnp.dot(p_WE, v_smem_EH[...], preferred_element_type=jnp.float32)
    return pl.run_state(lambda acc_ref: plgpu.wgmma(acc_ref, p_WE, v_smem_EH))(plgpu.ACC.init(acc_WH))


def _iota(shape, axis, interpret):
    if interpret:
        return lax.broadcasted_iota(jnp.int32, shape, axis)
    return plgpu.broadcasted_iota(jnp.int32, shape, axis, layout=plgpu.Layout.WGMMA)


def _store_rows(o_smem_WH, o_ref_TNH, lo, rows, row0, head):
    """TMA-store rows [lo, lo + rows) (dynamic; rows <= W) of o_smem to o_ref[row0 + lo + i, head]: one
    piece per set bit of `rows`, largest first, since a descriptor's box size is static."""
    done = lo
    size = ROWS_PER_WG
    while size >= 1:
        piece = rows & size

        @pl.when(piece != 0)
        def _store(done=done, size=size):
            plgpu.copy_smem_to_gmem(o_smem_WH.at[pl.ds(done, size)],
                                    o_ref_TNH.at[pl.ds(row0 + done, size), head])

        done = done + piece
        size //= 2
    plgpu.wait_smem_to_gmem(0, wait_read_only=True)


def _compute_wg(refs, tile, base, *, head, wg, block_kv, max_steps, schedule_barrier, scale_log2,
                interpret):
    """One compute warpgroup on one item: W query rows of one head against the causal keys of its
    sequence. `base` counts the kv steps of this CTA's earlier items (ring stage = global step mod)."""
    q_ref, o_ref, q_smem, o_smem, k_smem, v_smem, bars = refs
    k_ready, v_ready, q_ready, k_free, v_free, sched = bars
    _, row0, tile_lo, tile_hi, pos0, cta_steps = tile
    lo = jnp.clip(tile_lo - wg * ROWS_PER_WG, 0, ROWS_PER_WG)  # this warpgroup's valid rows [lo, hi)
    hi = jnp.clip(tile_hi - wg * ROWS_PER_WG, lo, ROWS_PER_WG)
    rows = hi - lo
    first_pos = pos0 + wg * ROWS_PER_WG  # position of row 0 (rows before lo: another sequence's)
    my_steps = jnp.where(rows > 0, lax.div(first_pos + hi - 1, block_kv) + 1, 0)
    # Steps every valid row sees whole (the first valid row's position is >= 0).
    full_steps = jnp.minimum(lax.div(first_pos + lo + 1, block_kv), my_steps)
    dtype = q_smem.dtype
    head_dim = q_smem.shape[-1]
    q_smem = q_smem.at[wg]
    o_smem = o_smem.at[wg]

    def sync_schedule():
        if schedule_barrier:
            plgpu.barrier_arrive(sched)
            plgpu.barrier_wait(sched)

    @pl.when(rows > 0)
    def _load_q():
        plgpu.copy_gmem_to_smem(q_ref.at[pl.ds(row0 + wg * ROWS_PER_WG, ROWS_PER_WG), head],
                                q_smem, q_ready.at[wg])
        plgpu.barrier_wait(q_ready.at[wg])

    if schedule_barrier:
        pl.when(wg == 1)(sync_schedule)

    def step(kv_step, carry, *, masked):
        acc_WH, max_W, sum_W = carry
        slot = lax.rem(base + kv_step, max_steps)
        plgpu.barrier_wait(k_ready.at[slot])

        s_WE = _qk(q_smem, k_smem.at[slot], sync_schedule, interpret)
        plgpu.barrier_arrive(k_free.at[slot])
        if masked:
            r_WE = _iota(s_WE.shape, 0, interpret)
            c_WE = _iota(s_WE.shape, 1, interpret)
            s_WE = jnp.where(first_pos + r_WE >= kv_step * block_kv + c_WE, s_WE, -jnp.inf)
        # The running max is kept scaled by log2(e) * sm_scale, so p is one FMA and an exp2.
        new_max_W = jnp.maximum(max_W, s_WE.max(axis=1) * scale_log2)
        alpha_W = jnp.exp2(max_W - new_max_W)
        p_WE = jnp.exp2(s_WE * scale_log2 - lax.broadcast_in_dim(new_max_W, s_WE.shape, [0]))
        acc_WH = acc_WH * lax.broadcast_in_dim(alpha_W, acc_WH.shape, [0])
        sum_W = sum_W * alpha_W + p_WE.sum(axis=1)
        p16_WE = p_WE.astype(dtype)
        acc_WH, sum_W, new_max_W, p16_WE = lax.optimization_barrier((acc_WH, sum_W, new_max_W, p16_WE))
        if schedule_barrier:
            plgpu.barrier_arrive(sched)
        plgpu.barrier_wait(v_ready.at[slot])
        if schedule_barrier:
            plgpu.barrier_wait(sched)
        acc_WH = _pv_accumulate(acc_WH, p16_WE, v_smem.at[slot], interpret)
        plgpu.barrier_arrive(v_free.at[slot])
        return acc_WH, new_max_W, sum_W

    def drain(kv_step, _):
        """A step this warpgroup does not attend (its rows end earlier): free the stage, keep the beat.
        It still waits for the stage's copies: every barrier phase is observed by every thread."""
        slot = lax.rem(base + kv_step, max_steps)
        plgpu.barrier_wait(k_ready.at[slot])
        plgpu.barrier_wait(v_ready.at[slot])
        plgpu.barrier_arrive(k_free.at[slot])
        plgpu.barrier_arrive(v_free.at[slot])
        sync_schedule()
        sync_schedule()

    acc_WH = _cast(jnp.zeros((ROWS_PER_WG, head_dim), jnp.float32), plgpu.Layout.WGMMA, interpret)
    max_W = _cast(jnp.full((ROWS_PER_WG,), -jnp.inf, jnp.float32), _row_layout(), interpret)
    sum_W = _cast(jnp.zeros((ROWS_PER_WG,), jnp.float32), _row_layout(), interpret)
    carry = (acc_WH, max_W, sum_W)
    carry = lax.fori_loop(0, full_steps, functools.partial(step, masked=False), carry)
    acc_WH, max_W, sum_W = lax.fori_loop(full_steps, my_steps, functools.partial(step, masked=True), carry)
    lax.fori_loop(my_steps, cta_steps, drain, None)
    if schedule_barrier:
        pl.when(wg == 0)(sync_schedule)

    @pl.when(rows > 0)
    def _write():
        safe_sum_W = jnp.where(sum_W > 0, sum_W, 1.0)
        o_smem[...] = (acc_WH / lax.broadcast_in_dim(safe_sum_W, acc_WH.shape, [0])).astype(o_smem.dtype)
        plgpu.commit_smem()
        _store_rows(o_smem, o_ref, lo, rows, row0 + wg * ROWS_PER_WG, head)


def _memory_wg(refs, tile, base, *, kv_head, block_kv, block_size, max_blocks, max_steps):
    """The producer on one item: TMA-copies each kv step's K and V into its ring stage, once the step
    that used the stage `max_steps` global steps earlier (maybe of an earlier item) has freed it."""
    k_ref, v_ref, tables_ref, k_smem, v_smem, bars = refs
    k_ready, v_ready, _, k_free, v_free, _ = bars
    seq, *_, cta_steps = tile
    rows_per_copy = min(block_kv, block_size)

    @pl.loop(0, cta_steps)
    def _issue(kv_step):
        """One copy per page the step spans (its barrier counts that many arrivals)."""
        slot = lax.rem(base + kv_step, max_steps)

        @pl.when(base + kv_step >= max_steps)
        def _wait_free():
            plgpu.barrier_wait(k_free.at[slot])
            plgpu.barrier_wait(v_free.at[slot])

        for i in range(block_kv // rows_per_copy):
            key0 = kv_step * block_kv + i * rows_per_copy
            page = tables_ref[seq, jnp.minimum(lax.div(key0, block_size), max_blocks - 1)]
            src = (page, pl.ds(lax.rem(key0, block_size), rows_per_copy), kv_head)
            dst = pl.ds(i * rows_per_copy, rows_per_copy)
            plgpu.copy_gmem_to_smem(k_ref.at[src], k_smem.at[slot, dst], k_ready.at[slot])
            plgpu.copy_gmem_to_smem(v_ref.at[src], v_smem.at[slot, dst], v_ready.at[slot])


def _last_frees(bars, total_steps, max_steps):
    """The memory warpgroup observes the ring's final phases before the barriers go away."""
    _, _, _, k_free, v_free, _ = bars

    @pl.loop(jnp.maximum(total_steps - max_steps, 0), total_steps)
    def _wait(step):
        slot = lax.rem(step, max_steps)
        plgpu.barrier_wait(k_free.at[slot])
        plgpu.barrier_wait(v_free.at[slot])


def _item(tiles_ref, item, live_tiles, *, num_heads, block_kv):
    """Work item (< live_tiles x N) -> (head, (sequence, first row, valid rows [lo, hi), row 0's position,
    kv steps)). Items run tile-major from the last live tile: each sequence's last tiles (most keys) first."""
    head, g = lax.rem(item, num_heads), live_tiles - 1 - lax.div(item, num_heads)
    seq, row0, lo, hi, pos0 = (tiles_ref[i, g] for i in range(5))
    steps = jnp.where(hi > lo, lax.div(pos0 + hi - 1, block_kv) + 1, 0)
    return head, (seq, row0, lo, hi, pos0, steps)


def _kernel(tiles_ref, tables_ref, q_ref, k_ref, v_ref, o_ref, *, group, block_kv, max_steps,
            schedule_barrier, scale_log2, interpret, num_ctas):
    num_heads = q_ref.shape[1]
    live_tiles = tiles_ref[5, 0]
    cta = lax.axis_index("ctas")
    # Items cta, cta + C, ... below the live ones (idle CTAs of the static grid exit at once).
    my_items = lax.div(jnp.maximum(live_tiles * num_heads - cta, 0) + num_ctas - 1, num_ctas)
    item = functools.partial(_item, tiles_ref, live_tiles=live_tiles, num_heads=num_heads, block_kv=block_kv)
    head_dim, dtype = q_ref.shape[-1], q_ref.dtype
    block_size, max_blocks = k_ref.shape[1], tables_ref.shape[1]
    swizzled = (plgpu.TilingTransform((8, 128 // dtype.itemsize)), plgpu.SwizzleTransform(128))
    copies = max(1, block_kv // block_size)  # TMA copies (pages) per kv step

    def body(q_smem, o_smem, k_smem, v_smem, *bars):
        wg = lax.axis_index("wg")

        @pl.when(wg < 2)
        def _compute():
            plgpu.set_max_registers(232, action="increase")

            def run(i, base):
                head, tile = item(cta + i * num_ctas)
                _compute_wg((q_ref, o_ref, q_smem, o_smem, k_smem, v_smem, bars), tile, base, head=head,
                            wg=wg, block_kv=block_kv, max_steps=max_steps, schedule_barrier=schedule_barrier,
                            scale_log2=scale_log2, interpret=interpret)
                return base + tile[-1]

            lax.fori_loop(0, my_items, run, jnp.int32(0))

        @pl.when(wg == 2)
        def _memory():
            plgpu.set_max_registers(40, action="decrease")

            def run(i, base):
                head, tile = item(cta + i * num_ctas)
                _memory_wg((k_ref, v_ref, tables_ref, k_smem, v_smem, bars), tile, base,
                           kv_head=lax.div(head, group), block_kv=block_kv, block_size=block_size,
                           max_blocks=max_blocks, max_steps=max_steps)
                return base + tile[-1]

            _last_frees(bars, lax.fori_loop(0, my_items, run, jnp.int32(0)), max_steps)

    pl.run_scoped(
        body,
        plgpu.SMEM((2, ROWS_PER_WG, head_dim), dtype, transforms=swizzled),
        plgpu.SMEM((2, ROWS_PER_WG, head_dim), dtype),  # plain rows: the store slices it anywhere
        plgpu.SMEM((max_steps, block_kv, head_dim), dtype, transforms=swizzled),
        plgpu.SMEM((max_steps, block_kv, head_dim), dtype, transforms=swizzled),
        plgpu.Barrier(num_arrivals=copies, num_barriers=max_steps),  # k_ready
        plgpu.Barrier(num_arrivals=copies, num_barriers=max_steps),  # v_ready
        plgpu.Barrier(num_barriers=2),  # q_ready
        plgpu.Barrier(num_arrivals=2, num_barriers=max_steps),  # k_free
        plgpu.Barrier(num_arrivals=2, num_barriers=max_steps),  # v_free
        plgpu.Barrier(num_arrivals=2),  # sched
        collective_axes="wg",
    )


def ragged_paged_prefill_mgpu(q_TNH, k_cache_PSKH, v_cache_PSKH, kv_lens_B, block_tables_BM, cu_q_lens_B1,
                              *, sm_scale: float, min_q_len: int = 2, config: PrefillConfig | None = None,
                              interpret: bool = False):
    """Attention rows of every sequence with q_len >= min_q_len; other rows are left unwritten.

    Call inside jit. interpret=True runs Pallas GPU interpret mode (CPU tests).
    """
    num_tokens, num_q_heads, head_dim = q_TNH.shape
    _, block_size, num_kv_heads, _ = k_cache_PSKH.shape
    require(mgpu_supported(q_TNH, k_cache_PSKH, None),
            f"the Mosaic GPU prefill kernel needs bf16/f16 (got {q_TNH.dtype}), head_dim % 64 == 0 "
            f"(got {head_dim}), block_size % 64 == 0 (got {block_size}) and num_tokens % 8 == 0 "
            f"(got {num_tokens})")
    config = config or PrefillConfig()
    require(block_size % config.block_kv == 0 or config.block_kv % block_size == 0,
            f"block_kv={config.block_kv} must divide or be a multiple of the cache's block_size={block_size}")
    num_tiles = num_prefill_tiles(num_tokens, kv_lens_B.shape[0], min_q_len)
    tiles_4G = prefill_tiles(kv_lens_B, cu_q_lens_B1, num_tiles=num_tiles, min_q_len=min_q_len)
    num_items = num_q_heads * num_tiles
    num_ctas = min(num_items, config.num_ctas or num_items)
    kernel = functools.partial(
        _kernel, group=num_q_heads // num_kv_heads, block_kv=config.block_kv, max_steps=config.max_steps,
        schedule_barrier=config.schedule_barrier, scale_log2=float(sm_scale) * _LOG2E, interpret=interpret,
        num_ctas=num_ctas)
    params = None
    if interpret:  # the interpreter has no TMA zero fill past the array's end: pad q with a tile
        from jax._src.pallas.mosaic_gpu.interpret.params import InterpretGPUParams
        params = InterpretGPUParams()
        q_TNH = jnp.pad(q_TNH, ((0, 2 * ROWS_PER_WG), (0, 0), (0, 0)))
    out_TNH = plgpu.kernel(
        kernel,
        out_type=jax.ShapeDtypeStruct(q_TNH.shape, q_TNH.dtype),
        grid=(num_ctas,),
        grid_names=("ctas",),
        num_threads=3,
        thread_name="wg",
        compiler_params=plgpu.CompilerParams(approx_math=True, lowering_semantics=plgpu.LoweringSemantics.Lane),
        interpret=params,
    )(tiles_4G, block_tables_BM, q_TNH, k_cache_PSKH, v_cache_PSKH)
    return out_TNH[:num_tokens]
