"""specserve: LLM serving built around speculative decoding that never loses to plain decoding."""
from .config import ConfigError, EngineConfig
from .engine.engine import RequestError, RequestOutput
from .llm import LLM
from .sampling_params import SamplingParams

__all__ = ["LLM", "SamplingParams", "EngineConfig", "ConfigError", "RequestError", "RequestOutput"]
__version__ = "0.1.0"
