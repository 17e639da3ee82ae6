"""bench/peer.py's comparison without torch: the Llama both systems run and the FLOP count both are
measured against (through zoo.config, which bench/peer.py reads them from), and its one-line refusals,
run as a command. Nothing here imports bench/."""

import subprocess
import sys
from pathlib import Path

import pytest

from zoo.counts import count_params, flops_per_token
from zoo.families import SIZES

ROOT = Path(__file__).resolve().parent.parent

# bench/peer.py's configs (its docstring and docs/benchmarks.md state them): transformers' Llama shapes.
PEER = {
    "tiny": dict(
        vocab_size=32000,
        hidden_size=256,
        num_layers=4,
        num_heads=4,
        num_kv_heads=2,
        head_dim=64,
        intermediate_size=1024,
    ),
    "100m": dict(
        vocab_size=32000,
        hidden_size=512,
        num_layers=8,
        num_heads=8,
        num_kv_heads=4,
        head_dim=64,
        intermediate_size=2048,
    ),
}
BATCH = {"tiny": (8, 256), "100m": (4, 512)}


def peer_llama(config: str):
    return SIZES["llama_tiny_a"].replace(**PEER[config], max_position_embeddings=512)


@pytest.mark.parametrize("config, gflop", [("tiny", 152.2), ("100m", 613.6)])
def test_flop_count_is_the_peers(config, gflop):
    # The peer's count: 6 x matmul weights (LM head in, embedding lookup out) x tokens + causal attention.
    batch, seq = BATCH[config]
    assert flops_per_token(peer_llama(config), seq) * batch * seq / 1e9 == pytest.approx(gflop, abs=0.05)


@pytest.mark.parametrize("config", ["tiny", "100m"])
def test_zoo_llama_has_the_peers_parameters(config):
    # transformers' LlamaForCausalLM of this config: untied head, no biases, two norms a layer and a final one.
    d, m = PEER[config], peer_llama(config)
    assert not m.tie_word_embeddings
    h, kv = d["hidden_size"], d["num_kv_heads"] * d["head_dim"]
    layer = (
        h * (d["num_heads"] * d["head_dim"] + 2 * kv)
        + d["num_heads"] * d["head_dim"] * h
        + 3 * h * d["intermediate_size"]
        + 2 * h
    )
    assert count_params(m) == 2 * d["vocab_size"] * h + d["num_layers"] * layer + h


def _peer(*args):
    return subprocess.run(
        [sys.executable, "bench/peer.py", *args], cwd=ROOT, capture_output=True, text=True, timeout=120
    )


def test_without_torch_one_line_exit_2():
    p = _peer("--torch-python", "/no/such/python")
    assert p.returncode == 2
    lines = [ln for ln in p.stderr.splitlines() if ln.strip()]
    assert len(lines) == 1 and lines[0].startswith("error: --torch-python: ") and ";" in lines[0], p.stderr


def test_unknown_config_one_line_exit_2():
    # Any existing interpreter passes the --torch-python check; the config is refused before anything runs.
    p = _peer("--torch-python", sys.executable, "--configs", "tiny,1b")
    assert p.returncode == 2 and p.stdout == ""
    lines = [ln for ln in p.stderr.splitlines() if ln.strip()]
    assert len(lines) == 1 and lines[0].startswith("error: --configs/--remats: 1b/none unknown; "), p.stderr
