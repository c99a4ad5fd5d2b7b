"""What torch_xla does on a TPU that PJRT CPU hides, reproduced where the mechanism runs on the CPU (the SPMD virtual
device that runtime queries refuse), and the decisions of portable_fsdp/backends/xla/resources.py and environment.py with the
TPU injected (its accelerator type, libtpu's HBM figures, torch_xla's memory info): no TPU here. torch_xla itself
is imported only in the subprocess: importing it settles PJRT_DEVICE for every later one."""
import json
import subprocess
import sys

import pytest

from portable_fsdp.machine import tpu_vm
from portable_fsdp.backends.xla import environment, resources
from portable_fsdp.errors import UserError
from tests.conftest import ROOT

SPMD_QUERIES = """
import json
import torch_xla, torch_xla.core.xla_model as xm, torch_xla.runtime as xr
xr.use_spmd()
found = {}
for name, query in (("device_kind", lambda: xm.xla_device_kind()),
                    ("memory_info", lambda: xm.get_memory_info(torch_xla.device()))):
    try:
        query()
        found[name] = ""
    except RuntimeError as err:
        found[name] = str(err).splitlines()[0]
from portable_fsdp.backends.xla import resources
found["ours"] = resources.device_name(True, xr.device_type())
print(json.dumps(found))
"""


def test_runtime_queries_refuse_the_spmd_virtual_device():
    """Under SPMD the default device is the virtual SPMD:0: asking torch_xla for its kind raises (on a TPU too,
    before the first step); the lowering never asks it there."""
    proc = subprocess.run([sys.executable, "-c", SPMD_QUERIES], cwd=ROOT, capture_output=True, text=True,
                          timeout=300, env={"PJRT_DEVICE": "CPU", "CPU_NUM_DEVICES": "2", "PATH": "/usr/bin:/bin"})
    assert proc.returncode == 0, proc.stderr[-3000:]
    found = json.loads(proc.stdout.strip().splitlines()[-1])
    assert "SPMD:0" in found["device_kind"]
    assert found["memory_info"]  # refused too (on PJRT CPU: no allocator statistics at all)
    assert found["ours"] == "cpu"


def test_under_spmd_the_chip_is_named_by_the_slices_accelerator_type(monkeypatch):
    monkeypatch.setenv("TPU_ACCELERATOR_TYPE", "v5p-8")
    assert resources.device_name(True, "TPU") == "TPU v5p-8"
    monkeypatch.delenv("TPU_ACCELERATOR_TYPE")
    monkeypatch.setattr(tpu_vm, "tpu_visible", lambda: False)
    assert resources.device_name(True, "TPU") == "TPU"  # unknown: MFU measures the peak (with a warning)
    assert resources.device_name(True, "CPU") == "cpu"


def test_fsdp_v1_asks_torch_xla_for_its_own_device(monkeypatch):
    monkeypatch.setattr(resources, "_pjrt_device_kind", lambda: "TPU v5 lite")  # xm.xla_device_kind, one device
    assert resources.device_name(False, "TPU") == "TPU v5 lite"


def test_hbm_comes_from_libtpu_with_the_largest_seen_as_peak():
    resources._largest_seen.clear()
    first = resources.hbm_rows([str(3 * 2**30), str(2**30)], 2)
    later = resources.hbm_rows([str(2**30), str(2 * 2**30)], 2)
    assert [row["mem_mb"] for row in first] == [3072.0, 1024.0]
    assert [row["peak_mem_mb"] for row in later] == [3072.0, 2048.0]
    assert later[0]["reserved_mb"] == 1024.0
    with pytest.warns(UserWarning, match="libtpu's monitoring SDK gives no HBM figures"):
        missing = resources.hbm_rows(None, 4)
    assert len(missing) == 4 and all(value == 0.0 for row in missing for value in row.values())


def test_fsdp_v1_reads_its_devices_memory_info(monkeypatch):
    # xm.get_memory_info of the process's device, as torch_xla 2.9 returns it (bytes)
    monkeypatch.setattr(resources, "_memory_info", lambda device: {"bytes_used": 5 * 2**20,
                                                                    "peak_bytes_used": 9 * 2**20,
                                                                    "bytes_limit": 16 * 2**30})
    (row,) = resources.memory_mb(False, "TPU", 1, "xla:0")
    assert row == {"mem_mb": 5.0, "peak_mem_mb": 9.0, "reserved_mb": 5.0, "peak_reserved_mb": 9.0}


def test_a_tpu_host_without_a_tpu_runtime_is_one_line_unless_the_cpu_is_asked_for():
    with pytest.raises(UserError, match="this host has TPU chips but torch_xla found no TPU runtime"):
        environment.checked_device("CPU", tpu_attached=True, asked="")
    assert environment.checked_device("CPU", tpu_attached=True, asked="cpu") == "CPU"
    assert environment.checked_device("TPU", tpu_attached=True, asked="") == "TPU"
    assert environment.checked_device("CPU", tpu_attached=False, asked="") == "CPU"


def test_spmd_devices_are_counted_without_starting_the_runtime(monkeypatch):
    monkeypatch.setattr(environment, "_expected_tpu_devices", lambda: 8)  # PCI chips x workers, no runtime
    assert environment.spmd_device_count("TPU", 2) == 8
    assert environment.spmd_device_count("CPU", 2) == 2
