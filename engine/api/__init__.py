"""What a caller configures, asks for and gets back: the engine protocol and its facts, the config, sampling
and structured-output parameters, outputs and errors. Plain dataclasses, no torch: specs import them anywhere."""
from engine.api.config import CPU_POOL_TOKENS, DEFAULT_MODEL, SCHEDULING_MODES, EngineConfig, auto_dtype
from engine.api.errors import (AdapterError, AttentionOutsideEngine, BatchFull, FastPathError, ConstraintError, DeviceError, RegexTimeout, EngineBusy,
                               EngineError, GrammarBusy, ModelLoadError, PoolExhausted, PoolSizingError, RankError,
                               one_line)
from engine.api.lora import LoRARequest, per_prompt_lora
from engine.api.outputs import (BatchStats, ChoiceScores, ClassificationOutput, Completion, EmbeddingOutput, Sample,
                                ScoringOutput)
from engine.api.protocol import TASKS, Engine, EngineFacts, SteppingEngine
from engine.api.pooling import POOLING_TASKS, POOLING_TYPES, PoolerConfig, PoolingParams
from engine.api.request_output import (ClassificationRequestOutput, CompletionOutput, EmbeddingRequestOutput, Logprob,
                                       RequestOutput, ScoringRequestOutput)
from engine.api.sampling_params import MAX_ENTRIES, MAX_N, SamplingParams, check_sizes
from engine.api.structured_outputs import KINDS, VIOLATION, StructuredOutputsParams

__all__ = ["Engine", "SteppingEngine", "EngineFacts", "TASKS", "EngineConfig", "CPU_POOL_TOKENS", "DEFAULT_MODEL", "SCHEDULING_MODES", "auto_dtype",
           "SamplingParams", "MAX_N", "MAX_ENTRIES", "check_sizes", "StructuredOutputsParams", "KINDS", "VIOLATION",
           "Completion", "Sample", "BatchStats", "ChoiceScores",
           "EmbeddingOutput", "ClassificationOutput", "ScoringOutput", "PoolingParams", "PoolerConfig", "POOLING_TYPES",
           "POOLING_TASKS", "LoRARequest", "per_prompt_lora", "RequestOutput", "CompletionOutput", "Logprob",
           "EmbeddingRequestOutput", "ClassificationRequestOutput", "ScoringRequestOutput",
           "EngineError", "AdapterError", "ModelLoadError", "DeviceError", "PoolSizingError", "PoolExhausted", "BatchFull",
           "RankError", "EngineBusy", "AttentionOutsideEngine", "FastPathError", "ConstraintError", "RegexTimeout", "GrammarBusy", "one_line"]
