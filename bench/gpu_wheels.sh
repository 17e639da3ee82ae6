#!/usr/bin/env bash
# Wheels bench/gpu.py needs on the GPU image, which has JAX, equinox, optax, jaxtyping, PyYAML and
# matplotlib but not hydra-core (zoo.train.run_config registers its groups in Hydra's ConfigStore), omegaconf
# (configs are read through it) nor its antlr4 runtime.
# Run here, in the repository root; the wheels land in .whl/ (git-ignored through .git/info/exclude).
# Then carry .whl to the GPU machine and install them first (see docs/benchmarks.md, "GPU").
set -euo pipefail
cd "$(dirname "$0")/.."
grep -qx '/.whl/' .git/info/exclude 2>/dev/null || echo '/.whl/' >> .git/info/exclude
mkdir -p .whl
python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
  --platform manylinux_2_17_x86_64 --platform any -d .whl 'omegaconf==2.3.0' 'hydra-core==1.3.2'
# antlr4-python3-runtime 4.9.3 (the version omegaconf 2.3 pins) is published as source only: build its
# pure-Python wheel here.
python3 -m pip wheel -q --no-deps -w .whl 'antlr4-python3-runtime==4.9.3'
ls -l .whl
