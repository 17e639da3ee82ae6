"""bench/peer_maxtext.py without a TPU or MaxText: the recorded chip runs rendered and held against what
docs/benchmarks.md says of them, the shapes it runs (Zoo's side of each), and its bad input."""

import dataclasses
import importlib.util
import json
import pathlib
import re
import sys

import pytest

ROOT = pathlib.Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from bench import peer_maxtext as pm  # noqa: E402

RECORD = ROOT / "docs" / "bench_maxtext.json"
DOC = ROOT / "docs" / "benchmarks.md"


@pytest.fixture(scope="module")
def record():
    r = json.loads(RECORD.read_text())
    pm.derive(r)
    return r


def test_the_docs_tables_are_the_records_rendering(record):
    """Every row of the docs' MaxText tables is the record rendered (a retyped figure that drifts fails)."""
    section = DOC.read_text().split("## Against MaxText (TPU v5e)", 1)[1].split("\n## ", 1)[0]
    rendered = pm.markdown(record)
    rows = [line for line in rendered.splitlines() if line.startswith("| ") and "---" not in line]
    assert len(rows) >= 20
    missing = [row for row in rows if row not in section]
    assert not missing, f"docs/benchmarks.md's rows differ from `--render docs/bench_maxtext.json`: {missing}"
    for line in rendered.splitlines():
        if line.startswith(("fastest:", "zoo:", "maxtext:")):
            assert line in section, line


def test_the_docs_figures_in_prose_are_the_records(record):
    """The ratios quoted in the prose equal those derived from the record."""
    s = record["shapes"]
    section = DOC.read_text().split("## Against MaxText (TPU v5e)", 1)[1].split("\n## ", 1)[0]
    assert f"{s['llama8b_8192']['zoo_over_maxtext_fastest']:.3f}x MaxText's fastest" in section
    assert f"is\n  {s['llama1b_8192']['zoo_over_maxtext_fastest']:.3f}x MaxText's fastest" in section
    assert f"by {s['llama1b_8192']['offload_vs_recompute']['zoo']['ratio']:.3f}x" in section
    assert f"is {s['dsv3_4096']['zoo_over_maxtext_fastest']:.3f} at 2 x 4096" in section
    assert f"{s['dsv3_4096_b3']['zoo_over_maxtext_fastest']:.3f}\n  at 3 x 4096" in section
    b3 = s["dsv3_4096_b3"]["offload_vs_recompute"]["maxtext"]
    assert f"is {b3['ratio']:.3f}x its fastest" in section
    shared = [
        z["median_step_s"] / e["maxtext"]["runs"][p]["median_step_s"]
        for e in (s["llama8b_8192"], s["llama1b_2048"], s["llama1b_8192"])
        for p, z in e["zoo"]["runs"].items()
        if z.get("median_step_s") and e["maxtext"]["runs"].get(p, {}).get("median_step_s")
    ]
    low, high = re.search(r"(0\.\d\d)x to (0\.\d\d)x MaxText's\n  step", section).groups()
    assert f"{min(shared):.2f}" == low and f"{max(shared):.2f}" == high


def test_maxtext_none_is_its_full_recompute(record):
    """What the docs say of MaxText's `none` (its remat with no policy): the same step and peak as `full`."""
    for name in ("llama8b_8192", "dsv3_4096"):
        runs = record["shapes"][name]["maxtext"]["runs"]
        assert runs["none"]["median_step_s"] == pytest.approx(runs["full"]["median_step_s"], rel=0.01)
        assert runs["none"]["xla_peak_bytes"] == runs["full"]["xla_peak_bytes"]


def test_derive_picks_each_sides_fastest_and_the_offload_ratio():
    r = {"shapes": {"s": {"shape": dataclasses.asdict(pm.TOY_SHAPES["toy_dense"])}}}
    r["shapes"]["s"]["zoo"] = {"runs": {"full": {"status": "ok", "step_times_s": [0.3, 0.2, 0.25]},
                                        "context_offloaded": {"status": "ok", "step_times_s": [0.18]},
                                        "none": {"status": "oom", "step_times_s": []}}}  # fmt: skip
    r["shapes"]["s"]["maxtext"] = {"runs": {"full": {"status": "ok", "step_times_s": [0.4]}}}
    pm.derive(r)
    e = r["shapes"]["s"]
    assert e["fastest"]["zoo"] == {"policy": "context_offloaded", "step_s": 0.18}
    assert e["zoo_over_maxtext_fastest"] == pytest.approx(0.18 / 0.4)
    assert e["offload_vs_recompute"]["zoo"]["ratio"] == pytest.approx(0.18 / 0.25)
    assert "mfu" not in e["zoo"]["runs"]["none"]


@pytest.mark.parametrize("name", list(pm.SHAPES))
def test_zoos_side_of_each_shape_has_the_stated_widths(name):
    s = pm.SHAPES[name]
    m = s.zoo_model()
    assert (m.hidden_size, m.num_layers, m.vocab_size) == (s.emb, s.layers, s.vocab)
    if s.mla:
        assert (m.mla.q_lora_rank, m.mla.kv_lora_rank, m.mla.qk_nope_head_dim) == (s.q_lora, s.kv_lora, s.qk_nope)
        assert (m.moe.n_routed_experts, m.moe.num_experts_per_tok, m.moe.moe_intermediate_size) == (
            s.experts, s.top_k, s.mlp)  # fmt: skip
        assert "num_experts=4" in s.maxtext_args() and "kv_lora_rank=512" in s.maxtext_args()
    else:
        widths = (m.intermediate_size, m.num_heads, m.num_kv_heads, m.head_dim)
        assert widths == (s.mlp, s.heads, s.kv_heads, s.head_dim)
        assert f"base_mlp_dim={s.mlp}" in s.maxtext_args()
    assert s.state_bytes() < 0.95 * pm.HBM_BYTES  # each fits the chip's state check


def _run(monkeypatch, capsys, argv):
    monkeypatch.setenv("JAX_PLATFORMS", "cpu")
    monkeypatch.setenv("ZOO_BENCH_JAX_PLATFORMS", "")
    rc = pm.main(argv)
    return rc, capsys.readouterr().err.strip().splitlines()


@pytest.mark.parametrize(
    "argv, said",
    [
        (
            [
                "--dims",
                "emb=64,mlp=128,heads=6,kv_heads=4,head_dim=16,layers=1,vocab=256",
                "--batch",
                "1",
                "--seq",
                "128",
            ],
            "heads=6 is not a multiple of kv_heads=4",
        ),  # fmt: skip
        (
            ["--dims", "emb=64,mlp=128,heads=4,kv_heads=2,head_dim=15,layers=1,vocab=256,batch=1,seq=128"],
            "head_dim=15: rotary dims come in pairs",
        ),  # fmt: skip
        (
            ["--dims", "emb=512,mlp=128,heads=4,kv_heads=4,head_dim=64,layers=1,vocab=256,batch=1,seq=100"],
            "seq=100: the TPU attention kernels",
        ),  # fmt: skip
        (
            [
                "--dims",
                "emb=4096,mlp=14336,heads=32,kv_heads=8,head_dim=128,layers=4,vocab=128256",
                "--batch",
                "1",
                "--seq",
                "8192",
            ],
            "more than the 16.9 GB the chip holds",
        ),  # fmt: skip
        (["--dims", "emb=64,mlp=128"], "--dims: give heads"),
        (["--dims", "emb=64,width=3"], "'width=3' is not one of"),
        (["--shapes", "llama70b"], "--shapes: unknown 'llama70b'"),
        (["--shapes", "llama8b_8192", "--batch", "4"], "--batch and --seq go with --dims"),
        (["--policies", "offload_all"], "--policies: unknown 'offload_all'"),
        (["--sides", "pytorch"], "--sides 'pytorch'"),
    ],
)
def test_bad_input_is_one_line_before_anything_runs(monkeypatch, capsys, argv, said):
    rc, err = _run(monkeypatch, capsys, [*argv, "--sides", "zoo"] if "--sides" not in argv else argv)
    assert rc == 2 and len(err) == 1 and err[0].startswith("error: ") and said in err[0], err


@pytest.mark.skipif(importlib.util.find_spec("maxtext") is not None, reason="this Python has MaxText")
def test_without_maxtext_it_says_how_to_install_it(monkeypatch, capsys):
    rc, err = _run(monkeypatch, capsys, ["--toy", "--shapes", "toy_dense"])
    assert rc == 2 and len(err) == 1, err
    assert "has no MaxText" in err[0] and "maxtext==0.2.4" in err[0] and "--sides zoo" in err[0]
