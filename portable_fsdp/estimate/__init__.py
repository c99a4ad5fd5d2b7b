"""Will a run fit, before it starts? (`python -m portable_fsdp.estimate`, train.check_fit.) Per rank: parameters,
gradients and optimizer state, the activations and the gathered weights at the step's peak, against the device's
memory; the FLOPs of a step and its time at a stated MFU. The backend's own start-up runs on fake tensors or
abstract arrays in a separate process (`Backend.estimate_memory`); see docs/estimate.md.

Modules: target (what the run trains on), process (the estimating processes and their Report), search (settings
that fit), report (the table and the verdict), fit (estimate_config, check_fit), __main__ (the command)."""
from portable_fsdp.estimate.fit import check_fit, estimate_config
from portable_fsdp.estimate.process import EstimateFailed, Estimator, Report
from portable_fsdp.estimate.report import rank_groups, rank_words, render, verdict
from portable_fsdp.estimate.search import Alternative, alternative_groups, search
from portable_fsdp.estimate.target import Target, resolve_target

__all__ = ["check_fit", "estimate_config", "EstimateFailed", "Estimator", "Report", "rank_groups", "rank_words",
           "render", "verdict", "Alternative", "alternative_groups", "search", "Target", "resolve_target"]
