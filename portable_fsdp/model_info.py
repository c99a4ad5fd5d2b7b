"""What start-up validation, the data check and MFU need to know of a model (filled by a backend)."""
import dataclasses


@dataclasses.dataclass(frozen=True)
class ModelInfo:
    class_names: tuple
    no_split_modules: tuple
    n_params: int
    n_layers: int
    hidden_size: int
    vocab_size: int
