"""Every model family trains on --backend cpu (2 gloo ranks) from `model.init_from`, with the losses of a
single-process plain-torch run of the same model, or is refused at start-up with one `error:` line naming the
fix (exit 2, nothing written). The families' tiny models: tests/parity/families.py; the grid: docs/models.md.
One representative runs by default (Mixtral: experts and the router loss; Qwen2's biases train by default in the Qwen2.5 recipe's smoke run); the rest are slow."""
import pytest

from tests.conftest import cli
from tests.parity import families

SLOW = pytest.mark.slow
FAMILIES = [pytest.param(f, marks=SLOW) for f in families.FAMILIES]  # MoE on cpu by default: tests/e2e/test_recipes.py


@pytest.mark.parametrize("family", FAMILIES)
def test_family_trains_like_plain_torch_on_cpu(family, tmp_path, tmp_path_factory):
    model = families.saved(tmp_path_factory, family)
    families.assert_trains_like_plain_torch("cpu", model, tmp_path)


def refused(tmp_path, backend: str, model, extra: dict) -> str:
    """The stderr line of a run refused at start-up (asserting exit 2, one line, an untouched workdir)."""
    workdir = tmp_path / "run"
    proc = cli(["--backend", backend, "--nproc", "2", *families.cli_args(model, workdir, extra)], cwd=tmp_path)
    assert proc.returncode == 2, proc.stderr[-3000:]
    assert not workdir.exists()
    errors = [line for line in proc.stderr.splitlines() if line.startswith("error:")]
    assert len(errors) == 1 and "Traceback" not in proc.stderr
    return errors[0]


def test_gpt2_attention_dropout_under_context_parallelism_is_refused(tmp_path):
    model = families.gpt2_with_dropout(tmp_path / "gpt2")
    assert refused(tmp_path, "cpu", model, {"plan.cp_size": 2}) == (
        "error: model.attention_dropout: = 0.1 (the model's attn_pdrop): the portable context-parallel attention "
        "applies no dropout; set the model's attn_pdrop to 0 in its config.json, or plan.cp_size=1")


@SLOW
def test_sliding_window_shorter_than_the_sequence_under_context_parallelism_is_refused(tmp_path, tmp_path_factory):
    model = families.saved(tmp_path_factory, "mistral")  # window 32, sequences of 64
    assert refused(tmp_path, "cpu", model, {"plan.cp_size": 2}) == (
        "error: model.sliding_window: = 32 (the model's sliding attention window) is shorter than data.seq_len=64, "
        "and context-parallel attention on --backend cpu attends to the whole causal prefix; set data.seq_len to "
        "at most 32, or plan.cp_size=1 (--backend xla splits sequences with the model's own attention)")


@pytest.mark.parametrize("family", [pytest.param(f, marks=() if f == "gemma" else SLOW) for f in ("gemma", "gpt2")])
def test_flax_refuses_the_families_it_does_not_build(family, tmp_path, tmp_path_factory):
    model = families.saved(tmp_path_factory, family)
    assert refused(tmp_path, "flax", model, {}) == (
        f"error: model.model_type: {family} is not implemented by --backend flax, which builds llama, qwen2, "
        "mistral, mixtral models; train it with --backend cpu, cuda or xla")


def test_tensor_parallelism_on_a_model_without_a_plan_is_refused(tmp_path, tmp_path_factory):
    model = families.saved(tmp_path_factory, "gpt2")  # transformers ships no base_model_tp_plan for GPT-2
    assert refused(tmp_path, "cpu", model, {"plan.tp_size": 2}).startswith(
        "error: plan.tp_size: 2 needs a tensor-parallel plan and GPT2LMHeadModel ships none (no base_model_tp_plan "
        "in its config): give one as plan.tp_plan")
