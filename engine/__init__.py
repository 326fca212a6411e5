"""batchinfer's generation engine: static or continuous batching under a KV-token budget, on torch + transformers.

Configuration, sampling parameters and outputs import without torch; `LLMEngine` (which needs
torch and transformers) is imported on first use, so that job specs can be read anywhere."""
__version__ = "0.1.0"

from engine.config import EngineConfig
from engine.outputs import BatchStats, Completion, Sample
from engine.sampling_params import SamplingParams
from engine.structured_outputs import StructuredOutputsParams


def __getattr__(name: str):
    if name == "LLMEngine":
        from engine.llm_engine import LLMEngine

        return LLMEngine
    raise AttributeError(f"module 'engine' has no attribute {name!r}")


__all__ = ["LLMEngine", "EngineConfig", "SamplingParams", "StructuredOutputsParams", "Completion", "Sample",
           "BatchStats", "__version__"]
