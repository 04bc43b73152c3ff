"""Model families specserve runs: registry.MODELS maps a checkpoint's architecture to its class, which
implements interface.CausalLM."""
from .config import ARCHITECTURES, ArchConfig, GenerationDefaults, UnsupportedModel, read_config
from .interface import CausalLM
from .loader import WeightError, fill_weights, load_model
from .registry import MODELS, model_class

__all__ = ["ARCHITECTURES", "MODELS", "ArchConfig", "CausalLM", "GenerationDefaults", "UnsupportedModel",
           "WeightError", "fill_weights", "load_model", "model_class", "read_config"]
