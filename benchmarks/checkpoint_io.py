"""Checkpoint save and resume against the disk's own rate: a ~1.1 GB (fp32) Llama, 2 CPU ranks (gloo), FULL and
SHARDED checkpoints, each save and resume timed end to end and compared with a raw write (then read) of the same
number of bytes on the same disk, measured right after each save and resume (DISK_ROUNDS rounds: the shared disk's
rate moves between minutes).

    python -m benchmarks.checkpoint_io            # 246M parameters: 2.95 GB checkpoints with AdamW (~25 min)
    python -m benchmarks.checkpoint_io --quick    # a tiny model: checks the script works, measures nothing

The workers start under torchrun and run the product's own code: `backend.init`, one training step (AdamW's state
then exists), `checkpoint_session.save` (stage, write, each rank checksumming its files, barriers, rank 0's commit
of the manifest) and `checkpoint_session.resume` (each rank's share of the checksums, the load). The files are
dropped from the page cache (posix_fadvise DONTNEED, after their fsync) before the resume reads them, as a fresh job
would find them.
The raw rate: one process writes the checkpoint's byte count in 64 MiB blocks and fsyncs (`dd conv=fsync`), drops
it from the cache, reads it back. "x raw" is the save (resume) time over the raw write (read) time of its bytes:
1.0 would be the disk's speed. Then the step time a save costs: STEPS training steps with a SHARDED save after the
first, in the foreground or with train.async_save (the clock stops once the background save is committed), each
against the same steps without a save around it, ROUNDS rounds (medians; "step by step": each step's median over
the rounds against the typical step, which one step slowed by another job does not move) — twice: in the first
run's ranks, which keep every core busy, and in a second run of 1 rank computing on 1 intra-op thread
(OMP_NUM_THREADS=1), which leaves a core to the background write, as an accelerator's host leaves its cores and
disk idle while it computes.
Results: benchmarks/results/checkpoint_io.json.
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import os
import pathlib
import shutil
import statistics
import tempfile
import time

from benchmarks.common import ROOT, machine, table, torchrun, write_json

# hidden 1024, 16 layers (4 kv heads), 32k vocabulary, untied: 246M parameters, 0.98 GB of fp32 weights
MODEL = {"hidden_size": 1024, "intermediate_size": 2816, "num_hidden_layers": 16, "num_attention_heads": 16,
         "num_key_value_heads": 4, "vocab_size": 32000, "tie_word_embeddings": False}
QUICK_MODEL = {"hidden_size": 64, "intermediate_size": 160, "num_hidden_layers": 2, "num_attention_heads": 4,
               "num_key_value_heads": 2, "vocab_size": 512, "tie_word_embeddings": False}
LAYOUTS = ("FULL_STATE_DICT", "SHARDED_STATE_DICT")
BLOCK = 64 * 2**20
STEPS = 6  # training steps timed with a save after the first: the 5 after it give a background write time to end
ROUNDS = 5
DISK_ROUNDS = 3  # save, resume and the raw write and read, each layout


def _drop_cache(paths) -> None:
    for path in paths:
        fd = os.open(path, os.O_RDONLY)
        try:
            os.fsync(fd)
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)


def _files(directory: pathlib.Path) -> list:
    return sorted(p for p in directory.rglob("*") if p.is_file())


def raw_rates(directory: pathlib.Path, nbytes: int) -> dict:
    """Seconds to write `nbytes` (64 MiB blocks, then fsync) and to read them back from the disk."""
    block = os.urandom(BLOCK)
    path = directory / "raw.bin"
    began = time.perf_counter()
    with open(path, "wb") as f:
        for offset in range(0, nbytes, BLOCK):
            f.write(block[: min(BLOCK, nbytes - offset)])
        f.flush()
        os.fsync(f.fileno())
    write_s = time.perf_counter() - began
    _drop_cache([path])
    began = time.perf_counter()
    with open(path, "rb", buffering=0) as f:
        while f.read(BLOCK):
            pass
    read_s = time.perf_counter() - began
    path.unlink()
    return {"write_s": write_s, "read_s": read_s}


def trained_state(model: dict, threads: int = 0):
    """A torchrun worker's (backend, state, config, plan, batches): `model` on the cpu backend after one training
    step (AdamW's state then exists, so a checkpoint holds it). `threads`: intra-op threads (0: init's share)."""
    import torch

    from portable_fsdp import backends
    from portable_fsdp.config.schema import apply_override, load_recipe
    from portable_fsdp.data.loader import TrainBatches, build_token_data
    from portable_fsdp.config.validate import resolve_plan

    config = load_recipe(None)
    for key, value in {**{f"model.{k}": v for k, v in model.items()}, "data.seq_len": 32,
                       "train.batch_size": 2, "train.progress_bar": False}.items():
        apply_override(config, key, str(value).lower() if isinstance(value, bool) else str(value))
    world = int(os.environ["WORLD_SIZE"])
    plan = resolve_plan(config, world)
    backend = backends.load("cpu")
    state = backend.init(config, plan, "cpu")
    if threads:  # after init, which gives each rank its share of the cores
        torch.set_num_threads(threads)
    rank = backend.placement(state).rank
    data = build_token_data(config.data, config.model.vocab_size, config.train.batch_size)
    batches = TrainBatches(data.train, config.train.batch_size, 1, config.seed, None)
    state, _ = backend.train_step(state, batches.micro_batches(0, rank, world))
    return backend, state, config, plan, batches


def with_layout(backend, state, config, plan, layout: str):
    """(state, manifest info) saving in `layout` (FULL_STATE_DICT or SHARDED_STATE_DICT)."""
    from portable_fsdp.checkpoint import session as checkpoint_session

    layout_plan = dataclasses.replace(plan, state_dict_type=type(plan.state_dict_type)[layout])
    state = dataclasses.replace(state, ctx=dataclasses.replace(state.ctx, plan=layout_plan))
    return state, checkpoint_session.manifest_info(config, layout_plan, "cpu", backend.placement(state))


def _worker(spec: dict) -> None:
    import torch
    import torch.distributed as dist

    backend, state, config, plan, batches = trained_state(spec["model"], spec["threads"])
    rank = backend.placement(state).rank
    results = {"n_params": backend.model_info(state).n_params, "intra_op_threads": torch.get_num_threads()}
    if spec["disk"]:
        state = _against_the_disk(backend, state, config, plan, spec, results)
    results["step_time_lost"] = _step_time_lost(backend, state, config, plan, batches, spec)
    if rank == 0:
        pathlib.Path(spec["out"]).write_text(json.dumps(results))
    dist.barrier()
    backend.finalize(state)


def _against_the_disk(backend, state, config, plan, spec, results):
    """Each layout's save and resume, timed, and (rank 0) the raw write and read of as many bytes right after, in
    DISK_ROUNDS rounds: the disk's rate moves between minutes, so each save is set against the raw rate of its own
    round."""
    from portable_fsdp.checkpoint import layout as checkpointing, session as checkpoint_session

    rank = backend.placement(state).rank
    for round_ in range(spec["disk_rounds"]):
        for layout in LAYOUTS:
            workdir = pathlib.Path(spec["workdir"]) / layout
            state, info = with_layout(backend, state, config, plan, layout)
            backend.barrier(state)
            began = time.perf_counter()
            final = checkpoint_session.save(backend, state, workdir, info, keep_last_n=1)
            save_s = time.perf_counter() - began
            _drop_cache(_files(final))
            backend.barrier(state)
            began = time.perf_counter()
            state = checkpoint_session.resume(backend, state, final, config, "cpu")
            backend.barrier(state)
            resume_s = time.perf_counter() - began
            manifest = checkpointing.read_manifest(final)
            entry = results.setdefault(layout, {"bytes": checkpointing.total_bytes(manifest),
                                                "files": len(manifest["files"]), "rounds": []})
            measured = {"save_s": save_s, "resume_s": resume_s}
            if rank == 0:
                measured["raw"] = raw_rates(pathlib.Path(spec["workdir"]), entry["bytes"])
            entry["rounds"].append(measured)
            backend.barrier(state)
            if rank == 0:
                shutil.rmtree(workdir)
    return state


def _step_time_lost(backend, state, config, plan, batches, spec) -> dict:
    """Wall time of STEPS training steps with a SHARDED save after the first, written in the foreground or in the
    background (train.async_save), against the same steps without a save: after a first background save (a run's
    first allocates its staging buffers and starts the writer processes), ROUNDS rounds of none, sync, async, and a
    last none; each save's run is compared with the mean of the runs without a save around it (medians over
    rounds). Also timed: the step after the save against the median step of those runs (a background save copies
    the state to host memory during that step), and the wait for the commit once the steps are done."""
    import copy

    from portable_fsdp.checkpoint import async_save, session as checkpoint_session

    where = backend.placement(state)
    sharded_plan = dataclasses.replace(plan, state_dict_type=type(plan.state_dict_type)["SHARDED_STATE_DICT"])
    info = checkpoint_session.manifest_info(config, sharded_plan, "cpu", where)
    index = 1

    def timed(mode: str) -> dict:
        nonlocal state, index
        mode_config = copy.deepcopy(config)
        mode_config.train.async_save = mode == "async"
        state = dataclasses.replace(state, ctx=dataclasses.replace(state.ctx, config=mode_config, plan=sharded_plan))
        backend.barrier(state)
        began, in_save, steps = time.perf_counter(), 0.0, []
        for i in range(spec["steps"]):
            stepped = time.perf_counter()
            state, _ = backend.train_step(state, batches.micro_batches(index, where.dp_rank, where.dp_size))
            steps.append(time.perf_counter() - stepped)
            index += 1
            if i == 0 and mode != "none":
                called = time.perf_counter()
                checkpoint_session.save(backend, state, pathlib.Path(spec["workdir"]) / mode, info, keep_last_n=1)
                in_save = time.perf_counter() - called
        waited = time.perf_counter()
        async_save.finish()  # committed before the clock stops
        backend.barrier(state)
        return {"total_s": time.perf_counter() - began, "save_call_s": in_save, "step_s": steps,
                "commit_wait_s": time.perf_counter() - waited}

    runs: dict = {"sync": [], "async": []}
    first_async = timed("async")  # untimed: allocates the staging buffers that the next background saves refill
    before = timed("none")
    for _ in range(spec["rounds"]):
        sync, background, after = timed("sync"), timed("async"), timed("none")
        baseline = (before["total_s"] + after["total_s"]) / 2
        typical_step = statistics.median(before["step_s"] + after["step_s"])
        for mode, run in (("sync", sync), ("async", background)):
            runs[mode].append({**run, "lost_s": run["total_s"] - baseline, "baseline_s": baseline,
                               "typical_step_s": typical_step, "next_step_extra_s": run["step_s"][1] - typical_step})
        before = after
    median = lambda mode, key: statistics.median(r[key] for r in runs[mode])  # noqa: E731
    return {"steps": spec["steps"], "rounds": spec["rounds"], "first_async": first_async,
            "baseline_s": statistics.median(r["baseline_s"] for r in runs["sync"]),
            "typical_step_s": statistics.median(r["typical_step_s"] for r in runs["sync"]),
            **{mode: {key: median(mode, key) for key in ("total_s", "save_call_s", "next_step_extra_s",
                                                          "commit_wait_s", "lost_s")} | {"runs": runs[mode]}
               for mode in runs}}


def _run(nproc: int, spec: dict) -> dict:
    """One torchrun of the workers, in a fresh directory of its own."""
    spec = {**spec, "workdir": tempfile.mkdtemp(dir=spec["workdir"])}
    spec["out"] = os.path.join(spec["workdir"], "out.json")
    torchrun(nproc, ["benchmarks.checkpoint_io", "--worker", json.dumps(spec)], timeout=3600,
             env={"OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1"})
    return json.loads(pathlib.Path(spec["out"]).read_text())


def _step_by_step_lost(lost: dict, mode: str) -> float:
    """The step time lost, robust to a step that another job slowed: each step's median over the rounds (the
    first, the one after the save, ...) less the typical step, plus the medians of the save call and the commit
    wait."""
    runs = lost[mode]["runs"]
    steps = [statistics.median(run["step_s"][i] for run in runs) for i in range(lost["steps"])]
    return (sum(steps) - lost["steps"] * lost["typical_step_s"] + statistics.median(r["save_call_s"] for r in runs)
            + statistics.median(r["commit_wait_s"] for r in runs))


def _lost_table(lost: dict) -> str:
    by_step = {mode: _step_by_step_lost(lost, mode) for mode in ("sync", "async")}
    return table(["save", "steps + save s", "in the save call s", "the next step's extra s", "commit wait s",
                  "step time lost s", "each round's s", "lost / foreground's", "step by step s",
                  "step by step / foreground's"],
                 [[mode, f"{lost[mode]['total_s']:.1f}", f"{lost[mode]['save_call_s']:.1f}",
                   f"{lost[mode]['next_step_extra_s']:.1f}", f"{lost[mode]['commit_wait_s']:.1f}",
                   f"{lost[mode]['lost_s']:.1f}",
                   " ".join(f"{r['lost_s']:.1f}" for r in lost[mode]["runs"]),
                   f"{lost[mode]['lost_s'] / lost['sync']['lost_s']:.2f}", f"{by_step[mode]:.1f}",
                   f"{by_step[mode] / by_step['sync']:.2f}"] for mode in ("sync", "async")])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="a tiny model: measures nothing")
    parser.add_argument("--nproc", type=int, default=2, help="ranks of the first run (every core busy)")
    parser.add_argument("--dir", help="where the checkpoints go (default: a temporary directory)")
    parser.add_argument("--worker", help="internal: the run's JSON spec")
    args = parser.parse_args()
    if args.worker:
        _worker(json.loads(args.worker))
        return
    with tempfile.TemporaryDirectory(dir=args.dir) as tmp:
        spec = {"model": QUICK_MODEL if args.quick else MODEL, "workdir": tmp, "steps": STEPS,
                "rounds": 1 if args.quick else ROUNDS, "disk_rounds": 1 if args.quick else DISK_ROUNDS}
        results = _run(args.nproc, {**spec, "disk": True, "threads": 0})
        results["core_free"] = _run(1, {**spec, "disk": False, "threads": 1})
    rows = []
    for layout in LAYOUTS:
        r = results[layout]
        gb, rounds = r["bytes"] / 1e9, r["rounds"]
        median = lambda key: statistics.median(key(m) for m in rounds)  # noqa: E731
        ratios = {what: sorted(m[f"{what}_s"] / m["raw"][f"{raw}_s"] for m in rounds)
                  for what, raw in (("save", "write"), ("resume", "read"))}
        r["x_raw"] = {what: statistics.median(values) for what, values in ratios.items()}
        rows.append([layout.split("_")[0], f"{gb:.2f}", r["files"],
                     f"{median(lambda m: m['save_s']):.1f}", f"{median(lambda m: m['raw']['write_s']):.1f}",
                     f"{r['x_raw']['save']:.2f} ({ratios['save'][0]:.2f}-{ratios['save'][-1]:.2f})",
                     f"{median(lambda m: m['resume_s']):.1f}", f"{median(lambda m: m['raw']['read_s']):.1f}",
                     f"{r['x_raw']['resume']:.2f} ({ratios['resume'][0]:.2f}-{ratios['resume'][-1]:.2f})"])
    print(f"{results['n_params'] / 1e6:.0f}M parameters, {args.nproc} CPU ranks")
    print(f"medians of {len(results[LAYOUTS[0]]['rounds'])} rounds; x raw: each round's time over the raw one of the same round (range)")
    print(table(["layout", "GB", "files", "save s", "raw write s", "save x raw", "resume s", "raw read s",
                 "resume x raw"], rows))
    for lost, where in ((results["step_time_lost"], f"{args.nproc} ranks, every core busy"),
                        (results["core_free"]["step_time_lost"], "1 rank of 1 intra-op thread, a core free for the save")):
        print(f"\n{where}: {lost['steps']} training steps with a SHARDED save after the first, against the same steps "
              f"without a save ({lost['baseline_s']:.1f} s, a step {lost['typical_step_s']:.1f} s); medians of "
              f"{lost['rounds']} rounds")
        print(_lost_table(lost))
    if not args.quick:
        write_json(ROOT / "benchmarks" / "results" / "checkpoint_io.json",
                   {"model": MODEL, "nproc": args.nproc, "machine": machine(), "results": results})


if __name__ == "__main__":
    main()
