"""batchinfer's generation engine: static or continuous batching under a KV-token budget, on torch + transformers.

Its packages, each answering one question (which may import which: docs/architecture.md):

    api/           what a caller configures, asks for and gets back (config, params, outputs, errors): no torch
    core/          which rows the next pass computes and which KV blocks hold them: no torch
    models/        models and tokenizers from the outside world (builtin, Hub, object storage, file checks)
    quantization/  quantized weights: the method a model runs with, and its linear layers
    distributed/   tensor-parallel ranks and each rank's shard of the weights
    lora/          LoRA adapters: PEFT files checked, and the layers adding each row's low-rank products
    runner/        running the model: loading it, one forward pass over the paged KV pool, its kernels
    sample/        logits to tokens, logprobs, and the rules that finish a row
    structured/    structured outputs: xgrammar or llguidance per constraint, and the check of each output
    pooling/       rows to embeddings, class probabilities and scores (encoders packed; decoders paged)

On top: the engines behind the protocol `engine.api.Engine`, each built by `build(config)` (builder.py):
`LLMEngine` (llm_engine.py: step() = schedule, run, postprocess; choice scoring, decoder pooling),
`EncoderEngine` (encoder_engine.py: an encoder's embed, classify, score) and `builtin:echo`'s stand-in
(echo.py); what they share (prompt_reader.py, pooling_calls.py, choice_scoring.py); vLLM's offline `LLM` over
an engine (offline.py). Configuration, the protocol, sampling parameters, outputs and errors import
without torch; `build`, `LLMEngine`, `EncoderEngine`, `LLM` and `EchoEngine` (which need torch or the
tokenizers) are imported on first use, so that job specs can be read anywhere."""
__version__ = "0.1.0"

from engine.api import (Engine, EngineFacts, SteppingEngine, AdapterError, AttentionOutsideEngine, BatchFull, FastPathError, BatchStats, ChoiceScores, ClassificationOutput,
                        ClassificationRequestOutput, CompletionOutput, EmbeddingRequestOutput, Logprob, RequestOutput,
                        ScoringRequestOutput, Completion, ConstraintError, DeviceError, RegexTimeout, EmbeddingOutput, EngineBusy, EngineConfig,
                        EngineError, GrammarBusy, LoRARequest, ModelLoadError, PoolerConfig, PoolExhausted, PoolingParams,
                        PoolSizingError, RankError, Sample, SamplingParams, ScoringOutput, StructuredOutputsParams,
                        VIOLATION, one_line)

def __getattr__(name: str):
    """build, LLMEngine, EncoderEngine, LLM and EchoEngine (with ECHO_MODEL) are imported on first use."""
    if name == "build":
        from engine.builder import build

        return build
    if name == "EncoderEngine":
        from engine.encoder_engine import EncoderEngine

        return EncoderEngine
    if name == "LLMEngine":
        from engine.llm_engine import LLMEngine

        return LLMEngine
    if name == "LLM":
        from engine.offline import LLM

        return LLM
    if name in ("EchoEngine", "ECHO_MODEL"):
        from engine import echo

        return getattr(echo, name)
    raise AttributeError(f"module 'engine' has no attribute {name!r}")


__all__ = ["build", "Engine", "SteppingEngine", "EngineFacts", "EncoderEngine", "LLM", "RequestOutput", "CompletionOutput", "Logprob", "EmbeddingRequestOutput",
           "ClassificationRequestOutput", "ScoringRequestOutput", "LLMEngine", "EngineConfig", "SamplingParams", "StructuredOutputsParams", "VIOLATION", "Completion", "Sample",
           "BatchStats", "ChoiceScores", "PoolingParams", "PoolerConfig", "EmbeddingOutput",
           "ClassificationOutput", "ScoringOutput", "LoRARequest", "EchoEngine", "ECHO_MODEL", "__version__",
           "EngineError", "AdapterError", "ModelLoadError", "DeviceError", "PoolSizingError", "PoolExhausted", "BatchFull",
           "RankError", "EngineBusy", "AttentionOutsideEngine", "FastPathError", "ConstraintError", "RegexTimeout", "GrammarBusy", "one_line"]
