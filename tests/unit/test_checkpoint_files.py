"""Which files each process writes into a checkpoint (portable_fsdp/checkpoint/files.py), with a backend's writers
scripted: the same skeleton for every backend, without a framework."""
import concurrent.futures
import pathlib
import pickle
import threading

import pytest

from portable_fsdp.checkpoint import files as checkpoint_files, layout as checkpointing


def scripted(rank: int, full: bool, calls: list, rng: bool = True, sharded=None) -> checkpoint_files.Writer:
    """Writers that write small files and record the order they were called in."""

    def weights(directory):
        calls.append("weights")
        path = directory / f"model-{rank}.safetensors"
        path.write_bytes(b"w")
        return {path: {"bytes": 1}}

    def optimizer_state():
        calls.append("optimizer_state")
        return {"state": {}, "param_groups": []} if rank == 0 else {}

    def model_config(directory, with_weights):
        calls.append(f"model_config(full={with_weights})")
        (directory / "config.json").write_text("{}")
        return {directory / "config.json": None}

    def write_sharded(directory):
        calls.append("sharded")
        directory.mkdir(exist_ok=True)
        (directory / f"shard_{rank}").write_bytes(b"s")
        return {directory / f"shard_{rank}": None}

    def torch_save(obj, file):
        if isinstance(file, pathlib.Path):
            file.write_bytes(pickle.dumps(obj))
        else:
            file.write(pickle.dumps(obj))

    return checkpoint_files.Writer(rank=rank, full=full, weights=weights, optimizer_state=optimizer_state,
                                   model_config=model_config, sharded=sharded or write_sharded,
                                   torch_save=torch_save, rng_state=(lambda: {"seed": rank}) if rng else None)


def names(written: dict, directory: pathlib.Path) -> list:
    return sorted(str(pathlib.Path(p).relative_to(directory)) for p in written)


def test_a_full_checkpoint_gathers_the_optimizer_first_and_only_the_main_process_writes_it(tmp_path):
    calls = []
    written = checkpoint_files.write(scripted(0, True, calls), tmp_path)
    assert calls == ["optimizer_state", "weights", "model_config(full=True)"]
    assert names(written, tmp_path) == ["config.json", "model-0.safetensors", "optimizer.pt", "rng/rank_00000.pt"]
    assert written[tmp_path / checkpointing.OPTIMIZER]["bytes"] == (tmp_path / "optimizer.pt").stat().st_size
    assert pickle.loads((tmp_path / "optimizer.pt").read_bytes()) == {"state": {}, "param_groups": []}
    assert pickle.loads(checkpointing.rng_file(tmp_path, 0).read_bytes()) == {"seed": 0}

    other, directory = [], tmp_path / "rank_1"  # the same collectives, in the same order; the main process's files
    directory.mkdir()
    written = checkpoint_files.write(scripted(1, True, other), directory)
    assert other == ["optimizer_state", "weights"]
    assert names(written, directory) == ["model-1.safetensors", "rng/rank_00001.pt"]


def test_the_optimizer_state_is_written_while_the_weights_stream(tmp_path):
    optimizer_written, overlapped = threading.Event(), []
    writer = scripted(0, True, [])

    def weights(directory):
        overlapped.append(optimizer_written.wait(timeout=10))  # would time out if written after the weights
        return {}

    def torch_save(obj, file):
        writer.torch_save(obj, file)
        optimizer_written.set()

    checkpoint_files.write(writer._replace(weights=weights, torch_save=torch_save), tmp_path)
    assert overlapped == [True]


def test_a_sharded_checkpoint_has_the_config_the_rng_then_the_backends_shards(tmp_path):
    calls = []
    written = checkpoint_files.write(scripted(0, False, calls), tmp_path)
    assert calls == ["model_config(full=False)", "sharded"]
    assert names(written, tmp_path) == ["config.json", "rng/rank_00000.pt", "sharded/shard_0"]
    assert not (tmp_path / checkpointing.OPTIMIZER).exists()


def test_a_background_sharded_write_is_a_future_of_every_file(tmp_path):
    pending = concurrent.futures.Future()
    result = checkpoint_files.write(scripted(0, False, [], sharded=lambda directory: pending), tmp_path)
    assert isinstance(result, concurrent.futures.Future) and not result.done()
    pending.set_result({tmp_path / "sharded" / "late": None})
    assert names(result.result(timeout=5), tmp_path) == ["config.json", "rng/rank_00000.pt", "sharded/late"]

    failing = concurrent.futures.Future()
    result = checkpoint_files.write(scripted(1, False, [], sharded=lambda directory: failing), tmp_path)
    failing.set_exception(OSError("disk full"))
    with pytest.raises(OSError, match="disk full"):
        result.result(timeout=5)


def test_an_export_is_the_weights_and_config_alone(tmp_path):
    calls = []
    written = checkpoint_files.write_export(scripted(0, False, calls), tmp_path)
    assert calls == ["weights", "model_config(full=True)"]
    assert names(written, tmp_path) == ["config.json", "model-0.safetensors"]


def test_a_backend_without_rng_writes_no_rng_file(tmp_path):
    written = checkpoint_files.write(scripted(0, True, [], rng=False), tmp_path)
    assert not (tmp_path / "rng").exists() and "rng/rank_00000.pt" not in names(written, tmp_path)
