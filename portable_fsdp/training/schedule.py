"""Learning-rate schedule: linear warm-up, then cosine or linear decay to `min_lr_ratio * lr`, or a constant rate
(a pure function)."""
import math

SHAPES = ("cosine", "linear", "constant")  # train.lr_schedule: the rate after the warm-up


def learning_rate(step: int, *, lr: float, warmup_steps: int, total_steps: int, min_lr_ratio: float,
                  shape: str = "cosine") -> float:
    """The rate for optimizer step `step` (0-based)."""
    if step < warmup_steps:
        return lr * (step + 1) / warmup_steps
    if shape == "constant":
        return lr
    decay_steps = max(1, total_steps - warmup_steps)
    progress = min(1.0, (step - warmup_steps) / decay_steps)
    remaining = 1.0 - progress if shape == "linear" else 0.5 * (1.0 + math.cos(math.pi * progress))
    return lr * (min_lr_ratio + (1.0 - min_lr_ratio) * remaining)


def for_config(train_cfg):
    def schedule(step: int) -> float:
        return learning_rate(step, lr=train_cfg.lr, warmup_steps=train_cfg.warmup_steps,
                             total_steps=train_cfg.steps, min_lr_ratio=train_cfg.min_lr_ratio,
                             shape=train_cfg.lr_schedule)
    return schedule
