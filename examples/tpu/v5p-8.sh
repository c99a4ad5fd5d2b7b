#!/usr/bin/env bash
# Llama 3 8B on a TPU v5p-8 (one host, 4 chips): run on the TPU VM itself, from a checkout of portable_fsdp with
# torch_xla[tpu] installed. One process drives every chip (SPMD FSDPv2); the workdir may be a local disk.
set -euo pipefail

python -m portable_fsdp.run --backend xla --config portable_fsdp/configs/llama3_8b.py:v5p-8 --workdir runs/llama3_8b-v5p-8
