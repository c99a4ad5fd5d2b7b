#!/usr/bin/env bash
# The v5p-16 run of v5p-16.sh as an xpk workload on a GKE cluster of TPU v5p node pools: xpk starts the command on
# each host of the slice (TPU_WORKER_ID and TPU_WORKER_HOSTNAMES tell each which it is), in an image with
# portable_fsdp and torch_xla[tpu] at /app.
#   usage: examples/tpu/v5p-16-xpk.sh CLUSTER IMAGE gs://BUCKET/RUN
set -euo pipefail
CLUSTER=$1 IMAGE=$2 WORKDIR=$3

xpk workload create --cluster "$CLUSTER" --workload qwen3-30b-v5p-16 --tpu-type v5p-16 --num-slices 1 --docker-image "$IMAGE" --command "cd /app; python -m portable_fsdp.run --backend xla --config portable_fsdp/configs/qwen3_30b_a3b.py:v5p-16 --workdir $WORKDIR"
