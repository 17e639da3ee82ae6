"""`plan.compile`: the planner's candidates compiled by XLA for the target (zoo.plan.compiled.checked_search);
`plan.measure`: those that fit, and the presets, timed on the device."""

import dataclasses
import json
import math

import pytest
from omegaconf import OmegaConf

import zoo.plan.compiled
from zoo.plan.compiled import (
    MEASURED_PRESETS,
    Checked,
    candidate_key,
    checked_search,
    checked_table,
    chosen,
    oom_bytes,
    unmeasured_offload_note,
)
from zoo.plan.cost import evaluate
from zoo.plan.problem import GB, Infeasible, Problem, StackCost, TagCost, fmt_bytes
from zoo.plan.search import search
from zoo.tools import plan as zp

MB = 1e6


def _problem(budget_gb: float) -> Problem:
    # Two tags of 1 GB per layer over 4 layers, costly to recompute, slow to move: keeping both is the
    # fastest; each one given up costs time.
    return Problem(
        tags=[TagCost(t, {"s": 1 * GB}, {"s": 4e12}) for t in ("a", "b")],
        stacks={"s": StackCost(layers=4, forward_flops_per_layer=1e12)},
        rate=1e14,
        link=1 * GB,
        budget=budget_gb * GB,
        step_flops=12e12,
        param_bytes=1 * GB,
    )


def _compiler(ratio: float):
    """A stand-in compiler whose peak is `ratio` times the model's, recording what it compiled."""
    seen = []

    def peak(e):
        seen.append(dict(e.assignment))
        return ratio * e.peak_bytes, 0.0

    return peak, seen


def test_a_model_that_overstates_is_corrected_to_the_policy_that_fits():
    # Keeping both tags is 9 GB by the model; the compiler puts it at 6.3 GB. Under a 7 GB budget the
    # estimate alone gives up a tag; compiled, the first pick comes out at 0.7x its estimate, the
    # search is repeated with the budget scaled by that, and keeping both is compiled and fits.
    p = _problem(7.0)
    assert search(p).assignment != {"a": "device", "b": "device"}
    peak, seen = _compiler(0.7)
    tried = checked_search(p, peak, 4)
    pick = chosen(tried, p.budget)
    assert pick.estimate.assignment == {"a": "device", "b": "device"}
    assert pick.compiled_peak == pytest.approx(6.3 * GB)
    assert len(seen) == len(tried) == 2  # then the search repeats its pick: no third compile


def test_a_model_that_understates_gives_up_more_until_the_compiler_agrees():
    # The compiler puts every policy at 1.5x the model: the estimate's pick does not fit; the next
    # search asks for 1/1.5 of the budget and that pick does.
    p = _problem(9.0)
    peak, _ = _compiler(1.5)
    tried = checked_search(p, peak, 4)
    assert not tried[0].fits(p.budget) and tried[0].estimate.assignment == {"a": "device", "b": "device"}
    pick = chosen(tried, p.budget)
    assert pick is not None and pick.compiled_peak <= p.budget
    assert pick.estimate.time_s > tried[0].estimate.time_s


def test_when_the_smallest_offloads_and_does_not_compile_within_budget_recompute_is_tried():
    # Offloading costs one layer in flight in the estimate and hides under compute, so the estimate's pick
    # under a tight budget offloads both tags; its compiled peak is over the budget (here the compiler
    # holds 1.5 GB more per offloaded tag) and nothing smaller is left to the estimate: the same with
    # recompute is compiled, and fits.
    p = _problem(3.0)
    p.link = 1000 * GB

    def peak(e):
        offloads = sum(a == "offload" for a in e.assignment.values())
        return e.peak_bytes + offloads * 1.5 * GB, 0.0

    tried = checked_search(p, peak, 4)
    assert tried[0].estimate.assignment == {"a": "offload", "b": "offload"} and not tried[0].fits(p.budget)
    pick = chosen(tried, p.budget)
    assert pick is tried[1] and pick.estimate.assignment == {"a": "remat", "b": "remat"}
    # then each tag offloaded alone in place of its recompute: 3.5 GB compiled, over the budget too
    alone = [{"a": "offload", "b": "remat"}, {"a": "remat", "b": "offload"}]
    assert [c.estimate.assignment for c in tried[2:]] == alone
    assert not any(c.fits(p.budget) for c in tried[2:])


def test_from_the_recompute_that_fits_one_tag_offloaded_in_its_place_is_tried_and_wins():
    # As above with room for one offloaded tag (3.75 GB): recompute fits, and offloading one of the
    # two in its place (3.5 GB compiled, faster by the estimate) fits and is the pick; no compile after.
    p = _problem(3.75)
    p.link = 1000 * GB

    def peak(e):
        return e.peak_bytes + sum(a == "offload" for a in e.assignment.values()) * 1.5 * GB, 0.0

    tried = checked_search(p, peak, 6)
    assert [c.estimate.assignment for c in tried[1:]] == [{"a": "remat", "b": "remat"}, {"a": "offload", "b": "remat"}]
    pick = chosen(tried, p.budget)
    assert pick is tried[-1] and pick.estimate.time_s < tried[1].estimate.time_s


def test_nothing_fits_when_even_the_smallest_does_not_compile_within_the_budget():
    p = _problem(0.5)  # below the parameters alone
    with pytest.raises(Infeasible):
        search(p)
    peak, _ = _compiler(1.0)
    tried = checked_search(p, peak, 3)
    assert tried and chosen(tried, p.budget) is None


@pytest.mark.parametrize(
    "message, want",
    [
        ("RESOURCE_EXHAUSTED: Ran out of memory in memory space hbm. Used 16.11G of 15.75G hbm.", 16.11 * 2**30),
        (
            "RESOURCE_EXHAUSTED: Ran out of memory on HBM, the total memory required for HLO temporaries (17.2G) "
            "exceeds available HBM (15.75G).",
            None,
        ),
        ("RESOURCE_EXHAUSTED: out of memory, no figure", math.inf),
        ("INVALID_ARGUMENT: something else", "none"),
    ],
)
def test_the_compilers_out_of_memory_figure_is_read(message, want):
    got = oom_bytes(RuntimeError(message))
    if want == "none":
        assert got is None
    elif want is None:
        assert got == pytest.approx(17.2 * 2**30)
    else:
        assert got == pytest.approx(want)


BASE = ["model=llama_tiny_a", "mesh=single", "data.batch_size=2", "data.seq_len=64", "hardware=cpu", "plan.link=16"]


def test_cli_prints_and_writes_the_compiled_peak_of_the_policy_train_py_builds(tmp_path, capsys):
    from zoo.tools.kit import prepare_step
    from zoo.train.metrics import compiled_memory

    out, js = tmp_path / "offload" / "checked.yaml", tmp_path / "p.json"
    args = [*BASE, "plan.hbm_budget_gb=1", "plan.compile=2", f"plan.out={out}", f"plan.json={js}", "plan.name=checked"]
    assert zp.main(args) == 0
    printed = capsys.readouterr().out
    assert "compiled by XLA (compiled on this cpu" in printed
    record = json.loads(js.read_text())
    got = record["compiled_peak_bytes"]
    assert f"XLA compiled this policy to {fmt_bytes(got)}" in printed
    assert f"XLA's compiled peak {fmt_bytes(got)}" in out.read_text()
    # The figure is that of the step train.py compiles from the written plan.
    overrides = [*BASE[:-1], f"hydra.searchpath=[file://{tmp_path}]", "offload=checked"]
    c, _, _, trainer, _ = prepare_step(overrides)
    assert c.offload.tags == dict(OmegaConf.load(out)["tags"])
    exe = trainer.lower().compile(trainer.compiler_options)
    assert compiled_memory(exe)["estimated_peak_bytes"] == got


GiB = 2**30


@pytest.mark.parametrize(
    "fields, device_peak",
    [
        # XLA:TPU's memory analysis of three programs compiled for a v5e (libtpu, ahead of time): a
        # pinned-host argument of 1 GiB read into device temporaries; a device argument sent to a
        # pinned-host output; a donated pinned-host argument returned as it is.
        (dict(peak_memory_in_bytes=2 * GiB, temp_size_in_bytes=GiB, host_argument_size_in_bytes=GiB), GiB),
        (dict(peak_memory_in_bytes=2 * GiB, argument_size_in_bytes=GiB, host_output_size_in_bytes=GiB), GiB),
        (
            dict(
                peak_memory_in_bytes=GiB,
                host_argument_size_in_bytes=GiB,
                host_output_size_in_bytes=GiB,
                host_alias_size_in_bytes=GiB,
            ),
            0,
        ),
        # offloaded temporaries are not in the simulated peak, and stay in
        (dict(peak_memory_in_bytes=3 * GiB // 2, temp_size_in_bytes=GiB, host_temp_size_in_bytes=GiB), 3 * GiB // 2),
    ],
)
def test_a_tpus_compiled_peak_leaves_out_what_lives_on_the_host(fields, device_peak):
    from types import SimpleNamespace

    from zoo.train.metrics import compiled_memory

    names = ("argument", "output", "alias", "temp", "host_argument", "host_output", "host_alias", "host_temp")
    analysis = {f"{n}_size_in_bytes": 0 for n in names} | {"generated_code_size_in_bytes": 0} | fields
    exe = SimpleNamespace(memory_analysis=lambda: SimpleNamespace(**analysis))
    mem = compiled_memory(exe, platform="tpu")
    assert mem["simulated_peak_bytes"] == fields["peak_memory_in_bytes"]
    assert mem["estimated_peak_bytes"] == device_peak
    # elsewhere the figure is the device's arguments, outputs and temporaries, host ones apart
    assert (
        compiled_memory(exe, platform="gpu")["estimated_peak_bytes"]
        == sum(analysis[f"{n}_size_in_bytes"] for n in ("argument", "output", "temp")) - analysis["alias_size_in_bytes"]
    )


@pytest.mark.parametrize(
    "args, message",
    [
        (["plan.compile=-1"], "error: plan.compile: must be >= 0 (the number of candidates to compile), got -1; e.g. "),
        (["hardware=h100_pcie", "plan.compile=2"], "error: plan.compile: compiling for gpu needs a gpu here"),
        (
            ["plan.measure=2", "plan.compile=0"],
            "error: plan.measure: it times the compiled candidates; drop plan.compile=0",
        ),
        (
            ["plan.measure=2"],
            "error: plan.measure: it times the compiled candidates, and nothing compiles for cpu here",
        ),
        (
            ["hardware=tpu_v5e", "plan.compile=2", "plan.measure=2"],
            "error: plan.measure: it runs the candidates, so it needs the target (tpu) here, not cpu",
        ),
    ],
)
def test_cli_compile_bad_input_is_one_line(args, message, tmp_path, capsys):
    assert zp.main([*BASE, "plan.hbm_budget_gb=1", *args, f"plan.out={tmp_path / 'x.yaml'}"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith(message), err
    assert not (tmp_path / "x.yaml").exists()


def test_measured_candidates_are_chosen_by_their_measured_step():
    p = _problem(20.0)
    fast, slow = search(p), search(dataclasses.replace(p, budget=6 * GB))
    tried = [Checked(fast, 9 * GB, 0.0, measured_s=0.30), Checked(slow, 5 * GB, 0.0, measured_s=0.20)]
    assert fast.time_s < slow.time_s and chosen(tried, p.budget) is tried[1]
    tried[1].compiled_peak = 21 * GB  # the measured-fastest does not fit: the other one
    assert chosen(tried, p.budget) is tried[0]
    assert "measured step" in checked_table(tried, p.budget, "here")


def test_the_table_says_what_xla_rematerialized():
    """A candidate XLA fitted by rematerializing values (zoo.hlo.rematerialized) shows how many bytes,
    and the table says why its HBM is below the estimate; with none, no such column."""
    p = _problem(20.0)
    e = search(p)
    plain = checked_table([Checked(e, 9 * GB, 0.0, rematerialized_bytes=0.0)], p.budget, "here")
    assert "rematerialized" not in plain
    table = checked_table(
        [Checked(e, 9 * GB, 0.0, rematerialized_bytes=2.35 * GB), Checked(e, 8 * GB, 0.0)], p.budget, "here"
    )
    header, first, second = table.splitlines()[1:4]
    assert "XLA rematerialized" in header and "2.350 GB" in first and "2.350 GB" not in second
    assert table.splitlines()[-1].startswith("XLA rematerialized values to fit its memory limit")


def test_cli_measure_times_the_candidates_and_the_presets_and_keeps_the_fastest(tmp_path, capsys):
    out, js = tmp_path / "offload" / "timed.yaml", tmp_path / "p.json"
    args = [*BASE, "plan.hbm_budget_gb=1", "plan.compile=2", "plan.measure=1", f"plan.out={out}", f"plan.json={js}"]
    assert zp.main(args) == 0
    printed = capsys.readouterr().out
    assert "measured round 2/2" in printed
    cands = json.loads(js.read_text())["candidates"]
    presets = {c["preset"] for c in cands} - {None}
    assert presets <= set(MEASURED_PRESETS) and "full" in presets  # full differs from every planner pick here
    # a preset with tag actions: full, its attention output to host
    (offloaded,) = [c for c in cands if c["preset"] == "full:context=offload"]
    assert offloaded["assignment"]["context"] == "offload" and offloaded["assignment"]["mlpwi_0"] == "remat"
    assert all(c["measured_step_s"] > 0 for c in cands)  # everything fits 1 GB
    fastest = min(cands, key=lambda c: c["measured_step_s"])
    written = OmegaConf.to_container(OmegaConf.load(out)["tags"])
    assert written == {t: a for t, a in fastest["assignment"].items() if a != "remat"}
    assert f"Measured step {1e3 * fastest['measured_step_s']:.1f} ms, the fastest of {len(cands)}" in out.read_text()


def test_a_libtpu_that_cannot_start_is_one_line_not_a_traceback(tmp_path, monkeypatch, capsys):
    """A folder named libtpu on the path (a `pip install --target` directory found from the working
    directory) is no TPU compiler: not counted as installed, so plan.compile stays 0 by default. A
    libtpu that is installed but cannot describe the chip ends plan.compile in one line."""
    from jax.experimental import topologies

    from zoo import backend

    (tmp_path / "libtpu").mkdir()
    monkeypatch.syspath_prepend(str(tmp_path))
    assert not backend.libtpu_installed()
    args = [*BASE[:-2], "hardware=tpu_v5e", "plan.hbm_budget_gb=80"]
    assert zp.main([*args, f"plan.out={tmp_path / 'a.yaml'}"]) == 0  # the estimate alone: nothing compiled
    assert "compiled by XLA" not in capsys.readouterr().out

    def broken(**_):
        raise AttributeError("module 'libtpu' has no attribute 'get_library_path'")

    monkeypatch.setattr(zoo.plan.compiled, "libtpu_installed", lambda: True)
    monkeypatch.setattr(topologies, "get_topology_desc", broken)
    assert zp.main([*args, "plan.compile=1", f"plan.out={tmp_path / 'b.yaml'}"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("error: plan.compile: libtpu could not describe a v5e "), err
    assert err[0].endswith(
        "(AttributeError: module 'libtpu' has no attribute 'get_library_path'); reinstall libtpu (pip install "
        "libtpu), plan on the TPU, or drop plan.compile"
    )
    assert not (tmp_path / "b.yaml").exists()


def test_a_pick_that_offloads_several_tags_untimed_says_to_time_it():
    p = _problem(100.0)
    one = Checked(evaluate(p, {"a": "offload", "b": "remat"}), 1.0, 0.0)
    two = Checked(evaluate(p, {"a": "offload", "b": "offload"}), 1.0, 0.0)
    assert unmeasured_offload_note(one, on_target=False, measured=False) is None
    assert unmeasured_offload_note(two, on_target=True, measured=True) is None  # timed: plan.measure
    note = unmeasured_offload_note(two, on_target=False, measured=False)
    assert note.startswith("note: the pick sends 2 tags to host (a, b), compiled ahead of time, not on the target")
    assert "plan.measure=2" in note
    assert "ahead of time" not in unmeasured_offload_note(two, on_target=True, measured=False)


def test_a_program_xla_had_to_rematerialize_much_of_does_not_count_as_fitting():
    """Within the budget as compiled is not enough when XLA rematerialized so much to get there that the
    program as written is over REMAT_SLACK x the budget (on a v5e such a pick ran 1.44x the fastest);
    a little, near its limit, is fine. The search takes it from the compiler, where it records it."""
    p = _problem(10.0)
    e = evaluate(p, {"a": "remat", "b": "remat"})
    assert Checked(e, 9.5 * GB, 0.0, rematerialized_bytes=0.9 * GB).fits(p.budget)  # 10.4 as written
    assert not Checked(e, 9.5 * GB, 0.0, rematerialized_bytes=2.0 * GB).fits(p.budget)  # 11.5
    assert not Checked(e, 10.5 * GB, 0.0).fits(p.budget)

    def compiler(e):
        return 9.0 * GB, 0.0

    compiler.rematerialized = {candidate_key(search(p)): 3.0 * GB}
    tried = checked_search(p, compiler, 1)
    assert tried[0].rematerialized_bytes == 3.0 * GB and chosen(tried, p.budget) is None


def test_the_next_budget_is_scaled_by_the_program_as_written_not_the_peak_after_remat():
    """A compiler that fits everything within the budget only by rematerializing: scaled by its peak the
    search would keep asking for the same program; scaled by what it wrote (peak + rematerialized) it
    gives up a tag, and that one fits."""
    p = _problem(9.0)  # keeping both: 9 GB by the estimate

    def compiler(e):
        return min(e.peak_bytes, 8.9 * GB), 0.0

    kept = evaluate(p, {"a": "device", "b": "device"})
    compiler.rematerialized = {candidate_key(kept): 3.0 * GB}
    tried = checked_search(p, compiler, 3)
    assert tried[0].estimate.assignment == {"a": "device", "b": "device"} and not tried[0].fits(p.budget)
    assert len(tried) > 1 and chosen(tried, p.budget) is tried[1]
    assert "remat" in tried[1].estimate.assignment.values()
