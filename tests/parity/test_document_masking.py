"""data.document_masking: packed documents see only themselves, through the same model call the torch
backend makes (position ids restarting per document, no cache)."""
import numpy as np
import torch

from portable_fsdp.backends.hf_torch.model import create_model
from portable_fsdp.backends.hf_torch.loss import token_loss_sum
from portable_fsdp.config.schema import load_recipe
from portable_fsdp.data.batch import IGNORE_INDEX, as_batch

EOS = 256


def loss_of_second_document(model, first_document_token: int) -> float:
    row = np.random.default_rng(0).integers(0, 256, size=(1, 65))
    row[0, 20] = EOS  # document 0 = tokens 0..20, document 1 = tokens 21..64
    row[0, :20] = first_document_token
    batch = as_batch(row, EOS)
    labels = batch.labels.copy()
    labels[:, :21] = IGNORE_INDEX  # score document 1 only
    with torch.no_grad():
        return token_loss_sum(model, torch.from_numpy(batch.input_ids), torch.from_numpy(labels),
                              torch.from_numpy(batch.position_ids)).item()


def test_a_document_does_not_see_the_one_before_it():
    model = create_model(load_recipe("llama_tiny:test"), rank=0, rank0_only=False).eval()
    assert loss_of_second_document(model, 7) == loss_of_second_document(model, 99)


def test_positions_segments_and_labels():
    row = np.arange(12)[None] % 5 + 250  # ... 253, 254, 250 ...: no eos
    row[0, [3, 7]] = EOS
    batch = as_batch(row, EOS)
    assert batch.segment_ids.tolist() == [[0, 0, 0, 0, 1, 1, 1, 1, 2, 2, 2]]
    assert batch.position_ids.tolist() == [[0, 1, 2, 3, 0, 1, 2, 3, 0, 1, 2]]
    assert (batch.labels[0, [3, 7]] == IGNORE_INDEX).all()  # an eos does not predict the next document
    assert batch.num_label_tokens == 9
