"""docs/scale.md's commands, run as written (each in a process of its own, as a user runs them, on
128 simulated devices), print the figures the doc quotes (those that do not depend on the CPU). The planner's once
stopped with "JAX already started in this process with other XLA flags" for two days, and the report's figures had
drifted from the code, while no test ran them."""

import json
import os
import pathlib
import re
import shlex
import subprocess
import sys

import pytest

ROOT = pathlib.Path(__file__).resolve().parent.parent
DOC = ROOT / "docs" / "scale.md"


def commands_and_output(text: str, heading: str) -> tuple[list[list[str]], list[str]]:
    """The commands of the first bash block under `heading`, and the lines of the plain block after it."""
    section = text.split(heading, 1)[1]
    block, rest = section.split("```bash", 1)[1].split("```", 1)
    section_rest = rest.split("\n## ", 1)[0]
    output = section_rest.split("```\n", 1)[1].split("```", 1)[0] if "```\n" in section_rest else ""
    return [shlex.split(line) for line in block.replace("\\\n", " ").strip().splitlines()], output.splitlines()


def planner_commands(text: str) -> list[list[str]]:
    return commands_and_output(text, "## Against the planner")[0]


def _env() -> dict:
    env = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"}  # the command's xla.cpu_devices decides
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT), env.get("PYTHONPATH", "")])
    return env


@pytest.mark.slow
@pytest.mark.parametrize(
    "heading",
    [
        "## DeepSeek-V3 671B: fsdp 16 x expert 8",
        "## Llama 3.1 405B: fsdp 16 x tensor 8, sequence parallel",
        "## Context parallelism: Llama 3.1 405B at 131,072 positions",
    ],
)
def test_the_scale_reports_of_docs_scale_print_what_the_doc_shows(heading, tmp_path):
    (command,), shown = commands_and_output(DOC.read_text(), heading)
    assert command[:3] == ["python", "-m", "zoo.tools.inspect_step"], command
    # The doc's state bytes and the collectives SPMD partitioning chose. Not what XLA:CPU's own passes
    # made of them afterwards (compiled memory, compiled collectives), which may differ between the
    # CPUs this suite runs on; nor the largest collectives, abridged in the doc by hand.
    end = next(i for i, ln in enumerate(shown) if ln.startswith("collectives per step (compiled)"))
    shown = [ln for ln in shown[:end] if not ln.startswith("compiled:")]
    assert shown[0].startswith("scale: 128 devices") and len(shown) >= 6, shown
    p = subprocess.run(
        [sys.executable, *command[1:], f"hydra.run.dir={tmp_path}"],
        cwd=tmp_path,
        env=_env(),
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert p.returncode == 0, f"$ {shlex.join(command)}\n{p.stderr[-2000:]}"
    printed = {" ".join(line.split()) for line in p.stdout.splitlines()}
    missing = [line for line in shown if " ".join(line.split()) not in printed]
    assert not missing, (
        f"$ {shlex.join(command)} no longer prints these lines of docs/scale.md (re-measure it):\n" + "\n".join(missing)
    )


@pytest.mark.slow
def test_the_planner_commands_of_docs_scale_print_what_the_doc_quotes(tmp_path):
    text = DOC.read_text()
    quoted = re.search(
        r"`decoder_layer_input` ([\d.]+) GB and ([\d.]+) GB\) plus its working set \(`working_bytes` in\s+plan\.json: "
        r"([\d.]+) GB and ([\d.]+) GB\)",
        text,
    )
    assert quoted, (
        "docs/scale.md no longer quotes the planner's layer inputs and working sets in the form this test reads"
    )
    layer_inputs, working = quoted.groups()[:2], quoted.groups()[2:]
    commands = planner_commands(text)
    assert len(commands) == 2 and all(c[:3] == ["python", "-m", "zoo.tools.plan"] for c in commands), commands
    env = _env()
    for command, layer_input, work in zip(commands, layer_inputs, working):
        # Run where the relative plan.json and outputs/ land in tmp_path.
        p = subprocess.run(
            [sys.executable, *command[1:]], cwd=tmp_path, env=env, capture_output=True, text=True, timeout=600
        )
        assert p.returncode == 0, f"$ {shlex.join(command)}\n{p.stderr[-2000:]}"
        assert re.search(rf"^decoder_layer_input\s+{re.escape(layer_input)} GB\s", p.stdout, re.M), p.stdout[-3000:]
        plan_json = next(a.split("=", 1)[1] for a in command if a.startswith("plan.json="))
        info = json.loads((tmp_path / plan_json).read_text())["info"]
        assert f"{info['working_bytes'] / 1e9:.3f}" == work, (shlex.join(command), info["working_bytes"])


@pytest.mark.slow
@pytest.mark.parametrize("heading", ["### DeepSeek-V3 671B, 4 layers", "### Llama 3.1 405B, 2 layers"])
def test_the_gpu_lowering_tables_of_docs_scale_print_what_the_doc_shows(heading, tmp_path):
    """Every offloaded residual of the traced step keeps its host placement in the cuda lowering (and
    none in the CPU one); host-resident state is marked in both; the table is the one the doc shows."""
    (command,), shown = commands_and_output(DOC.read_text(), heading)
    assert command[:3] == ["python", "-m", "zoo.tools.gpu_lowering"], command
    p = subprocess.run(
        [sys.executable, *command[1:]], cwd=tmp_path, env=_env(), capture_output=True, text=True, timeout=600
    )
    assert p.returncode == 0, f"$ {shlex.join(command)}\n{p.stderr[-2000:]}"
    printed = [line.split() for line in p.stdout.splitlines()]
    assert [line.split() for line in shown] == printed, (
        f"$ {shlex.join(command)} prints another table than docs/scale.md (re-measure it):\n{p.stdout}"
    )
    rows = {r[0]: r for r in printed[1:]}
    for preset in ("minimal_offloaded", "qkv_proj_offloaded", "llama_qkv_offload", "deepseek_mla_moe_offload"):
        _, tags, traced, state, cpu, cuda, cpu_kinds, cuda_kinds = rows[preset]
        assert int(tags) > 0 and int(cuda) == int(traced) > 0 and int(cpu) == 0 and state == "-", rows[preset]
    for preset in ("none", "full", "minimal", "save_qkv_proj", "custom"):
        assert rows[preset][1:] == ["0", "0", "-", "0", "0", "0", "0"], rows[preset]
    for preset in ("optimizer_host", "params_host"):
        _, _, traced, _, cpu, cuda, cpu_kinds, cuda_kinds = rows[preset]
        assert int(cuda_kinds) == int(cpu_kinds) > 0 and int(cuda) >= int(cpu) > 0, rows[preset]


@pytest.mark.slow
def test_the_dropless_exchange_lowered_for_gpu_prints_what_the_doc_shows(tmp_path):
    """The 671B step (dropless by default) lowered for cuda exchanges blocks of 1.25x the mean rows per
    (device, shard): [8, 40960, 7168] against 262,144 assignment rows; the lines are the doc's."""
    (command,), shown = commands_and_output(
        DOC.read_text(), "### DeepSeek-V3 671B's dropless exchange, lowered for GPU"
    )
    assert command[:3] == ["python", "-m", "zoo.tools.gpu_lowering"] and not any("moe.impl" in a for a in command), (
        command
    )
    p = subprocess.run(
        [sys.executable, *command[1:]], cwd=tmp_path, env=_env(), capture_output=True, text=True, timeout=600
    )
    assert p.returncode == 0, f"$ {shlex.join(command)}\n{p.stderr[-2000:]}"
    assert [line.split() for line in shown] == [line.split() for line in p.stdout.splitlines()], p.stdout
    blocks = [tuple(map(int, m)) for m in re.findall(r"all_to_all of bf16\[(\d+),(\d+),7168\]", p.stdout)]
    assignments = 8 * 4096 * 8  # 8 sequences x 4096 tokens x top-8 per device
    assert blocks and all(shards * rows <= 1.5 * assignments for shards, rows in blocks), (
        blocks
    )  # the bound on the exchange
