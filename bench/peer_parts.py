"""Where bench/peer.py's gap to PyTorch eager lies: each part of the Llama step timed alone, Zoo's
code against torch's (bench/torch_parts.py), one process per system, alternated over rounds.

    python bench/peer_parts.py --torch-python /tmp/torchpeer/bin/python --rounds 3 --out parts.json --md parts.md
    python bench/peer_parts.py --zoo-one tiny                      # Zoo's parts only, in this process

Parts, on bench/peer.py's `tiny` and `100m` shapes (float32, value and gradient where it says so):

- `matmul_mlp`, `matmul_head`: the forward matmul [batch*seq, hidden] x [hidden, mlp or vocab];
- `loss`: the LM head and cross-entropy, value and gradient wrt the hidden states and the head
  (Zoo: `zoo.loss.chunked_next_token_loss` with its defaults; torch: `x @ W.T` then `cross_entropy`);
- `attention`: the causal GQA core softmax(q k^T) v, gradient wrt q, k, v (Zoo: `attend` with
  `impl="auto"`, the blockwise kernel at these lengths; torch: `scaled_dot_product_attention`);
- `mlp`: SwiGLU, gradient wrt its weights and input (Zoo: `GatedMLP`; torch: `LlamaMLP`);
- `layer`: one whole decoder layer (norms, projections, RoPE, attention, MLP, residuals), gradient
  wrt its weights and input (Zoo: the model's `DecoderBlock`; torch: `LlamaDecoderLayer`);
- `optimizer`: global-norm clip 1.0 and AdamW over all of the model's parameters (Zoo:
  `zoo.train.update.whole_tree_update` with the default `optimizer` group, state donated, as the
  train step does;
  torch: `clip_grad_norm_` and `torch.optim.AdamW`).

Zoo runs under train.py's XLA defaults (`XlaConfig()`; LLVM optimisations on, as `cpu_fast_compile:
auto` picks for these models). Each number is the median of `--reps` calls after two untimed ones;
the ratio is Zoo / torch per round, median over rounds.
"""

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from bench.peer import CONFIGS, zoo_model  # noqa: E402

PARTS = ("matmul_mlp", "matmul_head", "loss", "attention", "mlp", "layer", "optimizer")


def part_flops(d: dict) -> dict:
    """Matmul FLOPs of each part, counted as bench/peer.py counts the step's (causal attention: half the keys)."""
    rows = d["batch"] * d["seq"]
    D, F, V, T = d["hidden"], d["mlp"], d["vocab"], d["seq"]
    N, K, H = d["heads"], d["kv_heads"], d["head_dim"]
    attention = 6 * rows * (T / 2) * N * 2 * H  # forward + backward of the score and context products
    mlp = 6 * rows * 3 * D * F
    projections = 6 * rows * D * (2 * N * H + 2 * K * H)
    return {
        "matmul_mlp": 2 * rows * D * F, "matmul_head": 2 * rows * D * V, "loss": 6 * rows * D * V,
        "attention": attention, "mlp": mlp, "layer": mlp + projections + attention, "optimizer": None,
    }


def timed(fn, reps: int) -> float:
    import jax

    for _ in range(2):
        jax.block_until_ready(fn())
    ts = []
    for _ in range(reps):
        t = time.perf_counter()
        jax.block_until_ready(fn())
        ts.append(time.perf_counter() - t)
    return statistics.median(ts)


def zoo_parts(config: str, reps: int) -> dict:
    from zoo.train.config import XlaConfig
    from zoo.train.run import apply_xla_flags

    apply_xla_flags(XlaConfig())  # as train.py: before JAX starts
    import equinox as eqx
    import jax
    import jax.numpy as jnp

    import zoo.model as zoo_model_module
    from zoo.loss import chunked_next_token_loss
    from zoo.nn.attention_kernels import attend
    from zoo.train.config import OptimizerConfig
    from zoo.train.step import make_optimizer, trainable_labels
    from zoo.train.update import whole_tree_update

    d = CONFIGS[config]
    B, T, D, F, V = d["batch"], d["seq"], d["hidden"], d["mlp"], d["vocab"]
    N, K, H = d["heads"], d["kv_heads"], d["head_dim"]
    keys = (jax.random.fold_in(jax.random.key(0), i) for i in range(10**6))
    out = {}

    x2 = jax.random.normal(next(keys), (B * T, D))
    w_mlp = jax.random.normal(next(keys), (D, F)) * D ** -0.5
    w_head = jax.random.normal(next(keys), (D, V)) * D ** -0.5
    matmul = jax.jit(lambda x, w: x @ w)
    out["matmul_mlp"] = timed(lambda: matmul(x2, w_mlp), reps)
    out["matmul_head"] = timed(lambda: matmul(x2, w_head), reps)

    hidden = x2.reshape(B, T, D)
    tokens = jax.random.randint(next(keys), (B, T), 0, V)
    loss = jax.jit(jax.value_and_grad(lambda h, w: chunked_next_token_loss(h, w, tokens), argnums=(0, 1)))
    out["loss"] = timed(lambda: loss(hidden, w_head), reps)

    q = jax.random.normal(next(keys), (B, T, N, H))
    k = jax.random.normal(next(keys), (B, T, K, H))
    v = jax.random.normal(next(keys), (B, T, K, H))
    attention = jax.jit(jax.grad(lambda q, k, v: attend(q, k, v, scale=H ** -0.5, causal=True).sum(), argnums=(0, 1, 2)))
    out["attention"] = timed(lambda: attention(q, k, v), reps)

    model = zoo_model_module.CausalLM(zoo_model(d), key=next(keys))
    stacked, static = eqx.partition(model.stacks[0].layers, eqx.is_array)
    block = eqx.combine(jax.tree.map(lambda a: a[0], stacked[0]), static[0])
    x3 = hidden
    positions = jnp.arange(T)

    def grad_of_sum(f):
        return eqx.filter_jit(lambda m, x: eqx.filter_grad(lambda mx: f(*mx).sum())((m, x)))

    mlp = grad_of_sum(lambda m, x: m(x))
    out["mlp"] = timed(lambda: mlp(block.ffn, x3), reps)
    layer = grad_of_sum(lambda m, x: m(x, positions)[0])
    out["layer"] = timed(lambda: layer(block, x3), reps)

    params = eqx.filter(model, eqx.is_array)
    c = OptimizerConfig()
    tx, _ = make_optimizer(c, 100, clip=False)  # clipped by whole_tree_update, as the train step does
    grads = jax.tree.map(lambda p: jax.random.normal(next(keys), p.shape, p.dtype) * 1e-2, params)

    def update(p, s, g):  # the gradient is an argument: as a constant, XLA would fold its norm at compile time
        trainable = jax.tree.map(lambda x, lab: x if lab == "train" else None, g, trainable_labels(g))
        return whole_tree_update(tx, g, s, p, trainable=trainable, max_norm=c.grad_clip)[:2]

    update = jax.jit(update, donate_argnums=(0, 1))
    state = [jax.tree.map(jnp.copy, params), tx.init(params)]

    def step():
        state[:] = update(*state, grads)
        return state

    out["optimizer"] = timed(step, reps)
    return {"system": "zoo", "config": config, "seconds": out, "jax": jax.__version__}


def _run(cmd: list, env=None) -> dict:
    with tempfile.NamedTemporaryFile(suffix=".json", delete=False) as f:
        path = f.name
    p = subprocess.run(cmd + ["--json", path], cwd=ROOT, capture_output=True, text=True, env=env)
    if p.returncode != 0:
        raise SystemExit(f"error: {' '.join(cmd)} failed ({p.returncode}):\n{p.stdout[-2000:]}\n{p.stderr[-3000:]}")
    rec = json.loads(Path(path).read_text())
    Path(path).unlink()
    return rec


def table(config: str, zoo: list, torch: list) -> str:
    flops = part_flops(CONFIGS[config])
    lines = [
        f"**`{config}`** (medians over {len(zoo)} rounds)",
        "",
        "| part | Zoo | torch eager | Zoo / torch | per round | Zoo GFLOP/s | torch GFLOP/s |",
        "|---|---:|---:|---:|---|---:|---:|",
    ]
    for part in PARTS:
        z = [r["seconds"][part] for r in zoo]
        t = [r["seconds"][part] for r in torch]
        ratios = [a / b for a, b in zip(z, t)]
        zm, tm = statistics.median(z), statistics.median(t)
        rate = (lambda s: f"{flops[part] / s / 1e9:.0f}") if flops[part] else (lambda s: "")
        lines.append(
            f"| `{part}` | {zm * 1e3:.1f} ms | {tm * 1e3:.1f} ms | **{statistics.median(ratios):.2f}** | "
            f"{', '.join(f'{x:.2f}' for x in ratios)} | {rate(zm)} | {rate(tm)} |"
        )
    return "\n".join(lines)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--zoo-one", metavar="CONFIG", help="time Zoo's parts of one config in this process")
    ap.add_argument("--json", default=None, help="(with --zoo-one) write the record here")
    ap.add_argument("--torch-python", default=None, help="python of an environment with torch and transformers")
    ap.add_argument("--configs", default="tiny,100m")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--reps", type=int, default=9)
    ap.add_argument("--out", default=None, help="JSON results")
    ap.add_argument("--md", default=None, help="the markdown tables")
    a = ap.parse_args(argv)
    if a.zoo_one:
        from zoo.train.huge_pages import reexec_with_huge_pages

        reexec_with_huge_pages()  # as train.py: the process Zoo's runs start in
        if a.zoo_one not in CONFIGS:
            print(f"error: --zoo-one: unknown config {a.zoo_one!r}; choose one of {', '.join(CONFIGS)}", file=sys.stderr)
            return 2
        rec = zoo_parts(a.zoo_one, a.reps)
        print(json.dumps(rec))
        if a.json:
            Path(a.json).write_text(json.dumps(rec))
        return 0
    if not a.torch_python or not Path(a.torch_python).exists():
        print("error: --torch-python: give the python of an environment with torch and transformers; "
              "python3 -m venv /tmp/torchpeer && /tmp/torchpeer/bin/pip install torch==2.13.0 transformers==5.24.0", file=sys.stderr)
        return 2
    configs = a.configs.split(",")
    for c in configs:
        if c not in CONFIGS:
            print(f"error: --configs: unknown config {c!r}; choose from {', '.join(CONFIGS)}", file=sys.stderr)
            return 2
    from zoo.train.huge_pages import child_environ

    envs = {"zoo": child_environ(), "torch": None}  # Zoo's processes start as train.py's do (zoo.train.huge_pages)
    raw = {c: {"zoo": [], "torch": []} for c in configs}
    for rnd in range(a.rounds):
        for c in configs:
            runs = [("zoo", [sys.executable, "bench/peer_parts.py", "--zoo-one", c, "--reps", str(a.reps)]),
                    ("torch", [a.torch_python, "bench/torch_parts.py", "--config", c, "--reps", str(a.reps)])]
            for name, cmd in runs if rnd % 2 == 0 else runs[::-1]:
                raw[c][name].append(_run(cmd, envs[name]))
                print(f"round {rnd + 1}/{a.rounds} {c} {name}: " + ", ".join(
                    f"{k} {v * 1e3:.1f} ms" for k, v in raw[c][name][-1]["seconds"].items()), file=sys.stderr, flush=True)
    md = "\n\n".join(table(c, raw[c]["zoo"], raw[c]["torch"]) for c in configs)
    print(md)
    if a.md:
        Path(a.md).write_text(md + "\n")
    if a.out:
        from bench.common import env_info, write_json

        write_json(a.out, {"schema": "zoo.bench.peer_parts/1", "env": env_info(), "rounds": a.rounds, "reps": a.reps, "raw": raw})
    return 0


if __name__ == "__main__":
    sys.exit(main())
