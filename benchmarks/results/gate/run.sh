#!/bin/sh
# Reproduces the committed gate and audit reports (bundled pagoda-coder model, CPU).
# Run from this directory with the repository on PYTHONPATH (or pagoda installed).
set -x
pagoda() { python -m pagoda.cli "$@"; }
pagoda gate "pagoda:--num-threads 1" "pagoda:--num-threads 1" --out identical --no-progress
pagoda gate "pagoda:--num-threads 1" "pagoda:--num-threads 1 --speculative ngram" --out spec-ngram --no-progress
pagoda gate "pagoda:--num-threads 1 --max-num-batched-tokens 2048" "pagoda:--num-threads 1 --max-num-batched-tokens 512" --out chunk-512-vs-2048 --no-progress
pagoda audit "pagoda:--num-threads 1" --out audit-default --no-progress
pagoda gate "pagoda:--num-threads 1" "pagoda:--num-threads 1 --quantization int8" --out int8-weights --no-progress   # fails the default policy on exact match (0.82)
