"""zoo.tools.report on constructed summaries: spread and step count shown, no Pareto front from noise."""

import json

from zoo.tools import report


def _job(path, overrides, memory_mib, p25_ms, p75_ms, steps=19):
    path.mkdir(parents=True)
    median = (p25_ms + p75_ms) / 2e3
    summary = {
        "status": "ok",
        "overrides": overrides,
        "peak_memory_bytes": memory_mib * 2**20,
        "peak_memory_source": "compiled.memory_analysis",
        "step_time_s": median,
        "timed_steps": steps,
        "step_time_quantiles_s": {
            "min": p25_ms / 2e3,
            "p25": p25_ms / 1e3,
            "median": median,
            "p75": p75_ms / 1e3,
            "max": p75_ms / 5e2,
        },
        "tokens_per_s": 1.0,
        "tflops_per_device": 0.0,
        "mfu": 0.0,
        "first_loss": 6.0,
        "last_loss": 5.0,
    }
    (path / "summary.json").write_text(json.dumps(summary))


def test_front_ignores_differences_inside_the_noise(tmp_path):
    _job(tmp_path / "0", ["offload=a"], 100, 50, 60)  # overlaps b at the same memory: a tie
    _job(tmp_path / "1", ["offload=b"], 100, 55, 65)
    _job(tmp_path / "2", ["offload=c"], 200, 10, 20)  # measurably faster, more memory: on the front too
    _job(tmp_path / "3", ["offload=d"], 200, 70, 80)  # more memory and not faster than a: dominated
    _job(tmp_path / "4", ["offload=e"], 100, 90, 100)  # same memory, measurably slower than a: dominated
    jobs = {j["overrides"][0]: j for j in report.analyse(report.load_summaries(tmp_path))}
    assert {k: j["_pareto"] for k, j in jobs.items()} == {
        "offload=a": True,
        "offload=b": True,
        "offload=c": True,
        "offload=d": False,
        "offload=e": False,
    }
    # medians alone (the old rule) would have put b off the front: 60 ms > 55 ms at equal memory
    medians = report.pareto_front([(100, (0.055, 0.055)), (100, (0.060, 0.060))])
    assert medians == [True, False]

    md, png = report.report(tmp_path)
    table = md.read_text()
    assert "| p25-p75 (ms) | min-max (ms) | timed steps |" in table
    row_b = next(ln for ln in table.splitlines() if ln.startswith("| offload=b "))
    assert "| 60.0 | 55.0-65.0 | 27.5-130.0 | 19 |" in row_b and row_b.rstrip().endswith("| yes |")
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_summaries_without_spread_fall_back_to_the_median(tmp_path):
    (tmp_path / "old").mkdir()
    (tmp_path / "old" / "summary.json").write_text(
        json.dumps({"status": "ok", "step_time_s": 0.05, "peak_memory_bytes": 1})
    )
    (tmp_path / "new").mkdir()
    (tmp_path / "new" / "summary.json").write_text(
        json.dumps({"status": "ok", "step_time_s": 0.07, "peak_memory_bytes": 1})
    )
    jobs = {j["_dir"]: j for j in report.analyse(report.load_summaries(tmp_path))}
    assert jobs["old"]["_pareto"] and not jobs["new"]["_pareto"]
    assert "| old | ok | 50.0 | - | - | - |" in report.markdown(list(jobs.values()))
