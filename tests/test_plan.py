"""The planner: constructed cases for the cost model and the search, then the command line end to end
(plan -> YAML -> the inspector confirms the placement), and the hardware measurement."""

import dataclasses
import itertools
import json
import math
import re

import jax
import jax.numpy as jnp
import pytest
from omegaconf import OmegaConf

import zoo
import zoo.plan.compiled
from zoo.families import SIZES
from zoo.offload import expected_placement, from_mapping, placement_matches, remat_policy, resolve
from zoo.placement import inspect_placement, stack_names
from zoo.plan.cost import evaluate
from zoo.plan.options import PlanConfig, link_duplex, resolve_link
from zoo.plan.pricing import layer_forward_flops, per_device_shape, per_device_widths, producer_flops, stack_layers
from zoo.plan.problem import CHOICES, GB, Infeasible, PlanError, Problem, StackCost, TagCost, fmt_bytes
from zoo.plan.search import search
from zoo.plan.traced import problem_from_config
from zoo.plan.working_set import attention_working_bytes, loss_working_bytes
from zoo.tools import plan as zp

MB = 1e6
LAYERS = 10


def make_problem(tags, *, link_gbps=64.0, budget_gb=100.0, layer_flops=1e12, rate=1e14, fixed_gb=1.0, latency=10e-6):
    """One stack of LAYERS layers; `tags`: name -> (MB per layer, recompute FLOPs per layer)."""
    return Problem(
        tags=[TagCost(t, {"s": b * MB}, {"s": f}) for t, (b, f) in tags.items()],
        stacks={"s": StackCost(layers=LAYERS, forward_flops_per_layer=layer_flops)},
        rate=rate,
        link=link_gbps * GB,
        budget=budget_gb * GB,
        step_flops=3 * layer_flops * LAYERS,
        latency=latency,
        param_bytes=fixed_gb * GB,
    )


def test_ample_budget_keeps_everything_on_device():
    p = make_problem({"a": (100, 1e9), "b": (200, 1e12), "c": (1, 1e6)}, budget_gb=100)
    best = search(p)
    assert best.assignment == {"a": "device", "b": "device", "c": "device"}
    assert best.time_s == pytest.approx(3 * 1e12 * LAYERS / 1e14)  # compute only
    assert best.peak_bytes == pytest.approx(1 * GB + 301 * MB * LAYERS)


def test_slow_link_recomputes_the_cheap_tags():
    # Nothing fits on device (budget = the fixed part); 1 GB/s moves 100 MB in 100 ms against 10 ms of
    # compute per layer, while recomputing costs 10 us.
    p = make_problem({"a": (100, 1e9), "b": (100, 1e9)}, link_gbps=1.0, budget_gb=1.0)
    best = search(p)
    assert best.assignment == {"a": "remat", "b": "remat"}
    assert best.exposed_transfer_s == 0


def test_fast_link_with_compute_to_hide_behind_offloads():
    # Recomputing costs 10 ms per layer; 900 GB/s moves 100 MB in 0.11 ms, hidden by 10 ms of compute.
    # The budget holds the fixed part and one layer of both in flight, not a tag kept in every layer.
    p = make_problem({"a": (100, 1e12), "b": (100, 1e12)}, link_gbps=900.0, budget_gb=1.25)
    best = search(p)
    assert best.assignment == {"a": "offload", "b": "offload"}
    assert best.exposed_transfer_s == 0 and best.recompute_s == 0
    assert best.time_s == pytest.approx(p.step_flops / p.rate)


def test_transfers_without_compute_to_hide_behind_are_exposed():
    # The same tensors, but each layer computes only 1 us: the transfer is exposed, recomputing is cheaper.
    p = make_problem({"a": (100, 1e9)}, link_gbps=900.0, budget_gb=1.0, layer_flops=1e8)
    offloaded = evaluate(p, {"a": "offload"})
    fwd, bwd = 1e8 / 1e14, 2e8 / 1e14
    xfer = 100 * MB / (900 * GB) + 10e-6
    assert offloaded.exposed_transfer_s == pytest.approx(LAYERS * ((xfer - fwd) + (xfer - bwd)))
    assert search(p).assignment == {"a": "remat"}


def test_the_layer_inputs_transfers_are_exposed_whole():
    """What a layer's backward starts from cannot hide behind that backward: offloading the layer input
    costs its transfer both ways even where compute would hide another tag of its size."""
    p = make_problem({"decoder_layer_input": (100, 0.0), "a": (100, 1e12)}, link_gbps=64.0)
    xfer = 100 * MB / (64 * GB) + 10e-6
    assert evaluate(p, {"decoder_layer_input": "device", "a": "offload"}).exposed_transfer_s == 0
    both = evaluate(p, {"decoder_layer_input": "offload", "a": "offload"})
    assert both.exposed_transfer_s == pytest.approx(LAYERS * 2 * xfer)


def test_tiny_tensors_are_not_worth_offloading():
    # 4 kB per layer: the transfer's fixed latency (10 us) exceeds the 1 us of compute there is to hide it.
    p = make_problem({"a": (0.004, 1e7)}, link_gbps=900.0, budget_gb=1.0, layer_flops=1e8)
    assert search(p).assignment == {"a": "remat"}


def test_memory_not_the_bottleneck_means_no_offload_even_when_free():
    p = make_problem({"a": (100, 1e12)}, link_gbps=900.0, budget_gb=50)
    assert search(p).assignment == {"a": "device"}


def test_infeasible_budget_names_the_smallest_that_fits():
    p = make_problem({"a": (100, 1e9), "b": (50, 1e12)}, budget_gb=0.5, fixed_gb=1.0)
    with pytest.raises(Infeasible) as e:
        search(p)
    assert e.value.min_bytes == pytest.approx(1 * GB)  # everything recomputed or offloaded
    msg = str(e.value)
    assert msg.startswith("plan.hbm_budget_gb: no policy fits 0.500 GB; the smallest HBM any policy needs is 1.000 GB")
    assert "raise plan.hbm_budget_gb to at least 1.000" in msg
    # ... and that budget is feasible.
    p.budget = e.value.min_bytes
    assert search(p).peak_bytes <= p.budget


def test_search_is_optimal_on_a_random_problem():
    import random

    rng = random.Random(0)
    tags = {f"t{i}": (rng.uniform(1, 200), rng.uniform(1e8, 5e11)) for i in range(6)}
    p = make_problem(tags, link_gbps=rng.uniform(10, 500), budget_gb=1.0 + 0.6, layer_flops=2e11)
    best = search(p, inner_tags=3)  # exercise the chunked enumeration
    tolerance = 1e-3 * p.step_flops / p.rate
    for combo in itertools.product(CHOICES, repeat=len(tags)):
        e = evaluate(p, dict(zip(tags, combo)))
        if e.peak_bytes <= p.budget:
            assert best.time_s <= e.time_s + tolerance
    assert best.peak_bytes <= p.budget


def test_layer_input_cannot_be_recomputed():
    p = make_problem({"a": (100, 1e9)}, link_gbps=1.0, budget_gb=1.05)  # room for one layer's input in flight
    p.tags.append(TagCost("decoder_layer_input", {"s": 10 * MB}, {"s": 0.0}, ("device", "offload")))
    best = search(p)
    assert best.assignment["decoder_layer_input"] == "offload"
    with pytest.raises(ValueError):
        evaluate(p, {"decoder_layer_input": "remat"})


def test_optimizer_on_host_frees_the_backward_phase_and_streams_the_update():
    """The update phase holds the device-resident state and two layers' worth of host-resident slices
    (zoo.train.update: the leaves outside the stacks come in runs no larger than a layer slice)."""
    p = make_problem({"a": (100, 1e9)}, link_gbps=64.0, budget_gb=100.0)
    p.grad_bytes = p.param_bytes
    p.opt_bytes, p.stack_opt_bytes = 2 * GB, 1.8 * GB
    p.stacks["s"].opt_bytes_per_layer = 1.8 * GB / LAYERS
    on_device = evaluate(p, {"a": "device"})
    assert on_device.update_phase_bytes == pytest.approx(1 * GB + 1 * GB + 2 * GB)
    p.opt_on_host = True
    on_host = evaluate(p, {"a": "device"})
    assert on_host.backward_phase_bytes == pytest.approx(on_device.backward_phase_bytes - 2 * GB)
    # params + grads on device, 2 x 0.18 GB of one layer's moments (the 0.2 GB outside come in such runs)
    assert on_host.update_phase_bytes == pytest.approx(1 * GB + 1 * GB + 2 * 0.18 * GB)
    assert on_host.state_transfer_s == pytest.approx(2 * GB / (64 * GB))
    p.duplex = False  # a link that carries one direction at a time (a TPU v5e's): the way in, then out
    assert evaluate(p, {"a": "device"}).state_transfer_s == pytest.approx(2 * 2 * GB / (64 * GB))


def test_microbatches_hold_the_gradients_running_sum_beside_their_own():
    p = make_problem({"a": (100, 1e9)})
    p.grad_bytes, p.stack_param_bytes = p.param_bytes, 0.8 * GB
    one = evaluate(p, {"a": "device"}).backward_phase_bytes
    p.microbatches = 4
    assert evaluate(p, {"a": "device"}).backward_phase_bytes == pytest.approx(one + 1 * GB)
    # parameters on host: the stacks' gradients leave for host layer by layer; the rest sum on device
    p.params_on_host = True
    p.stacks["s"].param_bytes_per_layer = 0.8 * GB / LAYERS
    streamed = evaluate(p, {"a": "device"}).backward_phase_bytes
    p.microbatches = 1
    assert streamed - evaluate(p, {"a": "device"}).backward_phase_bytes == pytest.approx(0.2 * GB)


def test_a_link_without_duplex_exposes_the_sum_of_what_crosses_together():
    """With parameters on host, a layer's forward sends its activations out while its weights come in,
    and its backward brings both in while the weight gradients go out: on a link that carries one
    direction at a time the two add up (compute here hides nothing: 1 GFLOP a layer at 100 TFLOP/s)."""
    p = make_problem({"a": (100, 1e9)}, link_gbps=1.0, layer_flops=1e9, latency=0.0)
    p.params_on_host = True
    p.stacks["s"].param_bytes_per_layer = 50 * MB
    out, weights = 100 * MB / GB, 50 * MB / GB  # seconds over 1 GB/s
    compute_fwd, compute_bwd = 1e9 / 1e14, 2e9 / 1e14
    duplex = evaluate(p, {"a": "offload"}).exposed_transfer_s
    assert duplex == pytest.approx(LAYERS * (max(out, weights) - compute_fwd + (out + weights) - compute_bwd))
    p.duplex = False
    half = evaluate(p, {"a": "offload"}).exposed_transfer_s
    assert half == pytest.approx(LAYERS * ((out + weights) - compute_fwd + (out + 2 * weights) - compute_bwd))


def test_params_on_host_stream_weights_and_gradients():
    p = make_problem({"a": (100, 1e9)}, link_gbps=64.0, budget_gb=100.0)
    p.param_bytes = p.grad_bytes = 1 * GB
    p.stack_param_bytes = 0.9 * GB
    p.stacks["s"].param_bytes_per_layer = 0.09 * GB
    device = evaluate(p, {"a": "device"})
    p.params_on_host = True
    host = evaluate(p, {"a": "device"})
    layer = 0.09 * GB
    # Backward: weights and their gradients outside the stacks, and two layers of each in flight.
    assert host.backward_phase_bytes == pytest.approx(device.backward_phase_bytes - 2 * (0.9 * GB - 2 * layer))
    # Update: the gradients outside the stacks (made on device by the backward) and two layers' worth
    # of weights and gradients in flight.
    assert host.update_phase_bytes == pytest.approx(0.1 * GB + 2 * 2 * layer)
    # Weights in and out once, the stacks' gradients in twice (the norm, then the update).
    assert host.state_transfer_s == pytest.approx((1 * GB + 2 * 0.9 * GB) / (64 * GB))
    p.microbatches = 2  # and summed in place per microbatch: in twice, out once
    assert evaluate(p, {"a": "device"}).state_transfer_s == pytest.approx(
        (1 * GB + 2 * 0.9 * GB + 2 * 2 * 0.9 * GB) / (64 * GB)
    )
    p.duplex = False  # one direction at a time: everything in, plus everything out
    assert evaluate(p, {"a": "device"}).state_transfer_s == pytest.approx(
        (1 * GB + 2 * 0.9 * GB + 2 * 2 * 0.9 * GB + 1 * GB + 2 * 0.9 * GB) / (64 * GB)
    )


def test_attention_working_set_by_implementation():
    dims = dict(batch=2, heads=8, kv_heads=2, qk_dim=64, v_dim=64)
    xla = [attention_working_bytes("xla", seq=t, **dims) for t in (2048, 8192)]
    assert xla[0] == 2 * 2 * 8 * 2048**2 * 4 and xla[1] == 16 * xla[0]  # T x T float32 scores and probabilities
    for impl in ("blockwise", "cudnn"):
        small, large = (attention_working_bytes(impl, seq=t, **dims) for t in (2048, 8192))
        assert 2 * small < large <= 4 * small and large < xla[1] / 50, impl  # linear in T, not quadratic
    with pytest.raises(ValueError):
        attention_working_bytes("flash", seq=16, **dims)


def test_loss_working_set_counts_the_chunks_and_what_the_fused_backward_keeps():
    whole = loss_working_bytes(batch=2, seq=4096, vocab=128256, embed=2048, chunk=0, compute_bytes=2)
    assert whole == 3 * 2 * 4096 * 128256 * 4  # logits, softmax, gradient: float32
    cast = 2048 * 128256 * 2.0
    chunked = loss_working_bytes(
        batch=2, seq=4096, vocab=128256, embed=2048, chunk=512, compute_bytes=2, head_cast_bytes=cast
    )
    # One float32 chunk of logits (the softmax and its gradient fused into it), the head-gradient
    # accumulator, the hidden states' gradient, the head's cast.
    assert chunked == 2 * 512 * 128256 * 4 + 2048 * 128256 * 4 + 2 * 4096 * 2048 * 2 + cast
    assert whole / chunked > 5
    # A chunk longer than the sequence is the sequence.
    assert loss_working_bytes(batch=1, seq=64, vocab=10, embed=4, chunk=512, compute_bytes=4) == pytest.approx(
        64 * 10 * 4 + 4 * 10 * 4 + 64 * 4 * 4
    )
    # A vocab axis shared with the batch (8 devices): each chunk's logits cover the group's rows, over
    # the device's 1/8 of the vocabulary, and the group's chunk of hidden states is gathered.
    shared = loss_working_bytes(
        batch=2, seq=4096, vocab=128256 // 8, embed=2048, chunk=512, compute_bytes=2, row_group=8
    )
    assert shared == 16 * 512 * 16032 * 4 + 2048 * 16032 * 4 + 2 * 4096 * 2048 * 2 + 16 * 512 * 2048 * 2
    # As each backend's compiler allocates it (zoo.backend): a TPU accumulates the head's gradient in
    # its own buffer (no accumulator, no cast); XLA:CPU keeps 1.75 chunks of logits at once.
    from zoo import backend

    args = dict(batch=2, seq=4096, vocab=128256, embed=2048, chunk=512, compute_bytes=2, head_cast_bytes=cast)
    assert loss_working_bytes(**args, backend=backend.choices("tpu")) == 2 * 512 * 128256 * 4 + 2 * 4096 * 2048 * 2
    assert loss_working_bytes(**args, backend=backend.choices("cpu")) == pytest.approx(
        chunked + 0.75 * 2 * 512 * 128256 * 4
    )
    assert loss_working_bytes(**args, backend=backend.choices("gpu")) == chunked  # not measured: counted whole


def test_links():
    assert resolve_link(None, 64.0) == 64.0
    assert resolve_link("pcie_gen5", 0.0) == 64.0
    assert resolve_link("nvlink_c2c", 0.0) == 450.0  # 900 GB/s both directions together
    assert resolve_link("nvlink_c2c_rubin", 0.0) == 900.0
    assert resolve_link("12.5", 0.0) == 12.5
    from zoo.offload import conf_dir

    assert resolve_link("gh200", 0, conf_dir() / "hardware") == 450.0
    assert resolve_link("vera_rubin", 0, conf_dir() / "hardware") == 900.0
    with pytest.raises(PlanError, match=r"^plan.link: unknown link 'pcie9'"):
        resolve_link("pcie9", 0, conf_dir() / "hardware")
    with pytest.raises(PlanError, match=r"^plan.link: the hardware profile has no host_link_gbps"):
        resolve_link(None, 0.0)
    # Whether the link carries both directions at once: the run's profile, or the profile plan.link
    # names (a TPU v5e's does not); a number or a named PCIe / NVLink link does.
    hardware = conf_dir() / "hardware"
    assert link_duplex(None, False, hardware) is False and link_duplex(None, True, hardware) is True
    assert link_duplex("tpu_v5e", True, hardware) is False and link_duplex("gh200", False, hardware) is True
    assert link_duplex("pcie_gen5", False, hardware) is True and link_duplex("12.5", False, hardware) is True


def test_producer_flops_match_the_model_flop_count():
    """Summed over tags, producers are the forward matmul FLOPs: a third of flops_per_token's layers."""
    from zoo.counts import flops_per_token

    for size in ("llama_100m", "dsv3_100m"):
        c = zoo.get_size(size)
        if c.moe is not None:  # top-k rows exactly (the capacity kernel's buffers add capacity_factor)
            c = c.replace(moe=dataclasses.replace(c.moe, impl="ragged"))
        b, t = 2, 512
        stacks = (("dense_layers", c.num_dense_layers), ("moe_layers", c.num_moe_layers))
        layers = sum(layer_forward_flops(c, s, b, t) * n for s, n in stacks if n)
        head = 2 * b * t * c.hidden_size * c.vocab_size
        norms = 5 * b * t * (c.mla.q_lora_rank + c.mla.kv_lora_rank) * c.num_layers if c.mla else 0
        router = 2 * b * t * c.hidden_size * c.moe.n_routed_experts * c.num_moe_layers if c.moe else 0
        assert layers + head + router - norms == pytest.approx(flops_per_token(c, t) * b * t / 3, rel=1e-6)


# --- the command line ----------------------------------------------------------------------------

BASE = ["model=llama_tiny_a", "mesh=single", "data.batch_size=2", "data.seq_len=16", "hardware=h100_pcie"]


def test_cli_plan_notes_none_where_it_fits_and_the_profile_prices_the_checkpoint(tmp_path, capsys):
    """The search plans checkpointed policies; where the profile prices a checkpointed layer's forward
    run twice (tpu_v5e's recompute_passes) and `none` fits, the plan says so, with `none`'s estimate;
    not where `none` does not fit (a budget between the plan's peak and `none`'s), nor on a profile
    where keeping every tag under a checkpoint costs what `none` does (h100_pcie: no such term)."""
    args = ["model=llama_tiny_a", "mesh=single", "data.batch_size=2", "data.seq_len=64", "plan.compile=0"]
    ample = tmp_path / "ample.json"
    assert zp.main([*args, "hardware=tpu_v5e", f"plan.out={tmp_path / 'a.yaml'}", f"plan.json={ample}"]) == 0
    printed = capsys.readouterr().out
    pattern = r"note: offload=none \(nothing checkpointed\) fits too by the estimate \(([\d.]+) (\w+)\)"
    note = re.search(pattern, printed)
    assert note, printed
    none_peak = float(note.group(1)) * {"kB": 1e3, "MB": 1e6, "GB": 1e9}[note.group(2)]
    plan_peak = json.loads(ample.read_text())["estimate"]["peak_bytes"]
    assert plan_peak < none_peak
    from zoo.tools.kit import check_output

    for key, path in (("plan.out", tmp_path / "a.yaml"), ("plan.json", ample)):  # its own: the same command replaces
        assert check_output(path, key, "plan", "plan.overwrite=true") == path
    between = (plan_peak + none_peak) / 2 / GB
    assert zp.main([*args, "hardware=tpu_v5e", f"plan.hbm_budget_gb={between}", f"plan.out={tmp_path / 'b.yaml'}"]) == 0
    assert "offload=none" not in capsys.readouterr().out
    assert zp.main([*args, "hardware=h100_pcie", f"plan.out={tmp_path / 'c.yaml'}"]) == 0
    assert "offload=none" not in capsys.readouterr().out


def test_cli_plan_then_the_inspector_confirms_it(tmp_path, capsys):
    ample = tmp_path / "ample.json"
    assert zp.main([*BASE, "plan.hbm_budget_gb=80", f"plan.out={tmp_path / 'a.yaml'}", f"plan.json={ample}"]) == 0
    est = json.loads(ample.read_text())["estimate"]
    assert set(est["assignment"].values()) == {"device"}
    # Squeeze: the budget drops below what keeping every tag needs; the plan has to give some up.
    budget = (est["peak_bytes"] - 0.6 * est["device_tag_bytes"]) / GB
    out = tmp_path / "planned.yaml"
    assert (
        zp.main([*BASE, f"plan.hbm_budget_gb={budget}", "plan.link=pcie_gen5", f"plan.out={out}", "plan.name=squeezed"])
        == 0
    )
    printed = capsys.readouterr().out
    assert "estimated step" in printed and f"wrote {out}" in printed
    policy = from_mapping(OmegaConf.load(out))
    assert policy.name == "squeezed" and policy.checkpoint
    config = zoo.get_size("llama_tiny_a")
    actions = resolve(policy, config)
    assert {a for t, a in actions.items() if t != "mlpwo"} != {"device"}  # something moved off the device
    # The inspector reads the plan's placement back from the traced program.
    model = zoo.abstract(config)
    rp = remat_policy(policy, config)
    placement = inspect_placement(
        jax.grad(lambda m, t: zoo.loss_fn(m, t, remat_policy=rp)),
        model,
        jax.ShapeDtypeStruct((2, 16), jnp.int32),
        stacks=stack_names(model),
    )
    found = placement.by_tag()
    for tag, want in expected_placement(policy, config).items():
        assert placement_matches(want, found[tag]), (tag, want, found[tag])


def test_cli_in_its_own_process_takes_the_xla_group_before_jax_starts(tmp_path):
    # docs/scale.md's commands plan on simulated devices: xla.cpu_devices has to reach XLA before the
    # planner asks JAX which backend it runs on (it did not, and the planner stopped with "JAX already
    # started in this process with other XLA flags").
    import os
    import pathlib
    import subprocess
    import sys

    env = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"}
    out = tmp_path / "p.yaml"
    # bfloat16 on a GPU profile: cuDNN's attention, whose stand-in here is chosen by this machine's backend
    args = [
        "model=llama_tiny_a",
        "mesh=fsdp",
        "xla.cpu_devices=2",
        "data.batch_size=2",
        "data.seq_len=64",
        "hardware=gb200",
        "model.compute_dtype=bfloat16",
        f"plan.out={out}",
    ]
    p = subprocess.run(
        [sys.executable, "-m", "zoo.tools.plan", *args],
        cwd=pathlib.Path(zp.__file__).parent.parent,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert p.returncode == 0, p.stderr[-2000:]
    assert "on 2 device(s)" in p.stdout and "counted: attention cudnn" in p.stdout and out.exists()


def test_cli_infeasible_budget_is_one_line_with_the_smallest_budget(tmp_path, capsys):
    assert zp.main([*BASE, "plan.hbm_budget_gb=0.000001", f"plan.out={tmp_path / 'x.yaml'}"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("error: plan.hbm_budget_gb: no policy fits 0.000 GB")
    assert "raise plan.hbm_budget_gb to at least" in err[0]
    assert "plan.compile" not in err[0]  # an H100's program does not compile on this CPU
    assert not (tmp_path / "x.yaml").exists()


@pytest.mark.parametrize("hardware", ["cpu", "tpu_v5e"])
def test_an_hbm_refusal_points_at_plan_compile_where_the_compiler_runs(hardware, tmp_path, capsys, monkeypatch):
    """The estimate counts the program as written and XLA may rematerialize to fit it: where the
    target's compiler can run here (this CPU; a TPU's with libtpu) the one line says plan.compile asks it."""
    monkeypatch.setattr(zoo.plan.compiled, "libtpu_installed", lambda: False)
    args = [*BASE[:-1], f"hardware={hardware}", "plan.link=16", "plan.hbm_budget_gb=0.000001", "plan.compile=0"]
    assert zp.main([*args, f"plan.out={tmp_path / 'x.yaml'}"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("error: plan.hbm_budget_gb: no policy fits 0.000 GB")
    needs = " (with libtpu installed: pip install libtpu)" if hardware == "tpu_v5e" else ""
    assert err[0].endswith("XLA may rematerialize values to fit it: plan.compile=4 asks the compiler" + needs)


@pytest.mark.parametrize(
    "args, message",
    [
        (["plan.link=warp"], "error: plan.link: unknown link 'warp'"),
        (["plan.hbm_budget_gb=-1"], "error: plan.hbm_budget_gb: must be positive"),
        (["plan.budget=3"], "error: plan.budget: unknown key"),
        (["hardware=cpu"], "error: plan.link: the hardware profile has no host_link_gbps"),
        (["hardware=cpu", "plan.link=pcie_gen5"], "error: plan.hbm_budget_gb: hardware profile 'cpu' has no hbm_bytes"),
    ],
)
def test_cli_bad_input(args, message, capsys):
    assert zp.main([*BASE, *args]) == 2  # a later hardware= wins over BASE's
    err = capsys.readouterr().err.strip()
    assert err.startswith(message), err


def _plan_json(tmp_path, *args):
    out = tmp_path / f"plan{len(list(tmp_path.glob('plan*.json')))}.json"
    assert zp.main([*args, "plan.hbm_budget_gb=200", f"plan.out={tmp_path / 'p.yaml'}", f"plan.json={out}"]) == 0
    return json.loads(out.read_text())


def test_cli_update_phase_of_llama_1b_drops_with_the_optimizer_on_host(tmp_path, capsys):
    """llama_1b (16 layers, head tied to the embedding; AdamW moments 9.9 GB): with
    [full,optimizer_host] the update phase holds the parameters and gradients and two layers'
    moments (the embedding's come in runs of rows no larger than that), no longer all of them."""
    base = ["model=llama_1b", "mesh=single", "hardware=h100_pcie", "data.batch_size=1", "data.seq_len=256"]
    device = _plan_json(tmp_path, *base, "offload=full")
    host = _plan_json(tmp_path, *base, "offload=[full,optimizer_host]")
    assert "update streamed layer by layer" in capsys.readouterr().out
    params, opt = device["info"]["param_bytes"], device["info"]["opt_bytes"]
    assert device["estimate"]["update_phase_bytes"] == pytest.approx(2 * params + opt)
    outside = 2 * 128256 * 2048 * 4  # both moments of the embedding (final norm: a few kB)
    layer = 2 * (opt - outside) / 16
    assert host["estimate"]["update_phase_bytes"] == pytest.approx(2 * params + layer, rel=1e-5)
    assert host["estimate"]["update_phase_bytes"] < device["estimate"]["update_phase_bytes"] - 0.5 * opt


def test_cli_counts_the_attention_that_runs_on_the_planned_hardware(tmp_path, capsys):
    """Planning for a GPU on this CPU: `auto` is cuDNN there for half precision (no T x T scores),
    an explicit cudnn is accepted; with float32 compute `auto` is blockwise, and xla keeps the scores."""
    base = [
        "model=llama_tiny_a",
        "mesh=single",
        "hardware=h100_pcie",
        "data.batch_size=2",
        "data.seq_len=1024",
        "model.max_position_embeddings=1024",
    ]
    half = ["model.compute_dtype=bfloat16"]
    got = {
        name: _plan_json(tmp_path, *base, *extra)["info"]
        for name, extra in (
            ("auto_bf16", half),
            ("cudnn", [*half, "model.attention_impl=cudnn"]),
            ("auto_f32", []),
            ("xla", ["model.attention_impl=xla"]),
        )
    }
    assert "counted: attention cudnn on h100_pcie (model.attention_impl=auto)" in capsys.readouterr().out
    assert [got[k]["attention_impl"] for k in ("auto_bf16", "cudnn", "auto_f32", "xla")] == [
        "cudnn",
        "cudnn",
        "blockwise",
        "xla",
    ]
    assert got["xla"]["attention_working_bytes"] == 2 * 2 * 4 * 1024**2 * 4
    assert got["auto_f32"]["attention_working_bytes"] < got["xla"]["attention_working_bytes"] / 5


def test_cli_loss_chunk_size_is_a_key_and_is_counted(tmp_path):
    base = ["model=llama_tiny_a", "mesh=single", "hardware=h100_pcie", "data.batch_size=2", "data.seq_len=64"]
    whole = _plan_json(tmp_path, *base, "trainer.loss_chunk_size=0")["info"]
    chunked = _plan_json(tmp_path, *base, "trainer.loss_chunk_size=16")["info"]
    assert whole["loss_chunk_size"] == 0 and chunked["loss_chunk_size"] == 16
    assert whole["loss_working_bytes"] == 3 * 2 * 64 * 256 * 4
    assert chunked["loss_working_bytes"] == 2 * 16 * 256 * 4 + 64 * 256 * 4 + 2 * 64 * 64 * 4


@pytest.mark.parametrize(
    "args, message",
    [
        (
            ["hardware=cpu", "plan.link=pcie_gen5", "plan.hbm_budget_gb=80", "model.attention_impl=cudnn"],
            "error: model.attention_impl: cudnn needs a GPU (backend is cpu); valid choices: auto, xla, blockwise, "
            "cudnn, splash (planning for hardware=cpu)",
        ),
        (
            ["model.attention_impl=flash"],
            "error: model.attention_impl: got 'flash'; choose one of auto, xla, blockwise, cudnn, splash",
        ),
        (
            ["trainer.loss_chunk_size=-3"],
            "error: trainer.loss_chunk_size: must be >= 0 (sequence positions per chunk, any size, or 0 for the whole",
        ),
        (
            ["trainer.loss_chunk_size=big"],
            "error: trainer.loss_chunk_size: Value 'big' of type 'str' could not be converted to Integer",
        ),
    ],
)
def test_cli_bad_kernel_settings_are_one_line(args, message, capsys):
    assert zp.main([*BASE, *args]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and err.startswith(message), err


def test_measure_hardware_writes_a_profile_train_py_accepts(tmp_path, capsys):
    from zoo.tools.measure_hardware import main as measure_main
    from zoo.train.run_config import load_group

    out = tmp_path / "here.yaml"
    assert measure_main(["name=here", f"out={out}", "n=128", "transfer_mb=4", "repeats=2", "chain=2"]) == 0
    hw = load_group("hardware", OmegaConf.load(out))
    assert hw.name == "here" and hw.matmul_flops > 0 and hw.peak_flops == hw.matmul_flops
    assert hw.host_link_gbps > 0 and not hw.nominal and "measured" in hw.note and hw.platform == "cpu"
    assert hw.host_link_gbps == min(hw.host_to_device_gbps, hw.device_to_host_gbps)  # measured inside a program
    # nothing moves inside an XLA:CPU program, so whether the link is duplex is not measured: the default
    assert "host_link_duplex" not in OmegaConf.load(out) and hw.host_link_duplex
    assert measure_main(["n=3"]) == 2
    from zoo.tools.kit import check_output

    assert check_output(out, "out", "measure_hardware", "overwrite=true") == out  # its own: measured again over it


def test_cli_writes_into_hydra_run_dir_and_prints_how_to_train_with_the_plan(tmp_path, monkeypatch, capsys):
    from zoo.offload import conf_dir
    from zoo.tools.kit import compose

    monkeypatch.chdir(tmp_path)
    assert zp.main([*BASE, "plan.hbm_budget_gb=80", "plan.name=mine", f"hydra.run.dir={tmp_path / 'plan_run'}"]) == 0
    written = list(tmp_path.rglob("mine.yaml"))
    assert written == [tmp_path / "plan_run" / "offload" / "mine.yaml"], written  # not under ./outputs/plan
    assert not (conf_dir() / "offload" / "mine.yaml").exists()
    printed = capsys.readouterr().out
    assert f"wrote {written[0]}" in printed
    train = next(ln for ln in printed.splitlines() if ln.startswith("train with it: python train.py "))
    search = f"hydra.searchpath=[file://{written[0].resolve().parent.parent}]"
    assert f"'{search}' offload=mine" in train
    assert "hydra.run.dir" not in train and "data.seq_len=16" in train  # the plan's run directory is not the training's
    assert compose([*BASE, search, "offload=mine"]).offload.name == "mine"  # the printed way finds it


@pytest.mark.parametrize("key", ["plan.out", "plan.json"])
def test_cli_unwritable_output_is_one_line_before_planning(key, capsys):
    assert zp.main([*BASE, "plan.hbm_budget_gb=80", f"{key}=/proc/zoo/x.yaml"]) == 2
    err = capsys.readouterr()
    assert (
        err.err.strip().startswith(f"error: {key}: cannot write /proc/zoo") and len(err.err.strip().splitlines()) == 1
    )
    assert "planning" not in err.out


def test_planner_counts_the_layer_inputs_the_sequence_parallel_program_keeps(tmp_path, capsys):
    # Sequence parallelism splits the kept layer inputs along the sequence over tensor (2 here): the
    # planner's decoder_layer_input is what the partitioned program holds per device (zoo.tools.scale reads
    # it there), half of what the same mesh holds without it.
    import re

    from zoo import hlo
    from zoo.tools import scale
    from zoo.tools.kit import prepare_step

    args = ["model=llama_tiny_a", "mesh=fsdp_tp", "data.batch_size=8", "data.seq_len=32", "offload=full"]
    printed = {}
    for sp in ("true", "false"):
        assert (
            zp.main([*args, f"mesh.sequence_parallel={sp}", "hardware=h100_pcie", f"plan.out={tmp_path / sp}.yaml"])
            == 0
        )
        printed[sp] = re.search(r"^decoder_layer_input\s+(\S+ \S+)", capsys.readouterr().out, re.M).group(1)
    _, _, _, trainer, _ = prepare_step([*args, "mesh.sequence_parallel=true"])
    _, text = hlo.compile_with_partitioned_hlo(trainer.lower(), trainer.compiler_options)
    kept = scale.kept_layer_inputs(trainer, text, per_device_batch=2)  # 8 sequences over fsdp 4
    assert kept["stacks"][0]["shape"].endswith("[2,2,16,64]"), kept  # 2 layers, 2 sequences, 16 of 32 positions
    assert printed["true"] == fmt_bytes(float(kept["bytes"]))
    assert printed["false"] == fmt_bytes(2.0 * kept["bytes"])


def _planned_on(mesh: str, *overrides: str):
    """(trainer, planning problem) of llama_tiny_a, 8 sequences of 32 on the 8 devices of `mesh`, under `full`."""
    from zoo.tools.kit import prepare_step

    args = ["model=llama_tiny_a", f"mesh={mesh}", "data.batch_size=8", "data.seq_len=32", "offload=full", *overrides]
    c, _, _, trainer, _ = prepare_step(args)
    return trainer, problem_from_config(c, trainer, PlanConfig())[0]


def test_planner_counts_each_devices_share_of_the_flops_under_tensor_parallelism():
    # 8 sequences on 8 devices, by FSDP alone or FSDP 4 x tensor 2: each device does the same work, so
    # the recompute FLOPs and a layer's forward (what hides transfers) per device are the same both ways
    # (the formulas count a data-parallel rank's whole heads and MLP: tensor 2 halves them).
    got = {}
    for mesh in ("fsdp", "fsdp_tp"):
        _, p = _planned_on(mesh, "hardware=h100_pcie")
        (s,) = p.stacks
        got[mesh] = (
            p.step_flops,
            p.stacks[s].forward_flops_per_layer,
            {t.tag: t.recompute_flops_per_layer[s] for t in p.tags},
        )
    assert got["fsdp"] == got["fsdp_tp"]
    assert got["fsdp"][2]["mlpwi_0"] > 0


def test_planner_looks_up_each_ops_rate_at_the_width_one_device_computes():
    # With a profile's measured op rates (tpu_v5e's), an MLP of 1024 over tensor 2 runs at the rate of a
    # 512-wide matmul, as an MLP of 512 without tensor parallelism does, not at the 1024-wide one's.
    def slowness(mesh, width):
        trainer, p = _planned_on(mesh, f"model.intermediate_size={width}", "hardware=tpu_v5e")
        (s,) = p.stacks
        (t,) = [t for t in p.tags if t.tag == "mlpwi_0"]
        batch, share = (2, 2) if mesh == "fsdp_tp" else (1, 1)  # sequences per data-parallel rank, tensor ways
        per_device = producer_flops(trainer.cfg.model, "mlpwi_0", s, batch, 32) / share
        return t.recompute_flops_per_layer[s] / per_device

    split, narrow, wide = slowness("fsdp_tp", 1024), slowness("fsdp", 512), slowness("fsdp", 1024)
    assert split == pytest.approx(narrow) and split != pytest.approx(wide), (split, narrow, wide)
    # Heads that do not split evenly round up and stay a valid config: 10 heads in 5 groups over 4 ways.
    odd = per_device_widths(
        SIZES["llama_tiny_a"].replace(num_heads=10, num_kv_heads=5),
        {"heads": ["tensor"], "kv_heads": ["tensor"]},
        {"tensor": 4},
    )
    assert (odd.num_heads, odd.num_kv_heads) == (3, 1)


def test_planner_sizes_each_tag_as_the_partitioned_program_keeps_it():
    # Tensor parallelism (2 ways, fsdp 4) splits the heads and the MLP hidden dim: every tag kept on
    # device, each tag's per-device bytes in the planner are those of the array the partitioned program
    # stacks over the layers for it ([layers, per-device batch, seq, ...]), not the traced whole size.
    import re

    from zoo import hlo
    from zoo.tools.kit import prepare_step

    keep = [
        f"offload.tags.{t}=device"
        for t in (
            "decoder_layer_input",
            "query_proj",
            "key_proj",
            "value_proj",
            "context",
            "out_proj",
            "mlpwi_0",
            "mlpwi_1",
        )
    ]
    args = [
        "model=llama_tiny_a",
        "model.intermediate_size=96",
        "mesh=fsdp_tp",
        "data.batch_size=8",
        "data.seq_len=32",
        "hardware=h100_pcie",
        "offload=custom",
        *keep,
    ]
    c, _, _, trainer, _ = prepare_step(args)
    p, _ = problem_from_config(c, trainer, PlanConfig())
    (stack,) = p.stacks
    planned = {t.tag: t.bytes_per_layer[stack] for t in p.tags}
    _, text = hlo.compile_with_partitioned_hlo(trainer.lower(), trainer.compiler_options)
    kept = {
        tuple(map(int, dims.split(","))): hlo.dtype_bytes(dtype)
        for dtype, dims in re.findall(r"\b([a-z]+[0-9]*)\[(2,2,32,[\d,]+)\]", text)
    }
    # 2 layers x 2 sequences x 32 positions x: 4 heads / 2 of 16, 2 kv heads / 2, 96 hidden / 2, embed 64.
    per_device = {
        "query_proj": (2, 16),
        "key_proj": (1, 16),
        "value_proj": (1, 16),
        "context": (2, 16),
        "out_proj": (64,),
        "mlpwi_0": (48,),
        "mlpwi_1": (48,),
        "decoder_layer_input": (64,),
    }
    whole = {
        "query_proj": (4, 16),
        "context": (4, 16),
        "mlpwi_0": (96,),
        "mlpwi_1": (96,),
    }  # whole k/v: the queries' per-device shape
    assert set(planned) == set(per_device), planned
    for tag, rest in per_device.items():
        shape = (2, 2, 32, *rest)
        assert shape in kept, (tag, shape, sorted(kept))
        assert planned[tag] == math.prod(shape[1:]) * kept[shape], (tag, planned[tag])
    for tag, rest in whole.items():
        assert (2, 2, 32, *rest) not in kept, (tag, "the program keeps no whole-size copy")


def test_per_device_shape_follows_the_rules_and_refuses_an_unknown_layout():
    rules = {
        "batch": ["data", "fsdp"],
        "seq": ["tensor"],
        "embed": ["fsdp"],
        "heads": ["tensor"],
        "kv_heads": ["tensor"],
        "mlp": ["tensor"],
        "experts": ["expert"],
    }
    sizes = {"data": 1, "fsdp": 4, "tensor": 8, "expert": 1}
    assert per_device_shape("query_proj", (2, 64, 16, 8), rules, sizes) == (2, 64, 2, 8)
    assert per_device_shape("key_proj", (2, 64, 4, 8), rules, sizes) == (
        2,
        64,
        1,
        8,
    )  # 4 kv heads over 8: padded to 1
    assert per_device_shape("decoder_layer_input", (2, 64, 32), rules, sizes) == (
        2,
        8,
        32,
    )  # embed's fsdp taken by batch
    assert per_device_shape("moe_mlpwi_0", (96, 40), rules, sizes) == (
        96,
        5,
    )  # routed rows as traced, mlp over tensor
    assert per_device_shape("query_proj", (2, 64, 16, 8)) == (2, 64, 16, 8)  # no rules: as traced
    with pytest.raises(PlanError, match="query_proj"):
        per_device_shape("query_proj", (2, 64, 128), rules, sizes)


def test_planner_counts_the_lora_adapters_as_state_and_the_frozen_base_where_it_lives():
    # LoRA: the trainable state is the adapters (their AdamW moments the optimizer state); the frozen
    # base is counted once, with no gradient and no moments, on device or, with lora.base_on_host, in
    # host memory with two layers in flight on device and streamed in per layer (forward and backward).
    from zoo.plan.cost import fixed_bytes, host_fixed_parts, state_transfer_s
    from zoo.tools.kit import prepare_step

    base = ["model=llama_tiny_a", "mesh=single", "data.batch_size=4", "data.seq_len=32", "hardware=h100_pcie"]
    problems = {}
    for name, extra in (
        ("full", []),
        ("lora", ["lora=default", "lora.rank=2"]),
        ("host", ["lora=default", "lora.rank=2", "lora.base_on_host=true"]),
    ):
        c, _, _, trainer, _ = prepare_step([*base, *extra])
        problems[name] = (problem_from_config(c, trainer, PlanConfig())[0], trainer)
    full, _ = problems["full"]
    lora_p, trainer = problems["lora"]
    host, _ = problems["host"]
    adapters = sum(x.size * x.dtype.itemsize for x in jax.tree.leaves(trainer.abstract_params))
    assert lora_p.param_bytes == adapters < full.param_bytes / 8
    assert lora_p.frozen_bytes == full.param_bytes and not lora_p.frozen_on_host
    assert (
        2 * adapters <= lora_p.opt_bytes <= 2 * adapters + 16
    )  # AdamW's two moments of the adapters (and its step count)
    # On device: the base once, no gradient or moments for it.
    assert (
        fixed_bytes(lora_p)[0] - lora_p.other_bytes - lora_p.working_bytes
        == full.param_bytes + 2 * adapters + lora_p.opt_bytes
    )
    # On host: the host holds the base; the device two layers of it in flight and what lies outside the stacks.
    assert host.frozen_on_host and host_fixed_parts(host)["frozen LoRA base"] == full.param_bytes
    layer = host.frozen_layer_bytes
    assert 0 < layer and host.stack_frozen_bytes == 2 * layer  # llama_tiny_a: 2 equal layers
    assert fixed_bytes(host)[0] == fixed_bytes(lora_p)[0] - host.stack_frozen_bytes + 2 * layer
    assert state_transfer_s(host) * host.link == pytest.approx(
        2 * host.stack_frozen_bytes + host.frozen_bytes - host.stack_frozen_bytes
    )
    assert state_transfer_s(lora_p) == 0.0


def test_a_tag_without_a_flop_formula_is_an_error_not_free():
    """producer_flops names a tag it has no formula for instead of costing its recomputation 0 FLOPs;
    every tag each family's stacks emit has one."""
    from zoo.model import stack_layout
    from zoo.tags import MOE, TAGS, emitted_tags

    with pytest.raises(ValueError, match="no FLOP count for tag 'made_up'"):
        producer_flops(SIZES["llama_tiny_a"], "made_up", "layers", 2, 16)
    for name in ("llama_tiny_a", "dsv3_tiny_a", "gemma3_tiny_a", "gpt_oss_tiny_a"):
        c = SIZES[name]
        for stack, *_ in stack_layout(c):
            assert layer_forward_flops(c, stack, 2, 16) > 0
            moe = any(c.is_moe_layer(i) for i in stack_layers(c, stack))
            for t in emitted_tags(c):
                if moe or TAGS[t].block != MOE:
                    assert producer_flops(c, t, stack, 2, 16) >= 0


def test_planner_sizes_each_tag_as_the_context_parallel_program_keeps_it():
    # Context parallelism over data (2 ways; the batch over fsdp 4): every tag, inside attention and the
    # MLP too, is a chunk of 16 of the 32 positions per device; the planner's per-device bytes are those
    # of the arrays the partitioned program stacks over the layers, and no whole-sequence copy is kept.
    import re

    from zoo import hlo
    from zoo.sharding import CONTEXT
    from zoo.tools.kit import prepare_step

    rules = {
        "batch": ["fsdp"],
        "seq": ["data"],
        CONTEXT: ["data"],
        "embed": ["fsdp"],
        "heads": ["tensor"],
        "mlp": ["tensor"],
    }
    sizes = {"data": 2, "fsdp": 4, "tensor": 1, "expert": 1}
    assert per_device_shape("moe_mlpwi_0", (96, 40), rules, sizes) == (48, 40)  # the routed rows of a chunk's tokens
    assert per_device_shape("moe_mlpwi_0", (8, 12, 40), rules, sizes) == (
        8,
        6,
        40,
    )  # capacity buffers: [experts, rows, mlp]
    keep = [
        f"offload.tags.{t}=device"
        for t in (
            "decoder_layer_input",
            "query_proj",
            "key_proj",
            "value_proj",
            "context",
            "out_proj",
            "mlpwi_0",
            "mlpwi_1",
        )
    ]
    args = [
        "model=llama_tiny_a",
        "model.intermediate_size=96",
        "mesh=fsdp",
        "mesh.data=2",
        "mesh.context_parallel=data",
        "data.batch_size=8",
        "data.seq_len=32",
        "hardware=h100_pcie",
        "offload=custom",
        *keep,
    ]
    c, _, _, trainer, _ = prepare_step(args)
    p, _ = problem_from_config(c, trainer, PlanConfig())
    (stack,) = p.stacks
    planned = {t.tag: t.bytes_per_layer[stack] for t in p.tags}
    _, text = hlo.compile_with_partitioned_hlo(trainer.lower(), trainer.compiler_options)
    kept = {
        tuple(map(int, dims.split(","))): hlo.dtype_bytes(dtype)
        for dtype, dims in re.findall(r"\b([a-z]+[0-9]*)\[(2,2,(?:16|32),[\d,]+)\]", text)
    }
    per_device = {
        "query_proj": (4, 16),
        "key_proj": (2, 16),
        "value_proj": (2, 16),
        "context": (4, 16),
        "out_proj": (64,),
        "mlpwi_0": (96,),
        "mlpwi_1": (96,),
        "decoder_layer_input": (64,),
    }
    assert set(planned) == set(per_device), planned
    for tag, rest in per_device.items():
        shape = (2, 2, 16, *rest)
        assert shape in kept, (tag, shape, sorted(kept))
        assert planned[tag] == math.prod(shape[1:]) * kept[shape], (tag, planned[tag])
        assert (2, 2, 32, *rest) not in kept, (tag, "the program keeps no whole-sequence copy")


def test_dropless_expert_parallel_tags_are_sized_as_the_first_rounds_blocks():
    # Traced per data-parallel rank, a routed-expert tag has one row per assignment; under expert
    # parallelism the dropless kernel's tags are its first round's blocks, ep x round_block rows
    # (zoo.nn.expert_rounds: 1.25x the assignments at 671B), kept, offloaded or recomputed as any tag.
    import dataclasses
    import types

    from zoo.families import SIZES
    from zoo.nn.expert_rounds import round_block
    from zoo.nn.moe_dispatch import exchanges_in_rounds
    from zoo.plan.pricing import tag_costs
    from zoo.plan.problem import CHOICES
    from zoo.sharding import DEFAULT_RULES

    auto = SIZES["deepseek_v3_671b"]  # 256 experts, top-8
    capacity = auto.replace(moe=dataclasses.replace(auto.moe, impl="capacity"))
    rules, sizes = {**DEFAULT_RULES, "experts": ["expert"], "batch": ["fsdp", "expert"]}, {"expert": 8, "fsdp": 16}
    assert exchanges_in_rounds(auto.moe.impl, rules, sizes)
    assert not exchanges_in_rounds(capacity.moe.impl, rules, sizes)
    assert not exchanges_in_rounds(auto.moe.impl, rules, {"expert": 1, "fsdp": 128})
    tokens = 8 * 4096
    record = types.SimpleNamespace(
        tag="moe_mlpwi_0", stack="moe_layers", shape=(tokens * 8, 2048), bytes_per_layer=tokens * 8 * 2048 * 2.0
    )
    layer_input = types.SimpleNamespace(
        tag="decoder_layer_input", stack="moe_layers", shape=(8, 4096, 7168), bytes_per_layer=8 * 4096 * 7168 * 2.0
    )

    def costs(config, sizes=sizes):
        return {t.tag: t for t in tag_costs(config, [record, layer_input], 8, 4096, rules=rules, sizes=sizes)}

    dropless, kept, one_shard = costs(auto), costs(capacity), costs(auto, {"expert": 1, "fsdp": 128})
    rows = 8 * round_block(tokens, 8, 8, 32, auto.moe.exchange_factor)
    assert dropless["moe_mlpwi_0"].bytes_per_layer["moe_layers"] == rows * 2048 * 2.0
    assert (
        kept["moe_mlpwi_0"].bytes_per_layer["moe_layers"]
        == one_shard["moe_mlpwi_0"].bytes_per_layer["moe_layers"]
        == record.bytes_per_layer
    )
    assert dropless["moe_mlpwi_0"].choices == kept["moe_mlpwi_0"].choices == CHOICES
    assert dropless["decoder_layer_input"].bytes_per_layer == kept["decoder_layer_input"].bytes_per_layer


def test_a_tpu_profile_plans_its_kernels_here_and_counts_each_residual_of_a_layer(capsys):
    """Planning for hardware=tpu_v5e on a CPU traces splash and megablox interpreted (not refused), and
    splash's two residuals under the context tag (output and softmax statistics) both count per layer,
    as that tag only: named inside the kernel's jit, they once also counted as untagged residuals (the
    attention output twice over under every policy; a TPU v5e keeps it once or not at all)."""
    from zoo.backend import lowering_for, pallas_interpreted

    assert (
        zp.main(
            [
                "model=llama_tiny_a",
                "mesh=single",
                "data.batch_size=2",
                "data.seq_len=128",
                "hardware=tpu_v5e",
                "model.attention_impl=splash",
                "plan.out=/dev/null",
            ]
        )
        == 0
    )
    assert "counted: attention splash on tpu_v5e" in capsys.readouterr().out
    m = SIZES["llama_tiny_a"].replace(attention_impl="splash")
    policy = remat_policy(from_mapping({"name": "ctx", "checkpoint": True, "tags": {"context": "device"}}), m)
    abstract = zoo.model.abstract(m)
    with lowering_for("tpu"), pallas_interpreted():
        placement = inspect_placement(
            jax.grad(lambda mod, t: zoo.model.loss_fn(mod, t, remat_policy=policy)),
            abstract,
            jax.ShapeDtypeStruct((2, 128), jnp.int32),
            stacks=stack_names(abstract),
        )
    (record,) = [r for r in placement.records if r.tag == "context"]
    batch, kv, group, t, d = record.shape
    # the output (compute dtype) and the float32 statistics, not their average
    assert record.bytes_per_layer == batch * kv * group * t * (d * jnp.dtype(record.dtype).itemsize + 4)
    assert record.placement == "device"
    assert [o for o in placement.other if o.shape[-1:] in ((d,), (t,))] == [], placement.other


def test_a_tpu_counts_each_kept_tag_in_its_compilers_tiles():
    """On a TPU a tag's two minor dimensions are stored in whole tiles of 8 x 128 elements (the v5e's
    compiled buffers: [.., 8, 96] queries 4/3 of their size, [.., 8, 64] keys twice, [.., 32, 64] and
    [.., 4096, 160] their own size); elsewhere as traced."""
    import types

    from zoo.backend import choices
    from zoo.plan.pricing import tag_costs, tiled_elements

    tile = choices("tpu").layout_tile_elements
    assert tile == 1024 and choices("cpu").layout_tile_elements == 1
    shapes = {"query_proj": (2, 4096, 8, 96), "key_proj": (2, 4096, 8, 64), "value_proj": (2, 4096, 32, 64),
              "kv_wa_proj": (2, 4096, 160)}  # fmt: skip
    records = [
        types.SimpleNamespace(tag=t, stack="layers", shape=s, bytes_per_layer=2.0 * math.prod(s))
        for t, s in shapes.items()
    ]
    m = SIZES["dsv3_tiny_a"]
    tiled = {t.tag: t.bytes_per_layer["layers"] for t in tag_costs(m, records, 2, 4096, tile=tile)}
    as_traced = {t.tag: t.bytes_per_layer["layers"] for t in tag_costs(m, records, 2, 4096)}
    assert {t: tiled[t] / as_traced[t] for t in shapes} == pytest.approx(
        {"query_proj": 4 / 3, "key_proj": 2.0, "value_proj": 1.0, "kv_wa_proj": 1.0}
    )
    assert tiled_elements((3, 5), 1024) == 1024 and tiled_elements((7,), 1024) == 1024
    assert tiled_elements((2, 3, 5), 1) == 30
