"""The MoE metrics a person reads: router entropy and correction-bias range per layer (against NumPy),
the progress line's imbalance warning, TensorBoard's token-share histograms, and `zoo.tools.report RUN_DIR`.

The NumPy references recompute from the model's own inputs (the MoE layer's input rebuilt from the
captured residual stream and attention output) in float64, independently of zoo.nn.moe's code.
"""

import dataclasses
import io
import json
import math
import os
import pathlib
import struct
import subprocess
import sys

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from omegaconf import OmegaConf

import zoo
from zoo.config import MoEConfig
from zoo.families import SIZES
from zoo.nn.moe import MoE, router_statistics
from zoo.offload import OffloadConfig
from zoo.train.run_config import ConfigError, DataConfig, HardwareConfig, OptimizerConfig, TrainConfig, TrainerConfig
from zoo.train.run_config import XlaConfig, load_group, validate
from zoo.train.metrics import Progress
from zoo.train.step import Trainer

ROOT = pathlib.Path(__file__).resolve().parents[1]
CONF = ROOT / "conf"
D = 16

ROUTER_CONFIGS = {
    "sigmoid_grouped": dict(router="sigmoid_grouped", n_group=4, topk_group=2),
    "softmax": dict(router="softmax", n_group=1, topk_group=1, norm_topk_prob=False),
    "topk_softmax": dict(router="topk_softmax", n_group=1, topk_group=1, router_bias=True),
}


def _moe(router: str, seed: int) -> MoE:
    c = MoEConfig(
        n_routed_experts=8,
        num_experts_per_tok=2,
        moe_intermediate_size=8,
        n_shared_experts=0,
        impl="ragged",
        **ROUTER_CONFIGS[router],
    )
    module = eqx.filter_eval_shape(lambda key: MoE(D, c, key=key), jax.random.key(0))
    rng = np.random.default_rng(seed)
    leaves, treedef = jax.tree_util.tree_flatten(module)
    # Router and biases at unit scale: the distributions are far from uniform, so a wrong formula shows.
    filled = [jnp.asarray(rng.normal(size=leaf.shape), leaf.dtype) for leaf in leaves]
    return jax.tree_util.tree_unflatten(treedef, filled)


def _entropy_numpy(logits: np.ndarray, router: str, bias) -> np.ndarray:
    """Per token, in float64: each router kind's probabilities over all experts
    (zoo.nn.moe.router_entropy's docstring)."""
    logits = np.asarray(logits, np.float64)
    if router == "sigmoid_grouped":
        p = 1 / (1 + np.exp(-logits))
        p = p / p.sum(-1, keepdims=True)
    else:
        if router == "topk_softmax":
            logits = logits + np.asarray(bias, np.float64)
        p = np.exp(logits - logits.max(-1, keepdims=True))
        p = p / p.sum(-1, keepdims=True)
    return -(p * np.log(p)).sum(-1)


@pytest.mark.parametrize("router", sorted(ROUTER_CONFIGS))
def test_router_entropy_matches_numpy(router):
    m = _moe(router, seed=1)
    x = jnp.asarray(np.random.default_rng(2).normal(size=(2, 12, D)), jnp.float32)
    _, aux = m(x)
    bias = m.router_bias if router == "topk_softmax" else None
    ref = _entropy_numpy(np.asarray(x).reshape(-1, D) @ np.asarray(m.router, np.float64), router, bias).mean()
    assert aux.router_entropy.dtype == jnp.float32
    np.testing.assert_allclose(float(aux.router_entropy), ref, rtol=1e-5)
    assert 0.1 < ref < math.log(8) - 0.05  # neither one-hot nor uniform: the check discriminates
    with router_statistics(False):
        assert float(m(x)[1].router_entropy) == 0.0


def test_router_entropy_keeps_nothing_for_the_backward_pass():
    """The entropy is a stop_gradient metric: what the backward pass holds is the same with it and without."""
    m = _moe("sigmoid_grouped", seed=3)
    x = jnp.asarray(np.random.default_rng(4).normal(size=(2, 16, D)), jnp.float32)

    def residual_bytes(enabled):
        with router_statistics(enabled):
            # The entropy is returned, so it cannot be dead code; the VJP's closure holds the residuals.
            (_, entropy), vjp = jax.vjp(lambda x: (lambda y, a: (y.sum(), a.router_entropy))(*m(x)), x)
        return sum(leaf.nbytes for leaf in jax.tree.leaves(vjp) if hasattr(leaf, "nbytes")), float(entropy)

    on, entropy = residual_bytes(True)
    off, zero = residual_bytes(False)
    assert entropy > 0 and zero == 0.0
    assert on == off


# --- the training step on a tiny model ------------------------------------------------------------


def _mesh_preset(name: str):
    node = OmegaConf.load(CONF / "mesh" / f"{name}.yaml")
    node.pop(
        "defaults", None
    )  # a preset is a delta on mesh/_defaults, MeshConfig's own defaults, where load_group starts
    return load_group("mesh", node)


def _config(mesh: str, **trainer) -> TrainConfig:
    m = SIZES["dsv3_tiny_a"]  # what model=dsv3_tiny_a composes (zoo.train.run_config registers every size)
    # The capacity kernel with room for every assignment: a sharded batch then routes exactly as one
    # program does, and it compiles faster than the dropless kernel's tile loops (the metrics are the router's).
    m = m.replace(moe=dataclasses.replace(m.moe, impl="capacity", capacity_factor=float(m.moe.n_routed_experts)))
    return TrainConfig(
        model=m,
        mesh=_mesh_preset(mesh),
        offload=OffloadConfig(),
        optimizer=OptimizerConfig(),
        data=DataConfig(batch_size=8, seq_len=16),
        xla=XlaConfig(),
        trainer=TrainerConfig(steps=1, **trainer),
        hardware=HardwareConfig(),
    )


def _with_random_biases(trainer: Trainer, state: dict, seed: int) -> dict:
    """Every MoE layer's correction bias drawn at random (each layer its own range)."""
    rng = np.random.default_rng(seed)
    params = state["params"]
    model = eqx.combine(params, trainer.static)
    for s, j, _ in model.moe_aux_order():
        old = params.stacks[s].layers[j].ffn.e_score_correction_bias
        new = jax.device_put(jnp.asarray(rng.normal(size=old.shape) * 0.1, jnp.float32), old.sharding)
        params = eqx.tree_at(lambda p, s=s, j=j: p.stacks[s].layers[j].ffn.e_score_correction_bias, params, new)
    return {**state, "params": params}


def _reference(model, tokens: np.ndarray) -> dict:
    """Per MoE layer in model order, from NumPy: router entropy (mean over tokens) and the bias's min/max."""
    c = model.config
    got = zoo.capture(model, jnp.asarray(tokens), tags=["decoder_layer_input", "out_proj"])
    x_in, attn = (np.asarray(got[t], np.float64) for t in ("decoder_layer_input", "out_proj"))  # [layers B T D]
    per_layer = {}
    for stack in model.stacks:
        for j, block in enumerate(stack.layers):
            for r in range(stack.repeats):
                i = stack.layer_index(r, j)
                if not c.is_moe_layer(i):
                    continue
                x = x_in[i] + attn[i]  # the residual stream entering the feed-forward (no sandwich norms here)
                h = (
                    x
                    / np.sqrt((x * x).mean(-1, keepdims=True) + block.ffn_norm.eps)
                    * np.asarray(block.ffn_norm.weight[r], np.float64)
                )
                logits = h.reshape(-1, h.shape[-1]) @ np.asarray(block.ffn.router[r], np.float64)
                bias = np.asarray(block.ffn.e_score_correction_bias[r])
                per_layer[i] = (_entropy_numpy(logits, "sigmoid_grouped", None).mean(), bias.min(), bias.max())
    return {
        k: [per_layer[i][n] for i in sorted(per_layer)]
        for n, k in enumerate(("router_entropy", "moe_bias_min", "moe_bias_max"))
    }


def _step_metrics(mesh: str, **trainer):
    c = _config(mesh, **trainer)
    t = Trainer(c, validate(c, len(jax.devices()), None))
    state = _with_random_biases(t, t.init(), seed=5)
    tokens = np.random.default_rng(6).integers(
        0, c.model.vocab_size, size=(c.data.batch_size, c.data.seq_len), dtype=np.int32
    )
    model = jax.device_get(eqx.combine(state["params"], t.static))  # before the step: it donates the state
    _, m = t.jitted_step()(state, t.shard_tokens(tokens))
    return jax.device_get(m), model, tokens


def test_tiny_model_step_metrics_match_numpy():
    m, model, tokens = _step_metrics("single")
    ref = _reference(model, tokens)
    assert len(ref["router_entropy"]) == model.config.num_moe_layers == 2
    np.testing.assert_allclose(m["router_entropy"], ref["router_entropy"], rtol=1e-5)
    # the biases that routed this step (before the balancing rule moved them)
    np.testing.assert_array_equal(m["moe_bias_min"], np.asarray(ref["moe_bias_min"], np.float32))
    np.testing.assert_array_equal(m["moe_bias_max"], np.asarray(ref["moe_bias_max"], np.float32))
    assert m["router_entropy"].dtype == np.float32 and len(set(np.round(m["moe_bias_max"], 6))) == 2  # layers differ
    assert "expert_token_share" not in m  # only with trainer.tensorboard

    # On 8 devices each one routes its own tokens (a shard_map): the same means.
    sharded, _, _ = _step_metrics("fsdp")
    np.testing.assert_allclose(sharded["router_entropy"], m["router_entropy"], rtol=1e-5)


def _metric_shapes(**trainer) -> dict:
    """The step's metrics as shapes (traced, not compiled)."""
    c = _config("single", **trainer)
    t = Trainer(c, validate(c, len(jax.devices()), None))
    _, m = jax.eval_shape(t.train_step, t.abstract_state(), t.abstract_tokens())
    return {k: v.shape for k, v in m.items()}


def test_moe_metrics_switch_and_tensorboard_share():
    on = _metric_shapes(tensorboard=True)
    assert on["router_entropy"] == on["moe_bias_min"] == on["moe_bias_max"] == (2,)
    assert on["expert_token_share"] == (2, 8)  # MoE layers x experts, for the histograms
    assert "expert_token_share" not in _metric_shapes()  # not without trainer.tensorboard
    off = _metric_shapes(moe_metrics=False, tensorboard=True)
    assert not {"router_entropy", "moe_bias_min", "moe_bias_max", "expert_token_share"} & set(off)
    assert off["expert_load_max_over_mean"] == (2,)  # the existing metrics stay


# --- the progress line ---------------------------------------------------------------------------


def _line(progress: Progress, stream: io.StringIO, step: int, loads) -> str:
    stream.seek(0)
    stream.truncate()
    progress.update(step, {"loss": 1.0, "grad_norm": 1.0, "lr": 1e-3, "expert_load_max_over_mean": loads})
    return stream.getvalue()


def test_progress_line_names_the_most_imbalanced_layer_past_the_threshold():
    stream = io.StringIO()
    p = Progress(100, 10, stream=stream, moe_imbalance_warn=2.0, moe_layers=[1, 2, 7])
    assert "moe:" not in _line(p, stream, 0, [1.5, 1.9, 1.2])  # under the threshold: nothing
    # the first step past it is printed although it is off the every-10 grid, naming model layer 7
    assert _line(p, stream, 4, [1.5, 2.5, 3.1]).rstrip().endswith("moe: layer 7 max/mean 3.1")
    assert _line(p, stream, 5, [1.5, 2.5, 3.1]) == ""  # still past it: only on the grid
    assert _line(p, stream, 9, [2.4, 1.0, 1.0]).rstrip().endswith("moe: layer 1 max/mean 2.4")
    assert "moe:" not in _line(p, stream, 19, [1.9, 1.0, 1.0])  # back under it
    off = Progress(100, 10, stream=stream, moe_imbalance_warn=0.0, moe_layers=[1, 2, 7])
    assert "moe:" not in _line(off, stream, 0, [9.0, 9.0, 9.0])  # 0 disables
    with pytest.raises(ConfigError, match="trainer.moe_imbalance_warn"):
        TrainerConfig(moe_imbalance_warn=0.5)


# --- zoo.tools.report on one run's directory -----------------------------------------------------------


def _write_run(run_dir: pathlib.Path, moe: bool, rounds: bool = False) -> None:
    run_dir.mkdir(parents=True)
    rows = []
    for step in range(6):
        r = {"step": step, "loss": 5.0 - 0.1 * step, "grad_norm": 1.0, "lr": 1e-3}
        if moe:
            r |= {
                "expert_load_max_over_mean": [1.2 + 0.1 * step, 1.5],
                "expert_load_min_over_mean": [0.8, 0.6],
                "moe_dropped_fraction": [0.0, 0.01 * step],
                "router_entropy": [2.0, 1.9],
                "moe_bias_min": [-0.001 * step, 0.0],
                "moe_bias_max": [0.001 * step, 0.0],
            }
            if rounds:
                r["moe_exchange_rounds"] = [1, 1 + step % 2]
        rows.append(json.dumps(r))
    (run_dir / "metrics.jsonl").write_text("\n".join(rows) + "\n")
    (run_dir / "summary.json").write_text(
        json.dumps({"status": "ok", "step_time_s": 0.1, "moe_layers": [1, 2] if moe else []})
    )


def test_report_adds_the_exchange_rounds_panel_when_the_run_logged_them(tmp_path, monkeypatch):
    """A dropless expert-parallel run logs `moe_exchange_rounds`; the plot gets a panel for it."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from zoo.tools.report import run_report

    panels = []
    subplots = plt.subplots
    monkeypatch.setattr(plt, "subplots", lambda n, *a, **k: panels.append(n) or subplots(n, *a, **k))
    _write_run(tmp_path / "plain", moe=True)
    run_report(tmp_path / "plain")
    _write_run(tmp_path / "rounds", moe=True, rounds=True)
    run_report(tmp_path / "rounds")
    assert panels[1] == panels[0] + 1, panels


def _report(run_dir: pathlib.Path):
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    return subprocess.run(
        [sys.executable, "-m", "zoo.tools.report", str(run_dir)], capture_output=True, text=True, env=env, timeout=300
    )


def test_report_on_a_run_dir_plots_expert_load(tmp_path):
    _write_run(tmp_path / "moe", moe=True)
    r = _report(tmp_path / "moe")
    png = tmp_path / "moe" / "expert_load.png"
    assert r.returncode == 0, r.stderr
    assert r.stdout.strip().splitlines() == [f"wrote {png}"]
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert not (tmp_path / "moe" / "report.md").exists()  # the run path, not the sweep table

    _write_run(tmp_path / "dense", moe=False)
    r = _report(tmp_path / "dense")
    assert r.returncode == 0, r.stderr
    assert "no MoE data" in r.stdout and not (tmp_path / "dense" / "expert_load.png").exists()


# --- end to end: train.py -> metrics.jsonl, progress line, TensorBoard -> zoo.tools.report ---------------


def _histogram_tags(event_dir: pathlib.Path) -> set:
    """The histogram tags in a TensorBoard event file (its TFRecord framing read directly)."""
    from tensorboardX.proto import event_pb2

    tags = set()
    for path in event_dir.glob("events.out.tfevents.*"):
        data, i = path.read_bytes(), 0
        while i < len(data):
            (n,) = struct.unpack("<Q", data[i : i + 8])
            event = event_pb2.Event.FromString(data[i + 12 : i + 12 + n])
            i += 12 + n + 4
            tags |= {v.tag for v in event.summary.value if v.HasField("histo")}
    return tags


# a train.py run and a report; docs/training.md's moe_routing group (tests/test_readme.py) runs the same two commands in
# the default tier
@pytest.mark.slow
def test_train_writes_moe_metrics_then_report_plots_them(tmp_path):
    try:
        import tensorboardX  # noqa: F401

        tensorboard = True
    except ImportError:  # the optional extra: the rest is still checked
        tensorboard = False
    run_dir = tmp_path / "run"
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    args = [
        sys.executable,
        str(ROOT / "train.py"),
        "trainer.steps=3",
        "trainer.log_every=100",
        "mesh=single",
        "data.batch_size=8",
        "data.seq_len=16",
        "trainer.moe_imbalance_warn=1.01",
        f"trainer.tensorboard={str(tensorboard).lower()}",
        f"hydra.run.dir={run_dir}",
    ]
    r = subprocess.run(args, capture_output=True, text=True, env=env, timeout=600, cwd=tmp_path)
    assert r.returncode == 0, r.stderr[-3000:]
    # max/mean exceeds 1.01 on a random router: step 1's line names a MoE layer (dsv3_tiny_a: layers 1 and 2)
    first = next(ln for ln in r.stdout.splitlines() if ln.startswith("step 1/3"))
    assert " moe: layer 1 max/mean " in first or " moe: layer 2 max/mean " in first
    rec = json.loads((run_dir / "metrics.jsonl").read_text().splitlines()[0])
    assert len(rec["router_entropy"]) == len(rec["moe_bias_min"]) == len(rec["moe_bias_max"]) == 2
    assert all(0 < h < math.log(8) for h in rec["router_entropy"])
    assert "expert_token_share" not in rec  # TensorBoard only
    assert json.loads((run_dir / "summary.json").read_text())["moe_layers"] == [1, 2]
    if tensorboard:
        assert _histogram_tags(run_dir / "tensorboard") == {"expert_token_share/layer_1", "expert_token_share/layer_2"}
    r = _report(run_dir)
    assert r.returncode == 0 and (run_dir / "expert_load.png").read_bytes()[:4] == b"\x89PNG", r.stderr
