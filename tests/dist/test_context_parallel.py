"""Context parallelism on gloo: the portable attention against unsharded SDPA, training against the
single-process reference, and eval_loss / predictions under CP against cp=1."""
import json
import os

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from portable_fsdp.training.sequence_split import shard_indices
from tests.dist import eval_reference
from tests.dist.eval_reference import EVAL_RTOL, check_eval_loss, check_predictions
from tests.dist.launch import torchrun
from tests.parity.matrix import VARIANTS, make_config, variants_for
from tests.parity.reference import max_relative_difference, reference_losses

HERE = os.path.dirname(__file__)
STEPS = 20
# The context-parallel variants of the matrix the cpu lowering runs by default, on 2 and 4 ranks.
CP_VARIANTS = [n for n in variants_for("cpu") if int(VARIANTS[n].overrides.get("plan.cp_size", 1)) > 1]
WORLD2 = [n for n in CP_VARIANTS if VARIANTS[n].world == 2]
WORLD4 = [n for n in CP_VARIANTS if VARIANTS[n].world == 4]


def mesh_of(name: str) -> tuple:
    """(fsdp, cp) of a variant."""
    cp = int(VARIANTS[name].overrides["plan.cp_size"])
    return VARIANTS[name].world // cp, cp


@pytest.fixture(scope="module")
def cp_results(tmp_path_factory):
    out = tmp_path_factory.mktemp("cp")
    torchrun(2, os.path.join(HERE, "fsdp_variants.py"), str(out / "w2.json"), str(STEPS), *WORLD2)
    torchrun(4, os.path.join(HERE, "fsdp_variants.py"), str(out / "w4.json"), str(STEPS), *WORLD4)
    return {**json.loads((out / "w2.json").read_text()), **json.loads((out / "w4.json").read_text())}


@pytest.mark.parametrize("world", [2, 4])
def test_portable_attention_matches_unsharded_forward_and_backward(tmp_path, world):
    torchrun(world, os.path.join(HERE, "cp_attention_check.py"), str(tmp_path / "attn.json"))
    results = json.loads((tmp_path / "attn.json").read_text())
    assert len(results) == 16  # allgather/alltoall x balanced/contiguous x causal/documents x chunked or not
    for case, diffs in results.items():
        assert diffs["worst_all_ranks"] <= 1e-5, (case, diffs)


CP_RUNS = [n for n in WORLD2 + WORLD4 if not n.startswith("documents")]


@pytest.mark.parametrize("name", WORLD2 + WORLD4)
def test_training_losses_match_single_process(cp_results, name):
    reference = reference_losses(make_config(VARIANTS[name].reference_overrides), STEPS)
    assert max_relative_difference(cp_results[name]["losses"], reference) <= 1e-5


def test_document_masking_changes_the_losses(cp_results):
    """Packed documents are really kept apart (not silently plain causal attention)."""
    assert max_relative_difference(cp_results["documents_cp2_alltoall"]["losses"],
                                   cp_results["cp2_alltoall"]["losses"]) > 1e-3


@pytest.mark.parametrize("name", WORLD2 + WORLD4)
def test_batches_without_labels_take_the_same_cp_path(cp_results, name):
    assert cp_results[name]["unlabeled_predictions_match"]


@pytest.fixture(scope="module")
def reference_eval():
    """Per-token losses and argmax of the unsharded model at init on the eval sequences the runs used."""
    return eval_reference.reference_eval()


def _padded_rows(n_rows: int, batch: int) -> int:
    return -(-n_rows // batch) * batch


def wrong_eval_losses(ref, fsdp: int, cp: int) -> dict:
    """What the known mistakes would report on this data — each must be far from the truth."""
    losses, n_rows, batch = ref["token_losses"], ref["token_losses"].shape[0], ref["batch"]
    seq = losses.shape[1]
    truth = losses.sum() / losses.size
    padded = np.zeros((_padded_rows(n_rows, batch), seq))
    mask = np.zeros_like(padded, dtype=bool)
    padded[:n_rows], mask[:n_rows] = losses, True
    per_rank = []
    for start in range(0, len(padded), batch):
        for dp_rank in range(fsdp):
            rows = slice(start + dp_rank * batch // fsdp, start + (dp_rank + 1) * batch // fsdp)
            for cp_rank in range(cp):
                cols = shard_indices(seq, cp, cp_rank)
                tokens = mask[rows][:, cols].sum()
                per_rank.append(padded[rows][:, cols].sum() / tokens if tokens else np.nan)
    # Labels shifted inside each shard: every contiguous chunk predicts its own next token, and loses one.
    logits, inputs = ref["logits"], ref["inputs"]
    chunk = seq // (2 * cp)
    shifted = []
    for c in range(2 * cp):
        part_logits = logits[:, c * chunk:(c + 1) * chunk - 1]
        part_labels = inputs[:, c * chunk + 1:(c + 1) * chunk]
        shifted.append(F.cross_entropy(part_logits.flatten(0, 1), part_labels.flatten(), reduction="none"))
    return {"times_cp": truth * cp, "mean_of_rank_means": float(np.nanmean(per_rank)),
            "per_shard_shift": torch.cat(shifted).mean().item()}


@pytest.mark.parametrize("name", WORLD2 + WORLD4)
def test_first_gradients_match_single_process(cp_results, name):
    assert cp_results[name]["gradient_deviation"] <= 1e-5
    assert cp_results[name]["grad_norm"] == pytest.approx(cp_results[name]["reference_grad_norm"], rel=1e-5)


@pytest.mark.parametrize("name", CP_RUNS)
def test_eval_loss_under_cp_equals_unsharded(cp_results, reference_eval, name):
    truth = check_eval_loss(cp_results[name], reference_eval)
    for mistake, value in wrong_eval_losses(reference_eval, *mesh_of(name)).items():
        # The known mistakes land at least 10x the tolerance away, so the assertion above would catch them.
        assert abs(value - truth) / truth > 10 * EVAL_RTOL, f"this data would not reveal the {mistake} error"


@pytest.mark.parametrize("name", CP_RUNS)
def test_gathered_predictions_are_the_unsharded_argmax_in_order(cp_results, reference_eval, name):
    check_predictions(cp_results[name], reference_eval)
