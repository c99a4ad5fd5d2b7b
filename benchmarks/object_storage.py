"""Checkpoint save and resume through a workdir in a bucket against a raw upload and download of the same bytes:
the checkpoint benchmark's model (benchmarks/checkpoint_io.py), 2 CPU ranks, FULL and SHARDED checkpoints, to an
S3-compatible server (moto's, started here in a process of its own on a local port).

    python -m benchmarks.object_storage            # 246M parameters: 2.95 GB checkpoints with AdamW
    python -m benchmarks.object_storage --layers 2 # 88M parameters: 1.06 GB (moto's memory allows it beside others)
    python -m benchmarks.object_storage --quick    # a tiny model: checks the script works, measures nothing

A save is the product's `checkpoint_session.save` into the bucket's local working copy: the local write and commit,
then rank 0's upload (portable_fsdp/storage/sync.py), timed until it ends (training would go on meanwhile). A resume is what a fresh machine does: the local copy removed,
`sync.pull_latest` (the download), then `checkpoint_session.resume` (checksums and load). Raw: fsspec's own
`put` and `get` of the checkpoint's files, one call each. "local save s": the same save into a plain directory,
so "save - local" is what the bucket adds. Results: benchmarks/results/object_storage.json.
"""
from __future__ import annotations

import argparse
import json
import os
import pathlib
import shutil
import subprocess
import sys
import tempfile
import time

from benchmarks.checkpoint_io import LAYOUTS, MODEL, QUICK_MODEL, trained_state, with_layout
from benchmarks.common import ROOT, free_port, machine, table, torchrun, write_json

BUCKET = "benchmark"


def _worker(spec: dict) -> None:
    import torch.distributed as dist

    from portable_fsdp.checkpoint import async_save, layout as checkpointing, session as checkpoint_session
    from portable_fsdp.storage import remote as storage, sync

    backend, state, config, plan, _ = trained_state(spec["model"])
    rank, results = backend.placement(state).rank, {"n_params": backend.model_info(state).n_params}
    for layout in LAYOUTS:
        url = f"s3://{BUCKET}/{layout}"
        state, info = with_layout(backend, state, config, plan, layout)
        local = storage.working_copy(url) if rank == 0 else storage.local_workdir(url)
        timed = {}
        for name, workdir in (("local_save_s", pathlib.Path(spec["plain"]) / layout), ("save_s", local)):
            backend.barrier(state)
            began = time.perf_counter()
            final = checkpoint_session.save(backend, state, workdir, info, keep_last_n=1)
            async_save.finish()  # the upload, in the background of the training steps
            backend.barrier(state)
            timed[name] = time.perf_counter() - began
        remote = storage.open_remote(url)
        if rank == 0:  # a fresh machine: nothing local
            shutil.rmtree(checkpointing.root(local))
        backend.barrier(state)
        began = time.perf_counter()
        if rank == 0:
            sync.pull_latest(remote, local)
        backend.barrier(state)
        timed["download_s"] = time.perf_counter() - began
        state = checkpoint_session.resume(backend, state, final, config, "cpu")
        backend.barrier(state)
        timed["resume_s"] = time.perf_counter() - began
        if rank == 0:
            timed.update(_raw(remote, final))
            manifest = checkpointing.read_manifest(final)
            results[layout] = {"bytes": checkpointing.total_bytes(manifest), "files": len(manifest["files"]),
                               **timed}
        backend.barrier(state)
    if rank == 0:
        pathlib.Path(spec["out"]).write_text(json.dumps(results))
    dist.barrier()
    backend.finalize(state)


def _raw(remote, checkpoint: pathlib.Path) -> dict:
    """fsspec's own upload, then download, of the checkpoint's files."""
    files = sorted(p for p in checkpoint.rglob("*") if p.is_file())
    names = [remote.path(f"raw/{p.relative_to(checkpoint)}") for p in files]
    began = time.perf_counter()
    remote.fs.put([str(p) for p in files], names)
    upload_s = time.perf_counter() - began
    with tempfile.TemporaryDirectory(dir=checkpoint.parent) as back:
        began = time.perf_counter()
        remote.fs.get(names, [os.path.join(back, str(p.relative_to(checkpoint))) for p in files])
        download_s = time.perf_counter() - began
    remote.remove("raw")
    return {"raw_upload_s": upload_s, "raw_download_s": download_s}


def _s3_server(port: int) -> subprocess.Popen:
    """moto's S3-compatible server on `port`, in a process of its own (its work is not counted in ours)."""
    server = subprocess.Popen([sys.executable, "-m", "moto.server", "-H", "127.0.0.1", "-p", str(port)],
                              stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    import fsspec

    deadline = time.monotonic() + 60
    while True:
        try:
            fsspec.filesystem("s3", skip_instance_cache=True).mkdir(BUCKET)
            return server
        except Exception:
            if time.monotonic() > deadline or server.poll() is not None:
                server.kill()
                raise
            time.sleep(0.5)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="a tiny model: measures nothing")
    parser.add_argument("--layers", type=int, default=MODEL["num_hidden_layers"],
                        help="the model's layers (moto holds every object in memory, several times over while it "
                             "assembles one: the 16 layers' 2.95 GB take about 10 GB of it)")
    parser.add_argument("--worker", help="internal: the run's JSON spec")
    args = parser.parse_args()
    if args.worker:
        _worker(json.loads(args.worker))
        return
    port = free_port()
    os.environ.update({"AWS_ENDPOINT_URL": f"http://127.0.0.1:{port}", "AWS_ACCESS_KEY_ID": "benchmark",
                       "AWS_SECRET_ACCESS_KEY": "benchmark", "AWS_DEFAULT_REGION": "us-east-1",
                       # moto assembles a multipart object in Python when it is completed: GBs take minutes here,
                       # and botocore's 60 s read timeout would send the completion again, for an upload gone by then
                       "FSSPEC_S3": json.dumps({"config_kwargs": {"read_timeout": 900}})})
    server = _s3_server(port)
    try:
        with tempfile.TemporaryDirectory() as tmp:
            model = QUICK_MODEL if args.quick else {**MODEL, "num_hidden_layers": args.layers}
            spec = {"model": model, "plain": os.path.join(tmp, "plain"),
                    "out": os.path.join(tmp, "out.json")}
            torchrun(2, ["benchmarks.object_storage", "--worker", json.dumps(spec)], timeout=3600,
                     env={"OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1",
                          "PORTABLE_FSDP_LOCAL_WORKDIRS": os.path.join(tmp, "local")})
            results = json.loads(pathlib.Path(spec["out"]).read_text())
    finally:
        server.kill()
        server.wait()
    rows = []
    for layout in LAYOUTS:
        r = results[layout]
        rows.append([layout.split("_")[0], f"{r['bytes'] / 1e9:.2f}", r["files"], f"{r['save_s']:.1f}",
                     f"{r['local_save_s']:.1f}", f"{r['raw_upload_s']:.1f}",
                     f"{(r['save_s'] - r['local_save_s']) / r['raw_upload_s']:.2f}",
                     f"{r['download_s']:.1f}", f"{r['raw_download_s']:.1f}",
                     f"{r['download_s'] / r['raw_download_s']:.2f}", f"{r['resume_s']:.1f}"])
    print(f"{results['n_params'] / 1e6:.0f}M parameters, 2 CPU ranks, moto's S3 server on this machine")
    print(table(["layout", "GB", "files", "save s", "local save s", "raw upload s", "(save - local) x raw",
                 "download s", "raw download s", "download x raw", "resume s (download + load)"], rows))
    if not args.quick:
        write_json(ROOT / "benchmarks" / "results" / "object_storage.json",
                   {"model": model, "machine": machine(), "results": results})


if __name__ == "__main__":
    main()
