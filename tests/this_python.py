"""The interpreter running the tests, as `python` and `python3` for the shell commands they start (the docs'
commands, written `python train.py ...`).

Each name is a two-line script that `exec`s `sys.executable` by its own path, not a symbolic link to it: Python
finds a virtual environment by the `pyvenv.cfg` beside (or one folder above) the path it was started by, so a link
in a folder of its own starts the base interpreter, without the environment's packages (hydra, jax). Nor is the
folder of `sys.executable` put first on PATH: outside an environment that is a system folder (/usr/bin), which
may hold no `python` at all and holds other programs the commands would then pick up.
"""

import os
import pathlib
import shlex
import sys


def on_path(env: dict, bin_dir: pathlib.Path) -> dict:
    """`env` with `bin_dir` (created) first on its PATH, holding `python` and `python3` that run this interpreter."""
    bin_dir.mkdir(parents=True, exist_ok=True)
    for name in ("python", "python3"):
        script = bin_dir / name
        script.write_text(f'#!/bin/sh\nexec {shlex.quote(sys.executable)} "$@"\n')
        script.chmod(0o755)
    return {**env, "PATH": f"{bin_dir}{os.pathsep}{env.get('PATH', '')}"}
