"""docs/scale.md's planner commands, run as written (each in a process of its own, as a user runs
them, on 128 simulated devices), print the figures the doc quotes. They once stopped with "JAX
already started in this process with other XLA flags" for two days and no test ran them."""

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


def planner_commands(text: str) -> list[list[str]]:
    """The commands of the first bash block under "## Against the planner"."""
    section = text.split("## Against the planner", 1)[1]
    block = section.split("```bash", 1)[1].split("```", 1)[0]
    return [shlex.split(line) for line in block.replace("\\\n", " ").strip().splitlines()]


@pytest.mark.slow
def test_the_planner_commands_of_docs_scale_print_what_the_doc_quotes(tmp_path):
    text = DOC.read_text()
    quoted = re.search(
        r"`decoder_layer_input` ([\d.]+) GB and ([\d.]+) GB\) plus its working set \(`working_bytes` in\s+plan\.json: ([\d.]+) GB and ([\d.]+) GB\)",
        text,
    )
    assert quoted, "docs/scale.md no longer quotes the planner's layer inputs and working sets in the form this test reads"
    layer_inputs, working = quoted.groups()[:2], quoted.groups()[2:]
    commands = planner_commands(text)
    assert len(commands) == 2 and all(c[:3] == ["python", "-m", "zoo.plan"] for c in commands), commands
    env = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"}  # the command's xla.cpu_devices decides
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT), env.get("PYTHONPATH", "")])
    for command, layer_input, work in zip(commands, layer_inputs, working):
        # Run where the relative plan.json and outputs/ land in tmp_path.
        p = subprocess.run([sys.executable, *command[1:]], cwd=tmp_path, env=env, capture_output=True, text=True, timeout=600)
        assert p.returncode == 0, f"$ {shlex.join(command)}\n{p.stderr[-2000:]}"
        assert re.search(rf"^decoder_layer_input\s+{re.escape(layer_input)} GB\s", p.stdout, re.M), p.stdout[-3000:]
        plan_json = next(a.split("=", 1)[1] for a in command if a.startswith("plan.json="))
        info = json.loads((tmp_path / plan_json).read_text())["info"]
        assert f"{info['working_bytes'] / 1e9:.3f}" == work, (shlex.join(command), info["working_bytes"])
