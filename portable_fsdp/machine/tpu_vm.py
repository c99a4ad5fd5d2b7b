"""What a Cloud TPU VM says about itself, read without starting torch_xla's or JAX's runtime (nor importing them):
whether TPU chips are attached, the slice's accelerator type (which chip, how many: v5p-8, v6e-8, ...) and which of
the slice's hosts (workers) this one is. Imports no framework."""
from __future__ import annotations

import glob
import os
import pathlib
import urllib.request

GOOGLE_PCI_VENDOR = "0x1ae0"
METADATA = "http://metadata.google.internal/computeMetadata/v1/instance/attributes/"
METADATA_TIMEOUT_S = 2.0


def tpu_visible() -> bool:
    """PJRT_DEVICE=TPU, or TPU chips attached to this host: their device files (/dev/accel*), or — newer TPU VMs
    (v5e, v5p, v6e) — VFIO devices of Google's PCI vendor id."""
    if os.environ.get("PJRT_DEVICE", "").upper() == "TPU" or glob.glob("/dev/accel[0-9]*"):
        return True
    vendors = glob.glob("/sys/bus/pci/devices/*/vendor")
    return bool(glob.glob("/dev/vfio/[0-9]*")) and any(pathlib.Path(v).read_text().strip() == GOOGLE_PCI_VENDOR
                                                       for v in vendors)


def accelerator_type() -> str:
    """The slice's accelerator type: TPU_ACCELERATOR_TYPE, else — on a host with TPU chips — the VM's metadata
    server (answering within 2 s); "" where neither says."""
    if os.environ.get("TPU_ACCELERATOR_TYPE"):
        return os.environ["TPU_ACCELERATOR_TYPE"]
    if not tpu_visible():
        return ""
    return metadata("accelerator-type")


def metadata(key: str) -> str:
    """An attribute of this VM from its metadata server (answering within 2 s); "" where there is none."""
    request = urllib.request.Request(METADATA + key, headers={"Metadata-Flavor": "Google"})
    try:
        with urllib.request.urlopen(request, timeout=METADATA_TIMEOUT_S) as reply:
            return reply.read().decode().strip()
    except OSError:  # no metadata server (not a Cloud TPU VM after all), or no such attribute
        return ""


def slice_workers(environ=None, read_metadata=None, visible=None) -> tuple:
    """(this host's worker index, the slice's worker count): (0, 1) off a TPU or on a one-host slice.

    Read where JAX's cluster detection reads them (jax/_src/clusters/cloud_tpu_cluster.py): TPU_WORKER_ID and
    TPU_WORKER_HOSTNAMES (GKE and xpk set them), else the TPU VM's metadata, agent-worker-number and
    worker-network-endpoints (one comma-separated entry per worker). torch_xla reads the same names
    (torch_xla/_internal/tpu.py: worker_id, get_worker_ips)."""
    environ = os.environ if environ is None else environ  # at the call: os.environ may have been replaced since import
    hostnames = environ.get("TPU_WORKER_HOSTNAMES", "")
    if hostnames:
        return int(environ.get("TPU_WORKER_ID", "0")), len(hostnames.split(","))
    if not (visible or tpu_visible)():
        return 0, 1
    read_metadata = read_metadata or metadata
    endpoints = read_metadata("worker-network-endpoints")
    if not endpoints:
        return 0, 1
    return int(read_metadata("agent-worker-number") or 0), len(endpoints.split(","))
