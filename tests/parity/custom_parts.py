"""The user's parts the custom-parts tests bring (a non-transformers model, losses, an optimizer factory, a
schedule), as scenarios every backend's runner trains, and the single-process plain-torch reference of each."""
from __future__ import annotations

import dataclasses

import torch
import torch.nn.functional as F

from examples.custom_model.torch_mlp import MLPLanguageModel, token_mean_loss
from portable_fsdp.backends.hf_torch.model import create_model
from portable_fsdp.data.batch import IGNORE_INDEX
from portable_fsdp.data.loader import TrainBatches, build_token_data
from portable_fsdp.training.parts import LossInputs
from portable_fsdp.training.schedule import for_config
from tests.parity.matrix import make_config
from tests.parity.reference import take_step


def mlp(config, on_meta: bool) -> MLPLanguageModel:
    """The MLP model on the meta device, or built with the weights its meta init gives under train.seed."""
    if on_meta:
        with torch.device("meta"):
            return MLPLanguageModel(vocab_size=config.model.vocab_size)
    model = MLPLanguageModel(vocab_size=config.model.vocab_size)
    torch.manual_seed(config.seed)
    model.init_weights()
    return model


def sgd(params):
    return torch.optim.SGD(params, lr=1.0, momentum=0.9)  # lr: the schedule's, set every step


def halving(step: int) -> float:
    return 0.5 / 2 ** (step // 3)


def weighted_loss(outputs, batch: LossInputs) -> tuple:
    """Tokens with an even label weigh twice: a count that is not the label tokens."""
    logits = outputs if isinstance(outputs, torch.Tensor) else outputs.logits
    labels = batch.labels.flatten()
    losses = F.cross_entropy(logits.float().flatten(0, 1), labels, ignore_index=IGNORE_INDEX, reduction="none")
    weights = torch.where(labels % 2 == 0, 2.0, 1.0) * (labels != IGNORE_INDEX)
    return (losses * weights).sum(), weights.sum()


@dataclasses.dataclass(frozen=True)
class Scenario:
    overrides: dict
    model: str = ""  # "mlp_meta", "mlp_built"; "": the config's transformers model
    loss: object = None
    optimizer: object = None
    schedule: object = None

    def config(self, **extra):
        """The test recipe with the scenario's overrides and `extra` ones ({"plan.state_dict_type": ...})."""
        return make_config({**self.overrides, **extra})

    def parts(self, config) -> dict:
        """pf.init's keyword arguments."""
        model = mlp(config, self.model == "mlp_meta") if self.model else None
        return {"model": model, "loss": self.loss, "optimizer": self.optimizer, "schedule": self.schedule}


ACCUM2 = {"train.batch_size": "8", "train.grad_accum_steps": "2"}
SCENARIOS = {
    "mlp_meta": Scenario({}, model="mlp_meta"),
    "mlp_built": Scenario({}, model="mlp_built"),
    "mlp_parts": Scenario({}, model="mlp_meta", loss=token_mean_loss, optimizer=sgd, schedule=halving),
    "mlp_tp2": Scenario({"plan.tp_size": "2"}, model="mlp_meta", loss=token_mean_loss),  # the module's _tp_plan
    "builtin": Scenario({}),
    "token_mean": Scenario({}, loss=token_mean_loss),
    "builtin_accum2": Scenario(ACCUM2),
    "token_mean_accum2": Scenario(ACCUM2, loss=token_mean_loss),
    "builtin_cp2": Scenario({"plan.cp_size": "2"}),
    "token_mean_cp2": Scenario({"plan.cp_size": "2"}, loss=token_mean_loss),
    "weighted_cp2": Scenario({"plan.cp_size": "2"}, loss=weighted_loss),
}


def reference_losses(name: str, steps: int) -> dict:
    """{"losses", "lrs"} of one process training scenario `name` with plain torch on the whole global batch."""
    scenario = SCENARIOS[name]
    config = scenario.config()
    t = config.train
    if scenario.model:
        model = mlp(config, on_meta=False)
        forward = lambda ids, positions: model(ids)  # noqa: E731 (the MLP reads no positions)
    else:
        model = create_model(config, rank=0, rank0_only=False)
        forward = lambda ids, positions: model(input_ids=ids, position_ids=positions, use_cache=False).logits  # noqa: E731
    params = [p for p in model.parameters() if p.requires_grad]
    if scenario.optimizer is not None:
        optimizer = scenario.optimizer(params)
    else:
        optimizer = torch.optim.AdamW([{"params": [p for p in params if p.ndim >= 2], "weight_decay": t.weight_decay},
                                       {"params": [p for p in params if p.ndim < 2], "weight_decay": 0.0}],
                                      lr=t.lr, betas=(t.beta1, t.beta2), eps=t.eps)
    schedule = scenario.schedule or for_config(t)
    loss_fn = scenario.loss or token_mean_loss
    data = build_token_data(config.data, config.model.vocab_size, t.batch_size)
    batches = TrainBatches(data.train, t.batch_size, 1, config.seed, None)
    losses, lrs = [], []
    for step in range(steps):
        (batch,) = batches.micro_batches(step, 0, 1)
        ids, labels = torch.from_numpy(batch.input_ids), torch.from_numpy(batch.labels)
        positions = None if batch.position_ids is None else torch.from_numpy(batch.position_ids)
        total, count = loss_fn(forward(ids, positions), LossInputs(ids, labels, positions))
        (total / count).backward()
        take_step(model, optimizer, t.max_grad_norm, schedule(step))
        losses.append((total / count).item())
        lrs.append(schedule(step))
    return {"losses": losses, "lrs": lrs}
