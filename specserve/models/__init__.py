"""Model families specserve runs."""
from .config import ARCHITECTURES, ArchConfig, UnsupportedModel, read_config
from .loader import WeightError, load_model

__all__ = ["ARCHITECTURES", "ArchConfig", "UnsupportedModel", "WeightError", "load_model", "read_config"]
