"""bench/peer.py's pieces that need no torch: the FLOP count both systems are measured against, the
Zoo model it builds, its table, and the one-line refusal without a torch environment."""

import subprocess
import sys
from pathlib import Path

import pytest

from bench.peer import CONFIGS, model_flops_per_step, table, zoo_model
from zoo.config import count_params

ROOT = Path(__file__).resolve().parent.parent


@pytest.mark.parametrize("config, gflop", [("tiny", 152.2), ("100m", 613.6)])
def test_flop_count_is_the_peers(config, gflop):
    # The peer's count: 6 x matmul weights (LM head in, embedding lookup out) x tokens + causal attention.
    assert model_flops_per_step(CONFIGS[config]) / 1e9 == pytest.approx(gflop, abs=0.05)


def test_zoo_model_is_the_peers_llama():
    d = CONFIGS["tiny"]
    m = zoo_model(d)
    assert (m.vocab_size, m.hidden_size, m.num_layers, m.num_heads, m.num_kv_heads, m.head_dim, m.intermediate_size) == (
        d["vocab"], d["hidden"], d["layers"], d["heads"], d["kv_heads"], d["head_dim"], d["mlp"])
    # transformers' LlamaForCausalLM of this config: untied head, no biases
    assert not m.tie_word_embeddings
    assert count_params(m) == 2 * 32000 * 256 + 4 * (256 * (256 + 128 + 128 + 256) + 3 * 256 * 1024 + 2 * 256) + 256


def test_table_row():
    r = {"zoo_ms": 1000.0, "torch_ms": 2000.0, "ratio": 0.5, "ratios": [0.4, 0.6], "zoo_fraction": 0.7,
         "torch_fraction": 0.35, "matmul_gflops": 150.0}
    row = table({"tiny/none": r}).splitlines()[-1]
    assert row == "| `tiny` | none | 1000 ms | 2000 ms | **0.50** | 0.40, 0.60 | 70% | 35% | 150 GFLOP/s |"


def test_without_torch_one_line_exit_2():
    p = subprocess.run([sys.executable, "bench/peer.py", "--torch-python", "/no/such/python"], cwd=ROOT,
                       capture_output=True, text=True, timeout=120)
    assert p.returncode == 2
    lines = [ln for ln in p.stderr.splitlines() if ln.strip()]
    assert len(lines) == 1 and lines[0].startswith("error: --torch-python: ") and ";" in lines[0], p.stderr


@pytest.mark.parametrize("config", ["tiny", "100m"])
def test_parts_add_up_to_the_step(config):
    # bench/peer_parts.py's FLOPs: the layers and the loss of its parts are the whole step's count.
    from bench.peer_parts import part_flops

    d = CONFIGS[config]
    f = part_flops(d)
    assert d["layers"] * f["layer"] + f["loss"] == pytest.approx(model_flops_per_step(d), rel=1e-9)
    assert f["loss"] == 3 * f["matmul_head"] and f["mlp"] == 9 * f["matmul_mlp"]


def test_parts_table_row():
    from bench.peer_parts import PARTS, table

    zoo = [{"seconds": {p: 0.2 for p in PARTS}}, {"seconds": {p: 0.4 for p in PARTS}}]
    torch = [{"seconds": {p: 0.1 for p in PARTS}}, {"seconds": {p: 0.1 for p in PARTS}}]
    lines = table("tiny", zoo, torch).splitlines()
    assert lines[0] == "**`tiny`** (medians over 2 rounds)"
    assert lines[4].startswith("| `matmul_mlp` | 300.0 ms | 100.0 ms | **3.00** | 2.00, 4.00 | ")
    assert lines[-1] == "| `optimizer` | 300.0 ms | 100.0 ms | **3.00** | 2.00, 4.00 |  |  |"


def test_parts_without_torch_one_line_exit_2():
    p = subprocess.run([sys.executable, "bench/peer_parts.py", "--torch-python", "/no/such/python"], cwd=ROOT,
                       capture_output=True, text=True, timeout=120)
    assert p.returncode == 2
    lines = [ln for ln in p.stderr.splitlines() if ln.strip()]
    assert len(lines) == 1 and lines[0].startswith("error: --torch-python: "), p.stderr
