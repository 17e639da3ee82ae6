#!/usr/bin/env bash
# Wheels a TPU machine (the device tool's v5e) lacks for Zoo, for CPython 3.11 x86-64, into .whl-tpu/ of the current directory.
set -euo pipefail
grep -qx '/.whl-tpu/' .git/info/exclude 2>/dev/null || echo '/.whl-tpu/' >> .git/info/exclude
P="--platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 --platform any"
python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.11 --implementation cp $P -d .whl-tpu \
  'omegaconf==2.3.0' 'hydra-core==1.3.2' equinox beartype grain array-record cloudpickle portpicker etils
python3 -m pip wheel -q --no-deps -w .whl-tpu 'antlr4-python3-runtime==4.9.3'
ls .whl-tpu
