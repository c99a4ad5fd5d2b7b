#!/usr/bin/env bash
# Qwen3-30B-A3B on a TPU v5p-16 slice (2 hosts x 4 chips): the same command on every host of the slice. Each host
# drives its own chips and feeds its own rows of the global batch; torch_xla joins the hosts into one program over
# the slice's 8 chips, and host 0 writes the metrics, the manifest and the FULL weights. The workdir must be storage
# every host sees (a bucket, or a shared mount): every host writes its own part of each checkpoint there.
# Every host needs a checkout of portable_fsdp at ~/portable_fsdp with torch_xla[tpu] installed.
#   usage: examples/tpu/v5p-16.sh TPU_NAME ZONE gs://BUCKET/RUN
set -euo pipefail
NAME=$1 ZONE=$2 WORKDIR=$3

gcloud compute tpus tpu-vm ssh "$NAME" --zone "$ZONE" --worker=all --command "cd ~/portable_fsdp; python -m portable_fsdp.run --backend xla --config portable_fsdp/configs/qwen3_30b_a3b.py:v5p-16 --workdir $WORKDIR"
