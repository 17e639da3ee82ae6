# On a TPU machine, from the project root, after bench/tpu_setup.sh: MaxText (carried in .whl-maxtext/ by
# bench/maxtext_wheels.sh) and the packages it imports that the machine's own index holds, into /tmp/mt.
# Sets MAXTEXT_PYTHONPATH: the machine's PYTHONPATH and /tmp/mt (not Zoo's /tmp/site: the two pin different
# omegaconf versions), for bench/peer_maxtext.py --maxtext-pythonpath.
PIP="python3 -m pip install --isolated -q --no-deps --no-compile --no-cache-dir --target /tmp/mt"
PIP_CONFIG_FILE=/dev/null $PIP --no-index --ignore-requires-python .whl-maxtext/*.whl \
  .whl-tpu/array_record-*.whl .whl-tpu/cloudpickle-*.whl .whl-tpu/etils-*.whl .whl-tpu/grain-*.whl \
  .whl-tpu/portpicker-*.whl || return 1 2>/dev/null || exit 1
FROM_INDEX="flax optax orbax-checkpoint tensorstore jaxtyping wadler-lindig ml-collections absl-py typing-extensions
  transformers tokenizers safetensors sentencepiece pyyaml tqdm pillow grpcio cryptography cffi pycparser uvloop
  nest-asyncio aiofiles toolz"
if ! PIP_CONFIG_FILE=/dev/null $PIP --only-binary=:all: --index-url file:///opt/pypi/simple $FROM_INDEX 2>/dev/null; then
  for p in $FROM_INDEX; do  # one at a time: say which the index lacks
    PIP_CONFIG_FILE=/dev/null $PIP --only-binary=:all: --index-url file:///opt/pypi/simple "$p" 2>/dev/null \
      || echo "maxtext_setup: the machine's index has no $p"
  done
fi
export MAXTEXT_PYTHONPATH="$PYTHONPATH:/tmp/mt"
