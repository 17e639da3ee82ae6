#!/usr/bin/env bash
# MaxText 0.2.4 and the wheels its trainer imports that a TPU machine's own package index may lack, for
# CPython 3.11 x86-64, into .whl-maxtext/ of the current directory (git-ignored). bench/maxtext_setup.sh
# installs them there; bench/peer_maxtext.py runs it. MaxText declares Python >= 3.12: its wheel is fetched
# with a 3.12 tag and installed with --ignore-requires-python (every file it imports here parses on 3.11).
set -euo pipefail
grep -qx '/.whl-maxtext/' .git/info/exclude 2>/dev/null || echo '/.whl-maxtext/' >> .git/info/exclude
P="--platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64 --platform manylinux_2_24_x86_64
   --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 --platform manylinux1_x86_64 --platform any"
python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 -d .whl-maxtext 'maxtext==0.2.4'
# The versions its trainer imported together on Python 3.11 (pip install into a clean venv, 2026-12-07).
python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.11 --implementation cp $P -d .whl-maxtext \
  aqtp==0.9.0 qwix==0.1.8 tokamax==0.0.12 drjax==0.2.1 pathwaysutils==0.1.13 ml-goodput-measurement==0.2.3 \
  tiktoken==0.14.0 einshape==1.0 treescope==0.1.10 humanize==4.17.0 simplejson==4.3.0 immutabledict==4.3.1 \
  omegaconf==2.4.0 pydantic==2.14.4 pydantic-core==2.50.5 annotated-types==0.8.0 typing-inspection==0.4.5 \
  annotated-doc==0.0.7 fastapi==0.165.0 starlette==1.10.0 uvicorn==0.55.0 anyio==4.16.0 h11==0.16.0 click==8.5.1 \
  httpx2==2.17.0 httpcore2==2.17.0 truststore==0.10.5 typeguard==2.13.3 prometheus-client==0.26.0 \
  opentelemetry-api==1.45.3 google-api-core==2.44.0 google-auth==2.63.1 google-cloud-core==2.8.0 \
  google-cloud-logging==3.17.0 google-cloud-monitoring==2.32.0 google-cloud-storage==3.17.2 \
  google-cloud-appengine-logging==1.11.0 google-cloud-audit-log==0.6.3 google-crc32c==1.9.0 \
  google-resumable-media==2.11.0 googleapis-common-protos==1.76.0 grpc-google-iam-v1==0.14.6 grpcio-status==1.85.3 \
  proto-plus==1.29.0 protobuf==7.36.2 psutil==7.2.2 dill==0.4.1 optree==0.20.0 msgpack==1.2.4 namex==0.1.0 \
  huggingface-hub==2.4.0 regex==2026.12.2 requests==2.34.2 urllib3==2.8.0 idna==3.21 certifi==2026.10.19.post1 \
  charset-normalizer==3.5.3 filelock==4.3.2 jinja2==3.1.6 markupsafe==3.0.4 pygments==2.21.0 rich==15.0.0 \
  python-dateutil==4.0.0 six==1.17.0 mpmath==1.3.0 wrapt==2.5.2 termcolor==3.3.0 tensorboardx==2.6.5 \
  flatbuffers==25.12.19 gast==0.7.0 astunparse==1.6.3
du -sh .whl-maxtext
