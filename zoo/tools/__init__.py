"""The command-line tools and their shared kit, apart from the library.

Each module here with a `__main__` block is a command, `python -m zoo.tools.<name>`: the inspector
(`inspect_step`), the planner (`plan`, with `scale`, the per-device scale report it and the inspector
print), `report` (sweeps), `generate` (sampling from the command line, over zoo.sampling), `export` (a
checkpoint as a Hugging Face directory, over zoo.train.hf_export), `measure_hardware`, `gpu_lowering`
and `sizes`. `cli` is train.py's command-line edge (one-line errors, exit codes, `run_tool`), which
every tool shares; `kit` holds what the inspector, the planner and the hardware tools build a traced
step from.

The library (everything under `zoo` outside this package) never imports it, so a tool can be renamed
or removed without touching research code; tests/test_imports.py checks that, and that there is no
import cycle.
"""
