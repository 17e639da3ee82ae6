"""In-process A/B of hot-path variants of bench/peer.py's Zoo step (docs/benchmarks.md, "Hot-path variants").

    python bench/ab_variants.py CONFIG ROUNDS VARIANT [VARIANT ...]
    python bench/ab_variants.py tiny 3 base wt plaindense chunk0 attnxla
    python bench/ab_variants.py 100m 3 base attnxla rematfull rematfull+attnxla

CONFIG is bench/peer.py's `tiny` or `100m`, optionally with `:key=value` changes (`100m:batch=1` is
bench/cpu.py's Llama: llama_100m's shape, batch 1 x 512). A variant is `+`-joined parts: `base` (the code as it is),
`wt` (the loss's logits gradient against the head transposed once), `plaindense` (the MLP's matmuls as one
einsum over the [batch, seq] axes, the code before `zoo.nn.mlp.dense` merged them into one row axis), `tnmlp` (the MLP's weight gradients as `[in, rows] x [rows, out]` products over a transposed copy of
the activations, so that XLA:CPU hands them to YNNPACK instead of its own transposed-operand dot),
`plainglu` (the gated MLP's activation with JAX's own derivative instead of `zoo.nn.mlp.gated`'s),
`reshape2` (GatedMLP reshaping its input once per projection, so the backward keeps two copies),
`einsumhead` (the LM head's weight gradient in the fused loss as the plain einsum: the code before
`zoo.loss.head_gradient`), `chunk<N>` (trainer.loss_chunk_size=N),
`attn<impl>` (model.attention_impl), `blk<N>` (the blockwise attention's tiles N x N instead of 256 x 256),
`unroll` (the layer stack's `lax.scan` fully unrolled), `loop` (no scan: the layers in a Python loop over static
slices of the stacked weights; `none` only, as it checkpoints without prevent_cse), `remat<preset>` (the offload preset). Each variant patches the functions before its own trace and compile (LLVM
optimisations on); then the variants' steps alternate (order reversed every round) from copies of their
own initial state; prints each one's median step and its per-round ratio to the first variant.
"""
import dataclasses
import json
import os
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from bench import common as C  # noqa: E402
from bench.peer import CONFIGS, zoo_train_config  # noqa: E402

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402

import zoo.loss as L  # noqa: E402
import zoo.nn.mlp as M  # noqa: E402
import zoo.nn.attention_kernels as AK  # noqa: E402
from zoo.offload import preset_names  # noqa: E402

if len(sys.argv) < 4 or not sys.argv[2].isdigit():
    print("usage: python bench/ab_variants.py CONFIG ROUNDS VARIANT [VARIANT ...]  (the module docstring says more)", file=sys.stderr)
    raise SystemExit(2)
cfgname, rounds, variants = sys.argv[1], int(sys.argv[2]), sys.argv[3:]
orig_grads, orig_dense, orig_head = L._fused_loss_and_grads, M.dense, L.head_gradient
orig_gated, orig_mlp_call = M.gated, M.GatedMLP.__call__

def grads_wt(softcap, cdt, head, h, targets, weights):
    # d_h against the head transposed once per step
    w = head.astype(cdt); vocab = head.shape[1]
    wt = jax.lax.optimization_barrier(w.T)
    def step(carry, xs):
        total, d_head = carry
        h_c, t_c, w_c = xs
        h_c = h_c.astype(cdt)
        logits, d_cap = L._logits(h_c, w, softcap)
        nll, lse = L._nll(logits, t_c)
        d_logits = jnp.exp(logits - lse[:, None]) - (jnp.arange(vocab)[None, :] == t_c[:, None])
        d_logits = d_logits * w_c[:, None]
        if d_cap is not None: d_logits = d_logits * d_cap
        d_logits = d_logits.astype(cdt)
        d_h = jnp.einsum("CV,VD->CD", d_logits, wt, preferred_element_type=jnp.float32)
        d_head = d_head + jnp.einsum("CD,CV->DV", h_c, d_logits, preferred_element_type=jnp.float32)
        return (total + (nll * w_c).sum(), d_head), d_h.astype(h.dtype)
    init = (jnp.float32(0), jnp.zeros(head.shape, jnp.float32))
    (total, d_head), d_h = jax.lax.scan(step, init, (h, targets, weights))
    return total, d_h, d_head

def mlp_reshape_each(self, x):  # GatedMLP before it reshaped its input once for both projections
    cdt = self.compute_dtype
    gate = ZT.tag(M.dense(x, self.w_gate.astype(cdt)), ZT.MLPWI_0)
    up = ZT.tag(M.dense(x, self.w_up.astype(cdt)), ZT.MLPWI_1)
    return ZT.tag(M.dense(M.gated(M.ACTIVATIONS[self.activation], gate, up), self.w_down.astype(cdt)), ZT.MLPWO)

def gated_plain(fn, gate, up): return fn(gate, up)  # JAX's own derivative, five saved tensors

def dense_plain(x, w): return jnp.einsum("...D,DF->...F", x, w)


@jax.custom_vjp
def _rows_matmul_tn(rows, w):
    return jnp.einsum("CD,DF->CF", rows, w)

def _tn_fwd(rows, w):
    return _rows_matmul_tn(rows, w), (rows, w)

def _tn_bwd(res, g):
    rows, w = res
    # the weight gradient as a [D, C] x [C, F] product over a transposed copy of the rows
    return jnp.einsum("CF,DF->CD", g, w), jax.lax.optimization_barrier(rows.T) @ g

_rows_matmul_tn.defvjp(_tn_fwd, _tn_bwd)

def dense_tn(x, w):
    rows = jnp.reshape(x, (-1, x.shape[-1]))
    return _rows_matmul_tn(rows, w).reshape(*x.shape[:-1], w.shape[-1])

_orig_scan = jax.lax.scan

def scan_unrolled_layers(f, init, xs=None, length=None, **kw):
    # the layer stack's scan unrolled (one straight-line program); other scans as they are
    if "Stack.__call__" in getattr(f, "__qualname__", ""):
        kw["unroll"] = True
    return _orig_scan(f, init, xs, length, **kw)

import equinox as eqx  # noqa: E402
import zoo.model as ZM  # noqa: E402
from zoo import tags as ZT  # noqa: E402
import zoo.sharding as ZS  # noqa: E402

_orig_stack_call = ZM.Stack.__call__

def stack_loop(self, x, positions, segment_ids=None, *, wrap_layer=None):
    # the layers in a Python loop over static slices of the stacked weights (no lax.scan)
    params, static = eqx.partition(self.layers, eqx.is_array)

    def run_block(h, block_params, j):
        with ZT.layer_scope() as kept:
            out = self._block(block_params, static, j)(h, positions, segment_ids)
        return out, kept

    if wrap_layer is not None:
        run_block = wrap_layer(run_block)
    auxes = [[] for _ in range(self.period)]
    for r in range(self.repeats):
        for j in range(self.period):
            (x, aux), _ = run_block(ZS.constrain(x, ZS.ACTIVATION_AXES), jax.tree.map(lambda a: a[r], params[j]), j)
            auxes[j].append(aux)
    stacked = tuple(None if a[0] is None else jax.tree.map(lambda *xs: jnp.stack(xs), *a) for a in auxes)
    return ZS.constrain(x, ZS.ACTIVATION_AXES), stacked

def head_einsum(h, d_logits):
    return jnp.einsum("CD,CV->DV", h, d_logits, preferred_element_type=jnp.float32)


def fail(message: str):
    print(f"error: {message}", file=sys.stderr)
    raise SystemExit(2)


PARTS = ("base", "wt", "plaindense", "tnmlp", "einsumhead", "unroll", "loop", "plainglu", "reshape2")
PREFIXES = ("blk", "chunk", "attn", "remat")  # followed by a number or a name
name, *changes = cfgname.split(":")  # e.g. 100m:batch=1 (bench/cpu.py's Llama shape)
if name not in CONFIGS:
    fail(f"CONFIG: unknown {name!r}; choose one of {', '.join(CONFIGS)}, optionally with :key=value")
d = dict(CONFIGS[name])
for change in changes:
    key, _, value = change.partition("=")
    if key not in d or not value.isdigit():
        fail(f"CONFIG: {change!r} is not key=integer for a key of {', '.join(d)}")
    d[key] = int(value)
for v in variants:
    for part in v.split("+"):
        prefix = next((p for p in PREFIXES if part.startswith(p)), None)
        arg = part[len(prefix):] if prefix else ""
        ok = {"blk": arg.isdigit(), "chunk": arg.isdigit(), "attn": arg in AK.IMPLS, "remat": arg in preset_names()}
        if part not in PARTS and not ok.get(prefix, False):
            fail(f"variant {v!r}: unknown part {part!r}; parts: {', '.join(PARTS)}, blk<N>, chunk<N>, attn<impl>, remat<preset>")
exes, tr0, trs = {}, None, {}
for v in variants:
    L._fused_loss_and_grads, M.dense, L.head_gradient = orig_grads, orig_dense, orig_head
    M.gated, M.GatedMLP.__call__ = orig_gated, orig_mlp_call
    jax.lax.scan = _orig_scan
    AK.attend.__kwdefaults__.update(block_q=AK.DEFAULT_BLOCK_Q, block_k=AK.DEFAULT_BLOCK_K)
    chunk, attn, remat = 512, "auto", "none"
    for part in v.split("+"):
        if part == "wt": L._fused_loss_and_grads = grads_wt
        elif part == "plaindense": M.dense = dense_plain
        elif part == "tnmlp": M.dense = dense_tn
        elif part == "einsumhead": L.head_gradient = head_einsum
        elif part == "plainglu": M.gated = gated_plain
        elif part == "reshape2": M.GatedMLP.__call__ = mlp_reshape_each
        elif part == "unroll": jax.lax.scan = scan_unrolled_layers
        elif part == "loop": ZM.Stack.__call__ = stack_loop
        elif part.startswith("blk"): AK.attend.__kwdefaults__.update(block_q=int(part[3:]), block_k=int(part[3:]))
        elif part.startswith("chunk"): chunk = int(part[5:])
        elif part.startswith("attn"): attn = part[4:]
        elif part.startswith("remat"): remat = part[5:]
    c = zoo_train_config(d, remat, cpu_fast_compile=False)
    c = dataclasses.replace(c, trainer=dataclasses.replace(c.trainer, loss_chunk_size=chunk), model=c.model.replace(attention_impl=attn))
    tr = C.make_trainer(c)
    t = time.perf_counter(); exes[v] = tr.compile(); dt = time.perf_counter() - t
    mem = C.compiled_memory(exes[v]) or {}
    print(v, "compile", round(dt, 1), "s, temp", round(mem.get("temp_size_in_bytes", 0) / 1e6, 1), "MB", flush=True)
    jax.lax.scan = _orig_scan
    ZM.Stack.__call__ = _orig_stack_call
    tr0 = tr0 or tr
    trs[v] = tr
L._fused_loss_and_grads, M.dense, L.head_gradient = orig_grads, orig_dense, orig_head
M.gated, M.GatedMLP.__call__ = orig_gated, orig_mlp_call
states = {v: trs[v].init() for v in variants}; tokens = C.tokens_for(tr0)
times = {v: [] for v in variants}; loss = {}
for r in range(rounds + 1):
    order = variants if r % 2 == 0 else variants[::-1]
    for v in order:
        s = jax.tree.map(lambda x: x.copy(), states[v])
        t = time.perf_counter(); s2, m = exes[v](s, tokens); jax.block_until_ready((s2, m)); dt = time.perf_counter() - t
        loss[v] = (float(m["loss"]), float(m.get("grad_norm", m.get("gnorm", 0))))
        if r: times[v].append(dt)
base = variants[0]
for v in variants:
    ratios = [a / b for a, b in zip(times[v], times[base])]
    print(json.dumps(dict(variant=v, median_ms=round(statistics.median(times[v]) * 1e3), ratio_to_first=round(statistics.median(ratios), 3), ratios=[round(x, 3) for x in ratios], loss=loss[v])), flush=True)
