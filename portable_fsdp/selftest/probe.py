"""The self-test's measurements of the devices, a worker job (`worker.JOBS["probe"]`) started by the launcher as a
training run is: the backend starts its runtime and a smoke-size model, then the devices' kind, memory, matmul
rate in bfloat16 and float32 and all-reduce bus bandwidth are measured with the backend's own primitives
(`time_matmul`, `time_all_reduce`; the rule is portable_fsdp.machine.hardware's, as MFU's measured peak is). Rank 0 writes
PROBE into the workdir. Imports no framework."""
from __future__ import annotations

import json
import pathlib

from portable_fsdp.machine import hardware

PROBE = "probe.json"
DTYPES = ("bfloat16", "float32")


def run(config, plan, backend, backend_name: str, workdir) -> dict:
    state = backend.init(config, plan, backend_name)
    try:
        where = backend.placement(state)
        kind = backend.device_kind(state)
        matmul = {dtype: hardware.measured_flops(lambda size, d: backend.time_matmul(state, size, d), kind, dtype)
                  for dtype in DTYPES}
        bandwidth = hardware.measured_bus_bandwidth(lambda size: backend.time_all_reduce(state, size), kind,
                                                    where.world_size)
        memory = backend.memory_report(state)
        found = {"device_kind": kind, "devices": where.world_size, "processes": where.processes,
                 "matmul_flops": matmul, "bus_bandwidth": bandwidth, "memory": memory}
        if where.rank == 0:
            (pathlib.Path(workdir) / PROBE).write_text(json.dumps(found, indent=1))
        return found
    finally:
        backend.finalize(state)


def rows(found: dict) -> list:
    """The table's rows of what the probe measured, each against the device's datasheet where it has one (a
    measurement under hardware.MATMUL_FLOOR / LINK_FLOOR of it fails)."""
    kind = found["device_kind"]
    out = []
    for dtype in DTYPES:
        rate = found["matmul_flops"][dtype]
        sheet = None if hardware.is_cpu(kind) else hardware.datasheet_flops(kind, dtype)
        row = {"feature": f"matmul_{dtype}", "what": f"one device's {dtype} matmul rate",
               "measured_tflops": rate / 1e12, "passed": True,
               "figure": f"{rate / 1e12:.3g} TFLOP/s" + (f" = {rate / sheet:.0%} of {sheet / 1e12:,.0f} (datasheet)"
                                                        if sheet else " (no datasheet figure)")}
        if sheet:
            row.update(datasheet_tflops=sheet / 1e12, passed=rate >= hardware.MATMUL_FLOOR * sheet)
        out.append(row)
    bandwidth = found["bus_bandwidth"] / 1e9
    link = hardware.link_entry(kind)
    row = {"feature": "all_reduce", "what": f"all-reduce over {found['devices']} devices, bus bandwidth",
           "measured_gbps": bandwidth, "passed": True}
    if found["devices"] < 2:
        row["figure"] = "one device: nothing to exchange"
    elif link:
        label, rate = link
        row.update(figure=f"{bandwidth:.3g} GB/s = {bandwidth / rate:.0%} of {label}: {rate:,.0f} GB/s",
                   datasheet_gbps=rate, passed=not label.startswith("NVLink") or bandwidth >= hardware.LINK_FLOOR * rate)
    else:
        row["figure"] = f"{bandwidth:.3g} GB/s (no datasheet figure)"
    out.append(row)
    return out
