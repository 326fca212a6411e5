"""EncoderEngine: an encoder (BERT, RoBERTa, ModernBERT...) behind the engine protocol. Packed
passes of its own runner, no KV pool and no sampling: it embeds, classifies and scores, and refuses
to generate in one line. `engine.build` (and `LLMEngine(config)`) give one for an encoder model."""
from __future__ import annotations

from typing import Sequence as Seq

from engine.api.config import CPU_POOL_TOKENS, EngineConfig
from engine.api.lora import LoRARequest
from engine.api.outputs import (BatchStats, ChoiceScores, ClassificationOutput, Completion, EmbeddingOutput,
                                ScoringOutput)
from engine.api.prompts import Prompt
from engine.api.protocol import EngineFacts
from engine.api.sampling_params import SamplingParams
from engine.core.scheduler import batched_tokens
from engine.lora.router import AdapterRouter
from engine.models.files import resolve_model_dir
from engine.models.pooling import PoolingInfo
from engine.models.tokenizer import Tokenizer
from engine.pooling import EncoderRunner, Pooler
from engine.pooling_calls import PoolingCalls
from engine.prompt_reader import PromptReader
from engine.runner.memory import memory_report

NO_LORA = "LoRA is not enabled (set enable_lora)"
ENCODER_LORA = "encoder models take no LoRA adapters (LoRA runs on decoder models)"


class EncoderEngine:
    """embed / classify / score on an encoder model."""

    def __init__(self, config: EngineConfig, pooling_info: PoolingInfo):
        pooling_info.check_engine(config.quantization, config.tensor_parallel_size)
        self.config = config
        self.pooling_info = pooling_info
        """What the model says about embed, classify and score (engine.models.pooling)."""
        self.batch_stats: list[BatchStats] = []  # one per pooling call
        self.runner = EncoderRunner(config, resolve_model_dir(config), pooling_info)
        self.max_model_len = config.max_model_len or pooling_info.max_len or CPU_POOL_TOKENS
        self.max_num_batched_tokens = batched_tokens(config.max_num_batched_tokens,
                                                     on_cpu=self.runner.device.type != "cuda")
        self.tokenizer = Tokenizer(self.runner.hf_tokenizer)
        self.tokenizer.max_tokens = self.max_model_len  # a chat prompt's length checked as it is rendered
        self.images = None  # encoders take no images: chat messages render as text
        self.prompts = PromptReader(config.model, self.tokenizer, self.runner.vocab_size)
        self.adapters = AdapterRouter(self.runner, config.max_loras, NO_LORA if not config.enable_lora else ENCODER_LORA)
        self.pooler = Pooler(pooling_info, self.batch_stats, self.max_model_len, self.max_num_batched_tokens,
                             encoder=self.runner)
        self.pooling = PoolingCalls(pooling_info, self.pooler, self.adapters, busy=lambda: False)
        """embed, classify and score (engine.pooling_calls)."""

    def refusal(self, task: str) -> str | None:
        """Why this engine cannot run `task` (engine.api.protocol.TASKS); None if it can."""
        if task in ("generate", "score_choices", "step"):
            return self.pooling_info.refusal("generate") or f"{task}: {self.pooling_info.name} is an encoder"
        return self.pooling_info.refusal(task)

    def generate(self, prompts: Seq[Prompt] | Prompt, params: SamplingParams | Seq[SamplingParams] | None = None,
                 lora_request: LoRARequest | Seq[LoRARequest | None] | None = None) -> list[Completion]:
        self.pooling_info.check("generate")  # an encoder has no language-model head: raises
        raise AssertionError("unreachable: an encoder never generates")

    def score_choices(self, prompts: Seq[Prompt], choices, lora_request=None) -> list[ChoiceScores]:
        self.pooling_info.check("generate")
        raise AssertionError("unreachable: an encoder never scores choices")

    def embed(self, prompts, pooling_params=None, lora_request=None) -> list[EmbeddingOutput]:
        """One embedding per prompt (PoolingCalls.embed)."""
        return self.pooling.embed(prompts, pooling_params, lora_request)

    def classify(self, prompts, pooling_params=None, lora_request=None) -> list[ClassificationOutput]:
        """Class probabilities per prompt (PoolingCalls.classify)."""
        return self.pooling.classify(prompts, pooling_params, lora_request)

    def score(self, text_1, text_2, pooling_params=None, lora_request=None) -> list[ScoringOutput]:
        """One score per pair (PoolingCalls.score)."""
        return self.pooling.score(text_1, text_2, pooling_params, lora_request)

    def has_unfinished(self) -> bool:
        return False

    def tokenize(self, prompt: Prompt) -> list[int]:
        """Text or token ids -> the token ids the model reads."""
        return self.prompts.tokenize(prompt)

    def encode_chat(self, messages: list[dict]) -> list[int]:
        """A conversation rendered by the chat template, as token ids (no images: a ValueError)."""
        return self.prompts.encode_chat(messages)

    @property
    def memory(self) -> dict:
        """The weights' bytes (an encoder has no KV pool): LLMEngine.memory's keys."""
        return memory_report(self.runner, self.config, None, None)

    def facts(self) -> EngineFacts:
        return EngineFacts(model=self.config.model, kind="encoder", max_model_len=self.max_model_len, pool_tokens=0,
                           memory=self.memory, device=str(self.runner.device),
                           dtype=str(self.runner.dtype).removeprefix("torch."),
                           max_num_batched_tokens=self.max_num_batched_tokens,
                           embedding_width=self.pooling_info.width, lora_slots=0)

    def model_identity(self) -> dict:
        """What identifies the weights this engine runs ({"kind", "id"}: engine.models.identity)."""
        from engine.models import model_identity

        return model_identity(self.config)

    def close(self) -> None:
        """Nothing to stop: an encoder runs in this process."""

    def __enter__(self) -> "EncoderEngine":
        return self

    def __exit__(self, *exc) -> None:
        self.close()
