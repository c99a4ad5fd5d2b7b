"""FULL checkpoints' weight files written a tensor at a time by several ranks (portable_fsdp/checkpoint/safetensors_shards.py):
what the safetensors library and transformers' index reader see, and how a missing shard is refused."""
import json

import numpy as np
import pytest
import xxhash

from portable_fsdp.checkpoint import safetensors_shards as shards
from tests.unit._helpers import user_error


def tensors():
    rng = np.random.default_rng(0)
    return {"embed.weight": rng.standard_normal((10, 8), dtype=np.float32),
            "layers.0.weight": rng.standard_normal((8, 8), dtype=np.float32),
            "layers.0.bias": rng.standard_normal((8,), dtype=np.float32),
            "layers.1.weight": rng.standard_normal((8, 8), dtype=np.float32),
            "step": np.array(7, dtype=np.int64),
            "head.weight": rng.standard_normal((10, 8), dtype=np.float32)}


def write(directory, values, max_bytes, world_size):
    """Every rank writes what it owns, in order, as the backends do; returns {path: digest} of all ranks."""
    entries = [shards.Tensor(n, v.dtype.name, v.shape) for n, v in values.items()]
    written = {}
    for rank in range(world_size):
        writer = shards.Writer(directory, entries, max_bytes, rank, world_size)
        for name, value in values.items():
            if writer.owner(name) == rank:
                writer.write(name, np.ascontiguousarray(value).reshape(-1).view(np.uint8))
        written.update(writer.close())
    return written


@pytest.mark.parametrize("text, expected", [("5GB", 5 * 10**9), ("1MB", 10**6), ("500kb", 500_000),
                                            ("2GiB", 2 * 2**30), ("1.5MB", 1_500_000), ("123", 123), ("64 B", 64)])
def test_sizes_read_as_transformers_reads_them(text, expected):
    assert shards.parse_size(text) == expected


@pytest.mark.parametrize("text", ["", "5 lots", "-1MB", "0GB", "GB"])
def test_a_size_that_is_not_one_is_refused(text):
    with pytest.raises(ValueError, match="is not a size such as 5GB"):
        shards.parse_size(text)


def test_shards_are_cut_in_order_and_a_large_tensor_gets_its_own():
    entries = [shards.Tensor(n, "float32", s) for n, s in [("a", (10,)), ("b", (10,)), ("big", (100,)), ("c", (5,))]]
    planned = shards.plan_shards(entries, max_bytes=80)
    assert [[t.name for t in s] for s in planned] == [["a", "b"], ["big"], ["c"]]
    assert shards.file_names(3) == ["model-00001-of-00003.safetensors", "model-00002-of-00003.safetensors",
                                    "model-00003-of-00003.safetensors"]
    assert shards.file_names(1) == ["model.safetensors"]


@pytest.mark.parametrize("world_size", [1, 2, 3])
def test_ranks_write_their_shards_and_the_files_read_back_as_safetensors(tmp_path, world_size):
    from safetensors.numpy import load_file

    values = tensors()
    written = write(tmp_path, values, max_bytes=400, world_size=world_size)
    index = json.loads((tmp_path / shards.INDEX).read_text())
    files = sorted(set(index["weight_map"].values()))
    assert len(files) >= 3 and index["metadata"]["total_size"] == sum(v.nbytes for v in values.values())
    assert set(written) == {tmp_path / f for f in files} | {tmp_path / shards.INDEX}
    read = {}
    for name in files:
        read.update(load_file(tmp_path / name))
        data = (tmp_path / name).read_bytes()
        assert written[tmp_path / name] == {"bytes": len(data), "xxh3_128": xxhash.xxh3_128(data).hexdigest()}
    assert read.keys() == values.keys() and all(np.array_equal(read[n], values[n]) for n in values)
    assert shards.weight_files(tmp_path, "train.resume") == [tmp_path / f for f in files]


def test_one_shard_is_model_safetensors_without_index(tmp_path):
    from safetensors import safe_open

    write(tmp_path, tensors(), max_bytes=10**9, world_size=2)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["model.safetensors"]
    with safe_open(str(tmp_path / "model.safetensors"), framework="np") as f:
        assert f.metadata() == {"format": "pt"} and list(f.keys()) == sorted(tensors())
    assert shards.weight_files(tmp_path, "train.resume") == [tmp_path / "model.safetensors"]


def test_a_rank_writing_out_of_order_or_the_wrong_size_is_stopped(tmp_path):
    entries = [shards.Tensor("a", "float32", (2,)), shards.Tensor("b", "float32", (2,))]
    writer = shards.Writer(tmp_path, entries, 10**9, 0, 1)
    with pytest.raises(ValueError, match="writes b, expected a"):
        writer.write("b", np.zeros(2, np.float32).view(np.uint8))
    with pytest.raises(ValueError, match="4 bytes, its float32 \\[2\\] take 8"):
        writer.write("a", np.zeros(1, np.float32).view(np.uint8))
    writer.write("a", np.zeros(2, np.float32).view(np.uint8))
    with pytest.raises(ValueError, match="wrote 1 of its 2 tensors"):
        writer.close()


def test_an_index_naming_a_missing_file_is_one_line_naming_the_field(tmp_path):
    write(tmp_path, tensors(), max_bytes=400, world_size=2)
    (tmp_path / "model-00002-of-00004.safetensors").unlink()
    with user_error("model.init_from", "model.safetensors.index.json names model-00002-of-00004.safetensors, which "
                                       "is missing: the checkpoint is incomplete; copy the file back or use another"):
        shards.weight_files(tmp_path, "model.init_from")
    (tmp_path / shards.INDEX).write_text("{not json")
    with user_error("train.resume", "is unreadable (no weight_map)"):
        shards.weight_files(tmp_path, "train.resume")
