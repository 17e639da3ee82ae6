# On a TPU machine (the device tool's v5e), from the project root: Zoo's dependencies that the machine lacks,
# carried as wheels in .whl-tpu/ (bash bench/tpu_wheels.sh here), and those its own package index holds, under
# /tmp, appended to PYTHONPATH so that the machine's JAX stays first.
PIP_CONFIG_FILE=/dev/null python3 -m pip install --isolated -q --no-index --no-deps --no-compile --no-cache-dir \
  --upgrade --target /tmp/site .whl-tpu/*.whl
PIP_CONFIG_FILE=/dev/null python3 -m pip install --isolated -q --only-binary=:all: --index-url file:///opt/pypi/simple \
  --target /tmp/site2 optax jaxtyping orbax-checkpoint matplotlib tokenizers safetensors absl-py protobuf etils
export PYTHONPATH=$PYTHONPATH:/tmp/site:/tmp/site2 PYTHONUNBUFFERED=1
