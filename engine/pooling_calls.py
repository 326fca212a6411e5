"""embed, classify and score as an engine answers them: the model's refusal checked, the engine
idle, the rows split by the adapter they run under, the Pooler's pass over each group. The
generation engine (decoder pooling) and the encoder engine both answer through one of these."""
from __future__ import annotations

from typing import Callable, Sequence as Seq

from engine.api.errors import EngineBusy
from engine.api.lora import LoRARequest, per_prompt_lora
from engine.api.outputs import ClassificationOutput, EmbeddingOutput, ScoringOutput
from engine.api.pooling import PoolingParams
from engine.api.prompts import Prompt, per_prompt
from engine.lora.router import AdapterRouter
from engine.models.pooling import PoolingInfo
from engine.pooling.run import Pooler, score_pairs

LoRAArg = LoRARequest | Seq[LoRARequest | None] | None


class PoolingCalls:
    """An engine's pooling calls, over its pooler and adapters; `busy()` says whether generation runs."""

    def __init__(self, info: PoolingInfo, pooler: Pooler, adapters: AdapterRouter, busy: Callable[[], bool]):
        self.info = info
        self.pooler = pooler
        self.adapters = adapters
        self.busy = busy

    def embed(self, prompts: Seq[Prompt] | Prompt, pooling_params: PoolingParams | Seq[PoolingParams] | None = None,
              lora_request: LoRAArg = None) -> list[EmbeddingOutput]:
        """One embedding per prompt (text or token ids), in input order; a bad row gets its error."""
        self._idle("embed")
        return self._rows(self.pooler.embed, prompts, pooling_params, lora_request,
                          lambda message: EmbeddingOutput([], 0, message))

    def classify(self, prompts: Seq[Prompt] | Prompt, pooling_params: PoolingParams | Seq[PoolingParams] | None = None,
                 lora_request: LoRAArg = None) -> list[ClassificationOutput]:
        """Class probabilities (and the most probable id2label name) per prompt, in input order."""
        self._idle("classify")
        return self._rows(self.pooler.classify, prompts, pooling_params, lora_request,
                          lambda message: ClassificationOutput([], None, 0, message))

    def score(self, text_1: Prompt | Seq[Prompt], text_2: Prompt | Seq[Prompt], pooling_params: PoolingParams | None = None,
              lora_request: LoRAArg = None) -> list[ScoringOutput]:
        """One score per pair (one text_1 for every text_2, or two lists): a cross-encoder's, or a cosine."""
        self._idle("score")
        firsts, seconds = score_pairs(text_1, text_2)
        return self.adapters.per_adapter(
            per_prompt_lora(lora_request, len(firsts)),
            lambda rows: self.pooler.score([firsts[i] for i in rows], [seconds[i] for i in rows], pooling_params),
            lambda message: ScoringOutput(None, 0, message))

    def _idle(self, task: str) -> None:
        self.info.check(task)
        if self.busy():
            raise EngineBusy(f"{task}() called while generation requests are still running")

    def _rows(self, task, prompts, pooling_params, lora_request, failed) -> list:
        """embed / classify: the pooler's `task` over the prompts, once per adapter they run under."""
        prompts, params = per_prompt(prompts, pooling_params, PoolingParams)
        return self.adapters.per_adapter(per_prompt_lora(lora_request, len(prompts)),
                                         lambda rows: task([prompts[i] for i in rows], [params[i] for i in rows]),
                                         failed)
