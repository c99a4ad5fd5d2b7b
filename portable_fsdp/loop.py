"""The backend-neutral training loop: state = init(config); state, metrics = train_step(state, batch).

It drives any module that fulfils `portable_fsdp.backend.Backend`.
"""
from __future__ import annotations

import concurrent.futures
import dataclasses
import functools
import json
import pathlib
import shutil
import statistics
import sys
import threading
import time

from portable_fsdp import async_save, checkpointing, faults, hardware
from portable_fsdp.backend import Placement
from portable_fsdp.data.batch import DATA_STATE
from portable_fsdp.data.loader import open_data
from portable_fsdp.data.tokenizers import save_for_generation
from portable_fsdp.errors import Interrupted, TrainingDiverged, UserError
from portable_fsdp.evaluation import evaluate, resolve_metrics
from portable_fsdp.interrupts import InterruptFlag
from portable_fsdp.metrics import MetricsLog, Progress, Stopwatch, flops_per_token, summary
from portable_fsdp.trackers import open_trackers


@dataclasses.dataclass
class _Best:
    """Early stopping and best-model bookkeeping, on eval_loss."""

    eval_loss: float = float("inf")
    step: int = 0
    evals_without_improvement: int = 0

    def update(self, eval_loss: float, step: int) -> bool:
        if eval_loss < self.eval_loss:
            self.eval_loss, self.step, self.evals_without_improvement = eval_loss, step, 0
            return True
        self.evals_without_improvement += 1
        return False


def run(config, plan, backend, backend_name: str, workdir: pathlib.Path) -> dict:
    state = backend.init(config, plan, backend_name)
    interrupt = InterruptFlag().install() if config.train.save_on_interrupt else None
    try:
        result = _train(config, plan, backend, backend_name, pathlib.Path(workdir), state, interrupt)
    except (UserError, TrainingDiverged, Interrupted):
        async_save.finish()  # a checkpoint still being written in the background is committed first
        backend.finalize(state)  # every rank stops here together: leave the process group cleanly
        raise
    finally:
        if interrupt:
            interrupt.uninstall()
    # An unexpected error skips finalize: tearing the process group down would let the other ranks fail on the
    # closed connection before this rank's error is recorded (and a collective left half-done may hang the
    # teardown); the process exits instead, and the launcher names this rank.
    backend.finalize(state)
    return result


def _train(config, plan, backend, backend_name, workdir, state, interrupt) -> dict:
    t = config.train
    where = backend.placement(state)
    is_main = where.rank == 0
    info = backend.model_info(state)
    batches, evals = open_data(config, info.vocab_size, where.dp_rank, where.dp_size)
    metrics_fn = resolve_metrics(t.compute_metrics)
    manifest_info = _manifest_info(config, plan, backend_name, where)
    if t.resume and checkpointing.latest(workdir):
        state = _resume(backend, state, checkpointing.latest(workdir), config, backend_name)
        batches.restore(checkpointing.latest(workdir), state.step)  # a streamed corpus: where it stood
    elif t.resume and is_main:  # e.g. the first start of a job that always passes resume=true
        print(f"warning: train.resume=true but {workdir} holds no checkpoint to resume from; starting from step 0",
              file=sys.stderr, flush=True)
    start = state.step
    reported = open_trackers(config, workdir, start, {"backend": backend_name, "world_size": where.world_size}) \
        if is_main else None
    log = MetricsLog(workdir, is_main, reported)
    log.write({"step": start, "event": "start", **backend.memory_report(state)})  # memory once the model is loaded
    progress = Progress(t.steps, start, is_main and t.progress_bar)
    model_flops = flops_per_token(info, config.data.seq_len)
    peak = hardware.peak_flops_per_device(t.peak_flops_per_device, backend.device_kind(state),
                                          plan.mixed_precision.param_dtype,
                                          lambda size, dtype: backend.time_matmul(state, size, dtype))
    clock, step_times, window, first_loss, last = Stopwatch(), [], [], None, {}
    bookkeeping = 0.0  # seconds of logging, metrics and progress bar between steps (eval and saves excluded)
    saved, evaluated, stop_reason, skipped = None, None, None, 0
    best = _Best()
    if t.resume and checkpointing.best_record(workdir):  # keep comparing against the best before the stop
        record = checkpointing.best_record(workdir)
        best = _Best(record["eval_loss"], record["step"], record["evals_without_improvement"])
    for step in range(start, t.steps):
        began = time.perf_counter()
        state, m = backend.train_step(state, batches.micro_batches(step, where.dp_rank, where.dp_size))
        faults.check("step", where.rank, state.step)
        seconds = time.perf_counter() - began
        step_times.append(seconds)
        window.append((m["tokens"], seconds))
        first_loss = m["loss"] if first_loss is None else first_loss
        skipped += bool(m.get("skipped"))
        last = m
        progress.update({"loss": f"{m['loss']:.4f}", "lr": f"{m['lr']:.2e}"})
        done = state.step
        if done % t.log_every == 0 or done == t.steps:
            tokens_per_sec = sum(n for n, _ in window) / sum(s for _, s in window)
            log.write({"step": done, "loss": m["loss"], "lr": m["lr"], "grad_norm": m["grad_norm"],
                       "skipped_steps": skipped,
                       "tokens_per_sec": tokens_per_sec, "mfu": model_flops * tokens_per_sec / (peak * where.world_size),
                       "epoch": batches.epoch_of(done), **backend.memory_report(state)})
            window = []
        bookkeeping += time.perf_counter() - began - seconds
        improved = False
        if (t.eval_every and done % t.eval_every == 0) or done == t.steps:
            evaluated = {"step": done, **evaluate(backend, state, evals, compute_metrics=metrics_fn)}
            log.write(evaluated)
            improved = best.update(evaluated["eval_loss"], done)
            if t.early_stopping_patience and best.evals_without_improvement >= t.early_stopping_patience:
                stop_reason = f"early stopping: no better eval_loss in {t.early_stopping_patience} evals"
        if done == t.stop_at_step:
            stop_reason = f"train.stop_at_step={done}"
        # Ranks may see a signal at different steps: agree (one tiny collective) before acting on it.
        interrupted = interrupt is not None and backend.any_rank(state, bool(interrupt.requested))
        if interrupted:
            stop_reason = "interrupted"
        due = (t.save_every and done % t.save_every == 0) or done == t.steps or stop_reason
        if due or (improved and t.load_best_model_at_end):
            saved = save(backend, state, workdir, manifest_info, t.keep_last_n, is_main,
                         best=dataclasses.asdict(best) if improved and t.load_best_model_at_end else None,
                         data_state=batches.state_at(done))
        if interrupted:
            progress.close()
            raise Interrupted(interrupt.requested or "a signal on another rank", saved)
        if stop_reason:
            break
    progress.close()
    async_save.finish()
    end_step = state.step
    if t.load_best_model_at_end and checkpointing.best(workdir):
        state = _resume(backend, state, checkpointing.best(workdir), config, backend_name)
    exported = None
    if t.export_full_at_end and (end_step == t.steps or (stop_reason or "").startswith("early stopping")):
        if plan.state_dict_type.value == "FULL_STATE_DICT":
            if is_main:
                print(f"warning: train.export_full_at_end has nothing to do with FULL_STATE_DICT: the last checkpoint "
                      f"({saved}) is already what from_pretrained loads", file=sys.stderr, flush=True)
        else:  # the weights of the state trained (the best model's with train.load_best_model_at_end)
            exported = export(backend, state, workdir, manifest_info, is_main)
    if step_times:
        # against typical steps: the first one (lazy initialisation, first allocations) is no yardstick
        typical = statistics.median(step_times) * len(step_times)
        log.write({"step": end_step, "event": "end", "step_seconds_median": statistics.median(step_times),
                   "bookkeeping_fraction": bookkeeping / typical})
    log.close()
    result = _summary(backend_name, where, start, end_step, clock.seconds(), step_times, first_loss, last,
                      evaluated, saved, model_flops, peak, config)
    if step_times:
        result["logging overhead"] = f"{100 * bookkeeping / typical:.2f}% of step time"
    if stop_reason:
        result["stopped"] = stop_reason
    if exported:
        result["export"] = str(exported)
    if t.load_best_model_at_end and best.step:
        result["best model"] = f"step {best.step}, eval_loss {best.eval_loss:.4f} ({checkpointing.best(workdir)})"
    if is_main:
        print(summary(result), flush=True)
    return result


def _resume(backend, state, path: pathlib.Path, config, backend_name: str):
    """Every rank checks every file's size, then checksums its share of the bytes in a thread while the checkpoint
    loads (the load only fills memory, and hashing releases the interpreter's lock): training starts only once
    every rank's share has matched."""
    where = backend.placement(state)
    try:
        manifest, problem = checkpointing.verify_sizes(path), None
    except UserError as err:
        manifest, problem = None, err
    _stop_together(backend, state, config, problem, path)  # before the load's collectives
    checkpointing.check_compatible(manifest, config, backend_name)
    dtype = manifest.get("weights_dtype", "float32")
    if dtype != "float32" and where.rank == 0:
        print(f"warning: {path.name} holds its weights in {dtype} (train.save_dtype): they are cast back to the "
              "training dtype, so this resume is not bit-exact", file=sys.stderr, flush=True)
    stop = threading.Event()
    with concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="portable_fsdp-verify") as pool:
        checking = pool.submit(checkpointing.verify_checksums, path, manifest, where.rank, where.processes, stop)
        try:
            state = backend.load_checkpoint(state, path, manifest)
        except BaseException as err:  # dcp's CheckpointException is not an Exception
            stop.set()
            if isinstance(err, (KeyboardInterrupt, SystemExit, Interrupted)):
                raise
            # bytes that do not parse: a corrupt file is named, whichever rank's share it is in
            found = checking.exception()
            if found is None:
                checkpointing.verify_checksums(path, manifest)
                raise
            raise found from None
        problem = checking.exception()
    _stop_together(backend, state, config, problem, path)
    return state


def _stop_together(backend, state, config, problem: UserError | None, path: pathlib.Path) -> None:
    """A file found corrupt by one rank stops every rank, with its line on the rank that found it."""
    if backend.placement(state).processes > 1:
        backend.barrier(state, timeout_s=_io_timeout(backend, state, config.train))
        if backend.any_rank(state, problem is not None) and problem is None:
            problem = UserError("train.resume", f"another rank found a file of {path} that does not match its "
                                f"checksum in {checkpointing.MANIFEST} (its line names it); resume from another checkpoint")
    if problem:
        raise problem


def _io_timeout(backend, state, train) -> float:
    """The bound on every wait around a save or a verification: the same number on every rank."""
    return checkpointing.wait_bound_s(backend.model_info(state).n_params, train["collective_timeout_s"])


def save(backend, state, workdir: pathlib.Path, info: dict, keep_last_n: int, is_main: bool,
         best: dict | None = None, data_state: dict | None = None) -> pathlib.Path:
    """Stage, write (each rank checksumming its own files), then commit atomically on rank 0 (see
    portable_fsdp.checkpointing). The waits allow for the bytes to write (checkpointing.io_timeout_s).
    `data_state`: the loader's position (a streamed corpus), kept as data_state.json."""
    async_save.finish()  # a save still in flight (train.async_save) is committed before the next is staged
    rank = backend.placement(state).rank
    timeout = _io_timeout(backend, state, info["config"]["train"])
    staging = checkpointing.staging_dir(workdir, state.step)
    if is_main:
        checkpointing.prepare_staging(workdir, state.step)
    backend.barrier(state, timeout_s=timeout)
    faults.check("save.staged", rank, state.step)
    result = backend.save_checkpoint(state, staging)
    in_background = result if isinstance(result, concurrent.futures.Future) else None  # train.async_save
    written = dict((None if in_background else result) or {})
    if is_main:  # what pipeline("text-generation", model=<checkpoint>) needs besides the model
        written.update(save_for_generation(info["config"]["data"]["tokenizer"], staging))
        if data_state is not None:
            (staging / DATA_STATE).write_text(json.dumps(data_state) + "\n")
            written[staging / DATA_STATE] = None
    final = checkpointing.root(workdir) / f"step_{state.step:08d}"
    commit = functools.partial(_commit, workdir, final, state.step, info, keep_last_n, best) if is_main else None
    if in_background:  # reported when written; rank 0 commits once every rank has reported (async_save.py)
        async_save.start(in_background, staging, rank, state.step, written, backend.placement(state).processes,
                         timeout, commit)
        return final
    checkpointing.write_report(staging, rank, written)
    faults.check("save.written", rank, state.step)
    backend.barrier(state, timeout_s=timeout)
    if commit:
        commit()
    backend.barrier(state, timeout_s=timeout)
    return final


def export(backend, state, workdir: pathlib.Path, info: dict, is_main: bool) -> pathlib.Path:
    """train.export_full_at_end: the model as a FULL checkpoint holds it, without optimizer state, into
    <workdir>/export; staged and renamed as a save is, with a manifest (checkpointing.commit_export)."""
    rank = backend.placement(state).rank
    timeout = _io_timeout(backend, state, info["config"]["train"])
    staging = checkpointing.export_staging(workdir)
    if is_main:
        shutil.rmtree(staging, ignore_errors=True)
        staging.mkdir(parents=True)
    backend.barrier(state, timeout_s=timeout)
    written = dict(backend.export_weights(state, staging))
    if is_main:
        written.update(save_for_generation(info["config"]["data"]["tokenizer"], staging))
    checkpointing.write_report(staging, rank, written)
    backend.barrier(state, timeout_s=timeout)
    if is_main:
        checkpointing.commit_export(workdir, {**info, "state_dict_type": "FULL_STATE_DICT",
                                              "step": state.step, "export": True,
                                              "weights_dtype": info["config"]["train"]["save_dtype"]})
    backend.barrier(state, timeout_s=timeout)
    return pathlib.Path(workdir) / checkpointing.EXPORT


def _commit(workdir: pathlib.Path, final: pathlib.Path, step: int, info: dict, keep_last_n: int,
            best: dict | None) -> None:
    """Rank 0, once every rank has written and reported its files."""
    if best:  # before the commit prunes, so the new best is spared
        checkpointing.mark_best(workdir, final, best)
    if info["state_dict_type"] == "FULL_STATE_DICT":
        info = {**info, "weights_dtype": info["config"]["train"]["save_dtype"]}
    checkpointing.commit(workdir, step, info, keep_last_n)


def _manifest_info(config, plan, backend_name: str, where: Placement) -> dict:
    return {"backend": backend_name, "world_size": where.world_size,
            "state_dict_type": plan.state_dict_type.value,
            "plan": json.loads(json.dumps(dataclasses.asdict(plan), default=str)),
            "config": config.to_dict()}


def _summary(backend_name, where, start, end, seconds, step_times, first_loss, last, evaluated, saved,
             model_flops, peak, config) -> dict:
    steady = sorted(step_times[1:] or step_times)
    tokens_per_step = config.train.batch_size * config.data.seq_len
    median = statistics.median(steady) if steady else float("nan")
    result = {"backend": f"{backend_name}, {where.world_size} rank(s)",
              "steps": f"{start} -> {end} in {seconds:.1f} s"}
    if last:
        result["loss"] = f"{first_loss:.4f} -> {last['loss']:.4f}"
        result["tokens/s (median step)"] = f"{tokens_per_step / median:,.0f}"
        result["MFU"] = f"{100 * model_flops * tokens_per_step / median / (peak * where.world_size):.2f}%"
    if evaluated:
        extra = "".join(f", {k} {v:.4f}" for k, v in evaluated.items()
                        if k.startswith("eval_") and k not in ("eval_loss", "eval_tokens"))
        result["eval_loss"] = (f"{evaluated['eval_loss']:.4f} (perplexity {evaluated['perplexity']:.2f}, "
                               f"{evaluated['eval_tokens']} tokens{extra})")
    if saved:
        result["checkpoint"] = str(saved)
    return result
