"""The optimizers `train.optimizer` names, and the hyperparameters each reads (imports no framework).

Every backend builds the same update from these fields: the torch lowerings from torch.optim (Lion, which torch
lacks, from backends/hf_torch/lion.py), flax from optax with torch's definitions where the two differ.
Weight decay, where an optimizer has it, applies to parameters that are at least 2-D only (not norms, biases).
"""

# name -> the train.* fields it reads besides lr
OPTIMIZERS = {
    "adamw": ("beta1", "beta2", "eps", "weight_decay"),
    # torch.optim.Adafactor's defaults (beta2_decay -0.8, eps (dtype eps, 1e-3), d 1.0); no momentum
    "adafactor": ("weight_decay",),
    "lion": ("beta1", "beta2", "weight_decay"),  # the paper suggests beta2 0.99 and a 3-10x smaller lr than AdamW's
    "sgd": ("momentum", "weight_decay"),  # weight decay as torch.optim.SGD adds it: L2 on the gradient
}
