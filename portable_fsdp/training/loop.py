"""The backend-neutral training loop: state = backend.init(config, plan, name); then state, metrics =
backend.train_step(state, micro_batches) step after step, with evaluation, logging and checkpoints between.

It drives any module that fulfils `portable_fsdp.backend.Backend`; its checkpoints are saved, resumed and
exported through portable_fsdp.checkpoint.session.
"""
from __future__ import annotations

import dataclasses
import pathlib
import statistics
import sys
import time

from portable_fsdp.checkpoint import async_save, layout as checkpointing, session as checkpoint_session

from portable_fsdp.machine import hardware

from portable_fsdp.training import faults
from portable_fsdp.training.callbacks import Callbacks
from portable_fsdp.training.parts import NONE as NO_PARTS, Parts
from portable_fsdp.data.loader import open_data
from portable_fsdp.errors import Interrupted, TrainingDiverged, UserError, notify
from portable_fsdp.training.evaluation import evaluate, resolve_metrics, resolve_preprocess
from portable_fsdp.launch.interrupts import InterruptFlag
from portable_fsdp.training.metrics import MetricsLog, Progress, Stopwatch, flops_per_token, summary
from portable_fsdp.training.profiling import StepProfiler, profile_window
from portable_fsdp.training.trackers import open_trackers


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


def run(config, plan, backend, backend_name: str, workdir: pathlib.Path, callbacks=(), parts: Parts = NO_PARTS) -> dict:
    """`callbacks`: portable_fsdp.training.callbacks' hooks, called on global rank 0; `parts`: the model, loss,
    optimizer and schedule brought in place of the config's (portable_fsdp.training.parts)."""
    state = backend.init(config, plan, backend_name, parts)
    interrupt = InterruptFlag().install() if config.train.save_on_interrupt else None
    try:
        result = _train(config, plan, backend, backend_name, pathlib.Path(workdir), state, interrupt, callbacks,
                        parts.schedule is not None)
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


def _train(config, plan, backend, backend_name, workdir, state, interrupt, callbacks, own_schedule=False) -> dict:
    t = config.train
    where = backend.placement(state)
    is_main = where.rank == 0
    hooks = Callbacks(callbacks, is_main)
    info = backend.model_info(state)
    batches, evals = open_data(config, info.vocab_size, where.dp_rank, where.dp_size)
    metrics_fn = resolve_metrics(t.compute_metrics)
    preprocess = resolve_preprocess(t.preprocess_logits_for_metrics, metrics_fn)
    manifest_info = checkpoint_session.manifest_info(config, plan, backend_name, where)
    if t.resume and checkpointing.latest(workdir):
        state = checkpoint_session.resume(backend, state, checkpointing.latest(workdir), config, backend_name)
        batches.restore(checkpointing.latest(workdir), state.step)  # a streamed corpus: where it stood
    elif t.resume and is_main:  # e.g. the first start of a job that always passes resume=true
        print(f"warning: train.resume=true but {workdir} holds no checkpoint to resume from; starting from step 0",
              file=sys.stderr, flush=True)
    start = state.step
    reported = open_trackers(config, workdir, start, {"backend": backend_name, "world_size": where.world_size}) \
        if is_main else None
    log = MetricsLog(workdir, is_main, reported)
    log.write({"step": start, "event": "start", **backend.memory_report(state)})  # memory once the model is loaded
    if is_main:
        print(summary(_startup(config, plan, info, backend_name, where, backend.device_kind(state), workdir,
                               own_schedule)),
              flush=True)
    progress = Progress(t.steps, start, is_main and t.progress_bar)
    profiled = profile_window(t.profile_steps, t.steps)
    profiler = StepProfiler(backend, profiled, workdir / "profile")
    if t.memory_snapshot or profiled:  # asked for, or beside a trace
        watched = backend.watch_memory(state, workdir / "memory_snapshot.pickle")
        if t.memory_snapshot and not watched and is_main:
            notify(f"train.memory_snapshot has no effect on {backend_name}: only CUDA's allocator keeps a history")
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
        with profiler.step(state, step + 1):
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
            record = {"step": done, "loss": m["loss"], "lr": m["lr"], "grad_norm": m["grad_norm"],
                      "skipped_steps": skipped,
                      "tokens_per_sec": tokens_per_sec, "mfu": model_flops * tokens_per_sec / (peak * where.world_size),
                      "epoch": batches.epoch_of(done), **backend.memory_report(state)}
            log.write(record)
            progress.log(record)
            window = []
        bookkeeping += time.perf_counter() - began - seconds
        stopped_by = hooks.call("on_step", state, {**m, "step": done})
        improved = False
        if (t.eval_every and done % t.eval_every == 0) or done == t.steps:
            evaluated = {"step": done, **evaluate(backend, state, evals, compute_metrics=metrics_fn,
                                                     preprocess_logits=preprocess)}
            log.write(evaluated)
            improved = best.update(evaluated["eval_loss"], done)
            if t.early_stopping_patience and best.evals_without_improvement >= t.early_stopping_patience:
                stop_reason = f"early stopping: no better eval_loss in {t.early_stopping_patience} evals"
            stopped_by = stopped_by or hooks.call("on_eval", state, evaluated)
        if hooks.given and backend.any_rank(state, stopped_by is not None):  # rank 0 decided: every rank stops
            stop_reason = stopped_by or "a callback stopped training"
        if done == t.stop_at_step:
            stop_reason = f"train.stop_at_step={done}"
        # Ranks may see a signal at different steps: agree (one tiny collective) before acting on it.
        interrupted = interrupt is not None and backend.any_rank(state, bool(interrupt.requested))
        if interrupted:
            stop_reason = "interrupted"
        due = (t.save_every and done % t.save_every == 0) or done == t.steps or stop_reason
        if due or (improved and t.load_best_model_at_end):
            new_best = dataclasses.asdict(best) if improved and t.load_best_model_at_end else None
            saved = checkpoint_session.save(backend, state, workdir, manifest_info, t.keep_last_n, best=new_best,
                                            data_state=batches.state_at(done))
            hooks.call("on_save", state, saved)
        if interrupted:
            profiler.stop(state)
            progress.close()
            raise Interrupted(interrupt.requested or "a signal on another rank", saved)
        if stop_reason:
            break
    profiler.stop(state)
    progress.close()
    async_save.finish()
    end_step = state.step
    if t.load_best_model_at_end and checkpointing.best(workdir):
        state = checkpoint_session.resume(backend, state, checkpointing.best(workdir), config, backend_name)
    exported = None
    if t.export_full_at_end and (end_step == t.steps or (stop_reason or "").startswith("early stopping")):
        if plan.state_dict_type.value == "FULL_STATE_DICT" and not config.model.peft.type:  # (adapters: merged)
            if is_main:
                print(f"warning: train.export_full_at_end has nothing to do with FULL_STATE_DICT: the last checkpoint "
                      f"({saved}) is already what from_pretrained loads", file=sys.stderr, flush=True)
        else:  # the weights of the state trained (the best model's with train.load_best_model_at_end)
            exported = checkpoint_session.export(backend, state, workdir, manifest_info)
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


def _startup(config, plan, info, backend_name, where, device_kind, workdir, own_schedule=False) -> dict:
    """What a run is, printed once by rank 0 before its first step: the head of a log someone reads later.
    `own_schedule`: the learning rate comes from a schedule passed in, not from train.lr and its shape."""
    mesh = dataclasses.asdict(plan.mesh)
    axes = " x ".join(f"{name.removesuffix('_size')} {size}" for name, size in mesh.items() if size != 1)
    precision = plan.mixed_precision
    d, t = config.data, config.train
    name = " ".join(part for part in (info.root_class, f"({info.model_type})" if info.model_type else "") if part)
    return {"model": f"{name or config.model.architecture}, {info.n_params / 1e6:,.2f}M parameters, "
                     f"{info.n_layers} layers, hidden {info.hidden_size}, vocab {info.vocab_size}",
            "backend": f"{backend_name}, {where.world_size} rank(s) in {where.processes} process(es)",
            "devices": f"{where.world_size} x {device_kind}",
            "mesh": axes or "one rank",
            "precision": f"compute {precision.param_dtype}, gradient reduction {precision.reduce_dtype}",
            "data": f"{d.source} ({d.format}, tokenizer {d.tokenizer}), {d.seq_len} tokens per sequence, "
                    f"{t.batch_size} sequences per step",
            "steps": f"{t.steps} (lr from the schedule passed in)" if own_schedule else
                     f"{t.steps} (lr {t.lr:g}, {t.lr_schedule}, warm-up {t.warmup_steps})",
            "workdir": str(workdir)}


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
