"""`python -m portable_fsdp.selftest [--backend auto|cuda|xla|cpu|flax] [--nproc N] [--workdir DIR] [--only ROW,...]`

Prove this machine before a long run: every plan feature the chosen backend honours here, trained at smoke size
and compared step by step with one CPU process from the same initial weights on the same batches; SHARDED, FULL
and background saves resumed; a SHARDED run's export compared with the CPU process's weights; the devices' matmul
rate and all-reduce bandwidth against their datasheet. Prints one table and writes selftest.json into --workdir
(default: the current directory). Rows: devices (the measurements), then the features of
portable_fsdp/selftest/features.py; --only runs some of them.

Exit status: 0 every row that ran passed; 1 a row failed (the last line names it); 2 a bad input.
"""
from __future__ import annotations

import argparse
import json
import os
import pathlib
import signal
import subprocess
import sys
import tempfile
import time

from portable_fsdp import backends
from portable_fsdp.config.schema import command_line_text
from portable_fsdp.errors import UserError, print_notices_as_lines
from portable_fsdp.cli import Parser
from portable_fsdp.selftest import features, probe, report, runs

DEVICES = "devices"  # the --only name of the measurement rows


def parse_args(argv):
    parser = Parser(prog="python -m portable_fsdp.selftest", description=__doc__,
                    formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--backend", default="auto", choices=backends.CHOICES,
                        help="auto = xla on a TPU, cuda when a GPU is visible, else cpu")
    parser.add_argument("--nproc", type=int, default=None,
                        help="devices (processes) the rows use (default: every GPU on cuda, 2 on cpu)")
    parser.add_argument("--workdir", default=None, help="where selftest.json goes (default: the current directory)")
    parser.add_argument("--only", default="", help=f"comma-separated rows: {DEVICES}, " + ", ".join(features.NAMES))
    parser.add_argument("--probe-job", action="store_true", help=argparse.SUPPRESS)  # the measurements' process
    args = parser.parse_args(argv)
    if args.nproc is not None and args.nproc < 1:
        raise UserError("--nproc", f"must be at least 1 (got {args.nproc})")
    chosen = [name.strip() for name in args.only.split(",") if name.strip()]
    unknown = [name for name in chosen if name not in (DEVICES, *features.NAMES)]
    if unknown:
        raise UserError("--only", f"unknown row {unknown[0]!r}; choose from {DEVICES}, {', '.join(features.NAMES)}")
    args.only = chosen
    return args


def measure_devices(backend: str, nproc: int, workdir: pathlib.Path) -> list:
    """The probe's rows, from a run of its worker job (a process of its own, stopped after a timeout)."""
    command = [sys.executable, "-m", "portable_fsdp.selftest", "--probe-job", "--backend", backend, "--nproc",
               str(nproc), "--workdir", str(workdir)]
    began = time.perf_counter()
    with subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                          start_new_session=True) as process:
        try:
            _, stderr = process.communicate(timeout=runs.RUN_TIMEOUT_S)
        except subprocess.TimeoutExpired:
            os.killpg(process.pid, signal.SIGKILL)
            process.communicate()
            stderr = f"error: timed out after {runs.RUN_TIMEOUT_S} s"
    seconds = time.perf_counter() - began
    found = workdir / probe.PROBE
    if process.returncode != 0 or not found.exists():
        return [{"feature": DEVICES, "what": "the devices' measurements", "passed": False, "seconds": seconds,
                 "error": runs.error_line(stderr, process.returncode)}]
    measured = json.loads(found.read_text())
    rows = [{**row, "device_kind": measured["device_kind"]} for row in probe.rows(measured)]
    rows[0]["seconds"] = seconds  # one run measured them all
    return rows


def probe_job(args) -> int:
    """The worker side of `measure_devices`: the launcher starts the backend's processes as for training."""
    from portable_fsdp.launch import launcher as launch

    launch.start(features.model_config("llama", args.nproc), args.backend, pathlib.Path(args.workdir), args.nproc,
                 job="probe")
    return 0


def feature_rows(backend: str, nproc: int, device: str, chosen: list, scratch: pathlib.Path) -> list:
    from portable_fsdp.crosscheck import initial_weights

    selected = [f for f in features.FEATURES if not chosen or f.name in chosen]
    lowering = backends.load(backend)
    described = {model: lowering.describe_model(features.model_config(model, nproc))
                 for model in {f.model for f in selected}}
    weights = {}
    for model in described:
        weights[model] = scratch / f"weights-{model}"
        recipe, model_overrides = features.MODELS[model]
        initial_weights(recipe, [(k, command_line_text(v)) for k, v in model_overrides.items()], weights[model])
    references = runs.References(scratch, weights)
    rows = []
    for feature in selected:
        row = {"feature": feature.name, "what": feature.what}
        reason = features.not_honoured(feature, backend, device, nproc, described[feature.model])
        if reason:
            rows.append({**row, "skipped": reason})
        else:
            began = time.perf_counter()
            try:
                row.update(runs.judge(feature, backend, nproc, nproc, scratch, references))
            except runs.RunFailed as err:
                row.update(passed=False, error=str(err))
            row["seconds"] = time.perf_counter() - began
            rows.append(row)
        print(f"selftest: {feature.name}: {report.result_word(rows[-1])}", file=sys.stderr, flush=True)
    return rows


def main(argv=None) -> int:
    print_notices_as_lines()
    try:
        args = parse_args(sys.argv[1:] if argv is None else argv)
        backend = backends.resolve(args.backend)
        nproc = args.nproc or backends.load(backend).default_nproc(backend)
        if args.probe_job:
            args.backend, args.nproc = backend, nproc
            return probe_job(args)
        device = backends.load(backend).device_type(backend)
        workdir = pathlib.Path(args.workdir or ".")
        try:
            workdir.mkdir(parents=True, exist_ok=True)
        except OSError as err:
            raise UserError("--workdir", f"cannot create {workdir} ({err.strerror}); choose another directory") from None
        print(f"selftest: --backend {backend}, {nproc} device(s) ({device})", file=sys.stderr, flush=True)
        began = time.perf_counter()
        with tempfile.TemporaryDirectory(prefix="portable_fsdp-selftest-") as scratch:
            scratch = pathlib.Path(scratch)
            rows = measure_devices(backend, nproc, scratch / DEVICES) if not args.only or DEVICES in args.only else []
            rows += feature_rows(backend, nproc, device, [n for n in args.only if n != DEVICES], scratch)
    except UserError as err:
        print(err.line(), file=sys.stderr)
        return err.exit_code
    print(report.table(rows))
    failed = report.failed(rows)
    kind = next((row["device_kind"] for row in rows if "device_kind" in row), device)
    summary = {"backend": backend, "devices": nproc, "device_kind": kind, "seconds": time.perf_counter() - began,
               "passed": not failed, "rows": rows}
    path = report.write(workdir, summary)
    ran = [row for row in rows if not row.get("skipped")]
    if failed:
        print(f"\nselftest FAILED: {len(failed)} of {len(ran)} rows: {', '.join(failed)}; wrote {path}")
        return 1
    print(f"\nselftest passed: {len(ran)} rows ran ({len(rows) - len(ran)} not honoured here) in "
          f"{summary['seconds']:.0f} s on {nproc} x {kind}; wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
