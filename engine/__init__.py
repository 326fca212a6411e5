"""batchinfer's generation engine: static or continuous batching under a KV-token budget, on torch + transformers."""
__version__ = "0.1.0"

from engine.config import EngineConfig
from engine.llm_engine import LLMEngine
from engine.outputs import BatchStats, Completion
from engine.sampling_params import SamplingParams

__all__ = ["LLMEngine", "EngineConfig", "SamplingParams", "Completion", "BatchStats", "__version__"]
