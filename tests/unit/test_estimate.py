"""The memory estimate's neutral side (portable_fsdp/estimate/): which device a run trains on, the verdict line,
which settings are tried when a run does not fit and which of them are reported. The traced numbers themselves
are tested in tests/e2e/test_estimate.py."""
import dataclasses

import pytest

from portable_fsdp import backends, estimate

from portable_fsdp.machine import hardware
from portable_fsdp.backend import ModelInfo
from portable_fsdp.config.schema import load_recipe
from portable_fsdp.errors import UserError

GiB = 2**30


def tiny():
    return load_recipe("llama_tiny:test")


def test_named_devices_have_their_memory_and_datasheet_peak():
    h100 = estimate.resolve_target("cuda", "h100", 8)
    assert (h100.nproc, h100.memory, h100.device_type) == (8, 81559 * 2**20, "cuda")
    assert hardware.datasheet_flops(h100.label, "bfloat16") == 989e12
    v5e = estimate.resolve_target("xla", "v5e", 4)
    assert (v5e.memory, v5e.device_type) == (16 * GiB, "tpu")
    assert hardware.datasheet_flops(v5e.label, "bfloat16") == 197e12
    assert estimate.resolve_target("cuda", "A100-40", None).memory == 40 * GiB  # one rank by default


def test_host_memory_is_shared_by_the_ranks():
    two = estimate.resolve_target("cpu", "cpu", 2)
    four = two.with_nproc(4)
    assert four.memory * 4 == pytest.approx(two.memory * 2, abs=4)
    assert estimate.resolve_target("cuda", "h100", 2).with_nproc(4).memory == 81559 * 2**20  # one device each


@pytest.mark.parametrize("backend, device, field, words", [
    ("cuda", "h1000", "--device", "unknown device 'h1000'"),
    ("cuda", "v5p", "--device", "is a TPU"),
    ("xla", "h100", "--device", "is a GPU"),
    ("cpu", "h100", "--device", "--backend cpu trains in host memory"),
])
def test_devices_that_do_not_exist_or_do_not_match_the_backend_are_refused(backend, device, field, words):
    with pytest.raises(UserError) as err:
        estimate.resolve_target(backend, device, 1)
    assert err.value.field == field and words in err.value.message


def test_a_tpu_is_read_from_the_environment_or_must_be_named(monkeypatch):
    monkeypatch.delenv("TPU_ACCELERATOR_TYPE", raising=False)
    with pytest.raises(UserError, match="TPU_ACCELERATOR_TYPE"):
        estimate.resolve_target("xla", "auto", 4)
    monkeypatch.setenv("TPU_ACCELERATOR_TYPE", "v5litepod-16")
    assert estimate.resolve_target("xla", "auto", 4).label == "TPU v5 lite"


def test_the_device_picks_the_backend():
    config = tiny()
    assert backends.for_device("auto", "TPU v5p", config) == "xla"
    assert backends.for_device("auto", "NVIDIA H200", config) == "cuda"
    assert backends.for_device("auto", None, config) == "cpu"
    assert backends.for_device("flax", "TPU v5p", config) == "flax"


def result(peak, state=GiB, offload=False, ranks=(0,)):
    return {"ranks": [{"rank": r, "peak": peak, "cpu_offload": offload,
                       "held": {"parameters": state // 3, "gradients": state // 3, "optimizer": 2 * state // 3},
                       "at_peak": {}} for r in ranks],
            "model": dataclasses.asdict(ModelInfo((), (), n_params=10, n_layers=1, hidden_size=4, vocab_size=8,
                                                  root_class="X"))}


def test_verdict_is_one_line_naming_what_fits():
    target = estimate.resolve_target("cuda", "h100", 8)
    fits = estimate.Report(tiny(), target, result(30 * GiB))
    assert fits.fits and estimate.verdict(fits, []).startswith("fits: peak 30.00 GiB per rank, 71.68 GiB usable")
    big = estimate.Report(tiny(), target, result(90 * GiB))
    found = [(estimate.Alternative("--nproc 16", 16), estimate.Report(tiny(), target.with_nproc(16), result(45 * GiB)))]
    line = estimate.verdict(big, found)
    assert "\n" not in line and line.startswith("does not fit: peak 90.00 GiB per rank exceeds 71.68 GiB")
    assert line.endswith("settings that fit: --nproc 16 (peak 45.00 GiB)")
    assert "none of the settings tried fits" in estimate.verdict(big, [])


def test_settings_tried_depend_on_what_is_already_on_and_on_the_device():
    config = tiny()
    one_gpu = [a.words for group in estimate.alternative_groups(config, estimate.resolve_target("cuda", "h100", 1))
               for a in group]
    assert one_gpu[:3] == ["--nproc 2", "--nproc 4", "--nproc 8"]
    assert "--config.plan.activation_checkpointing=true" in one_gpu and "--config.plan.cpu_offload=true" in one_gpu
    assert "--config.train.grad_accum_steps=2" in one_gpu
    assert not any("tp_size" in w or "cp_size" in w for w in one_gpu)  # one rank: nothing to split over
    four_gpus = [a.words for group in estimate.alternative_groups(config, estimate.resolve_target("cuda", "h100", 4))
                 for a in group]
    assert {"--config.plan.tp_size=2", "--config.plan.tp_size=4", "--config.plan.cp_size=2"} <= set(four_gpus)
    config.plan.activation_checkpointing = True
    host = [a.words for group in estimate.alternative_groups(config, estimate.resolve_target("cpu", "cpu", 2))
            for a in group]
    assert not any("activation_checkpointing" in w or "cpu_offload" in w for w in host)  # on, and no gain on a host


class FakeEstimator:
    """Peak = 40 GiB / data-parallel ranks / 2 with activation checkpointing; records what it was asked."""

    def __init__(self, state=12 * GiB):
        self.asked, self.state = [], state

    def estimate(self, config, target, ranks):
        self.asked.append((target.nproc, config.plan.activation_checkpointing, config.train.grad_accum_steps,
                           config.plan.cpu_offload))
        peak = 40 * GiB // target.nproc // (2 if config.plan.activation_checkpointing else 1)
        return result(max(peak, self.state // target.nproc), state=self.state // target.nproc)


def test_search_reports_the_first_change_of_each_kind_that_fits_and_skips_hopeless_ones():
    config = tiny()  # batch 4: at most 4 data-parallel ranks, accumulation up to 4
    target = estimate.resolve_target("cuda", "a100-40", 1)
    target = estimate.Target("cuda", 1, "a100-40", target.label, 25 * GiB)  # 22.5 GiB usable
    fake = FakeEstimator()
    base = estimate.Report(config, target, fake.estimate(config, target, [0]))
    found = estimate.search(fake, base)
    assert [a.words for a, _ in found] == ["--nproc 2", "--config.plan.activation_checkpointing=true"]
    assert (4, False, 1, False) not in fake.asked  # --nproc 2 fitted: larger worlds are not traced
    # grad_accum_steps 2 and 4 do not lower the fake's peak; 8 does not split the batch and is never traced
    assert (1, False, 2, False) in fake.asked and (1, False, 8, False) not in fake.asked
    # parameters and AdamW's state alone (30 GiB) exceed the device: only more ranks and CPU offload are traced
    heavy = FakeEstimator(state=30 * GiB)
    found = estimate.search(heavy, estimate.Report(config, target, heavy.estimate(config, target, [0])))
    assert [a.words for a, _ in found] == ["--nproc 2"]
    assert heavy.asked == [(1, False, 1, False), (2, False, 1, False), (1, False, 1, True)]


def test_ranks_with_the_same_numbers_fold_into_one_table():
    ranks = result(GiB, ranks=(0, 1, 2, 3))["ranks"]
    ranks[3] = {**ranks[3], "peak": 2 * GiB}
    groups = estimate.rank_groups(ranks)
    assert [numbers for numbers, _ in groups] == [[0, 1, 2], [3]]
    assert estimate.rank_words([0, 1, 2], 4, False) == "ranks 0-2"
    assert estimate.rank_words([0, 7], 8, False) == "ranks 0, 7"


def test_the_report_names_where_the_ep_ranks_come_from():
    from portable_fsdp.estimate.report import mesh_words
    from portable_fsdp.plan import MeshSpec, ShardingPlan

    assert mesh_words(ShardingPlan(mesh=MeshSpec(ep_size=2).resolve(4))) == "fsdp 4 x ep 2 (of fsdp)"
    assert mesh_words(ShardingPlan(mesh=MeshSpec(ep_size=4, tp_size=2).resolve(4))) == \
        "fsdp 2 x tp 2 x ep 4 (of fsdp x tp)"


def test_check_fit_estimates_the_visible_gpu_for_torch_and_jax_alike(monkeypatch):
    """A run's device as its framework names it: cuda (torch) and gpu (JAX) are the visible GPU, traced with the
    lowering's GPU choices (flax: the grouped matmul's buffers), not host memory."""
    from portable_fsdp.estimate import fit, target

    monkeypatch.setattr(target, "_visible_gpu", lambda: ("NVIDIA H100 80GB HBM3", 80 * 2**30, 8))
    assert fit.fit_device("cuda") == fit.fit_device("GPU") == "detected"
    assert fit.fit_device("cpu") == "cpu"
    assert target.resolve_target("flax", fit.fit_device("gpu"), 8).device_type == "gpu"
    assert target.resolve_target("cuda", fit.fit_device("cuda"), 8).device_type == "cuda"
    with pytest.raises(UserError) as error:
        fit.fit_device("xpu")
    assert error.value.field == "train.check_fit" and "knows no memory size for xpu devices" in str(error.value)
