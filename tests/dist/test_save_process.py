"""The background checkpoint writer process of train.async_save on torch (backends/torch/save_process.py), on 2
gloo ranks: save_process_check.py."""
import psutil

from tests.dist.launch import torchrun


def test_each_rank_writes_through_its_own_process_which_survives_ctrl_c_and_reports_failures(tmp_path):
    before = {p.pid for p in psutil.Process().children(recursive=True)}
    torchrun(2, "tests/dist/save_process_check.py", str(tmp_path), timeout=300)
    assert {p.pid for p in psutil.Process().children(recursive=True)} <= before  # no writer outlives its rank
    assert (tmp_path / "four" / ".metadata").is_file() and not (tmp_path / "five").exists()


def test_the_update_after_a_background_save_waits_for_its_copy_of_the_state(tmp_path):
    torchrun(2, "tests/dist/async_staging_check.py", str(tmp_path), timeout=300)
    assert (tmp_path / "checkpoints" / "latest").read_text().strip() == "step_00000001"
