"""What a Cloud TPU VM says about itself, read without starting torch_xla's or JAX's runtime (nor importing them):
whether TPU chips are attached, and the slice's accelerator type (which chip, how many: v5p-8, v6e-8, ...).
Imports no framework."""
from __future__ import annotations

import glob
import os
import pathlib
import urllib.request

GOOGLE_PCI_VENDOR = "0x1ae0"
METADATA = "http://metadata.google.internal/computeMetadata/v1/instance/attributes/accelerator-type"
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
    request = urllib.request.Request(METADATA, headers={"Metadata-Flavor": "Google"})
    try:
        with urllib.request.urlopen(request, timeout=METADATA_TIMEOUT_S) as reply:
            return reply.read().decode().strip()
    except OSError:  # no metadata server: not a Cloud TPU VM after all
        return ""
