"""Reading back what the trackers wrote: TensorBoard's event files and a W&B offline run's `.wandb` log."""
import json
import struct
import time


def tensorboard_events(logdir):
    """TensorBoard's own reader over a log directory (it applies the purges a resumed writer asks for)."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    events = EventAccumulator(str(logdir), size_guidance={"scalars": 0, "tensors": 0})
    events.Reload()
    return events


def scalar_steps(events, tag) -> list:
    return [(e.step, round(e.value, 6)) for e in events.Scalars(tag)]


def wandb_records(run_dir):
    """The records of an offline run's run-<id>.wandb: a 7-byte header (`:W&B`, magic, version), then LevelDB's
    log format — 32 KiB blocks of chunks (crc32, length, type: 1 full, 2 first, 3 middle, 4 last) holding
    wandb's `Record` protobufs. wandb has no public reader of it."""
    from wandb.proto import wandb_internal_pb2

    [path] = run_dir.glob("run-*.wandb")
    data, block, pos, pending = path.read_bytes(), 32768, 7, b""
    assert data[:4] == b":W&B"
    while pos + 7 <= len(data):
        if block - pos % block < 7:  # a block's tail too short for a chunk header is padding
            pos += block - pos % block
            continue
        _, length, kind = struct.unpack("<IHB", data[pos:pos + 7])
        if pos + 7 + length > len(data):  # wandb's service is still writing this chunk: read it on the next poll
            return
        pending += data[pos + 7:pos + 7 + length]
        pos += 7 + length
        if kind in (1, 4):
            record = wandb_internal_pb2.Record()
            record.ParseFromString(pending)
            pending = b""
            yield record


def wandb_finished(run_dir, timeout_s: float = 60.0) -> None:
    """Wait for the run's `exit` record: `run.finish()` returns before wandb's service has written the run out."""
    deadline = time.monotonic() + timeout_s
    while not any(r.WhichOneof("record_type") == "exit" for r in wandb_records(run_dir)):
        assert time.monotonic() < deadline, f"{run_dir} has no exit record after {timeout_s} s"
        time.sleep(0.1)


def wandb_history(run_dir) -> list:
    """Each logged row of the run as {key: value} (wandb's own `_step`, `_runtime`, `_timestamp` included)."""
    wandb_finished(run_dir)
    return [{item.key or "/".join(item.nested_key): json.loads(item.value_json) for item in record.history.item}
            for record in wandb_records(run_dir) if record.WhichOneof("record_type") == "history"]


def wandb_config(run_dir) -> dict:
    wandb_finished(run_dir)
    config = {}
    for record in wandb_records(run_dir):
        if record.WhichOneof("record_type") == "config":
            config.update({item.key: json.loads(item.value_json) for item in record.config.update})
    return config
