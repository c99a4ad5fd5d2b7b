"""The torchao release that goes with each torch (its compiled parts load only into the torch they were built for)."""
import pytest

from portable_fsdp.machine import gpu_packages


@pytest.mark.parametrize("torch_version, torchao", [("2.9.0", "0.14.1"), ("2.9.1+cu128", "0.14.1"),
                                                    ("2.10.1+cu128", "0.16.0"), ("2.11.0+cu130", "0.17.0"),
                                                    ("2.14.1", "0.17.0")])
def test_the_torchao_release_follows_torch(torch_version, torchao):
    assert gpu_packages.torchao_for(torch_version) == torchao


def test_a_torch_before_2_9_is_refused():
    with pytest.raises(ValueError, match="needs torch 2.9 or newer"):
        gpu_packages.torchao_for("2.8.0")
