"""The engine's calls that read prompts and sample nothing: the log-likelihood of choices after a
prompt (labeling by scoring), and embed, classify and score (pooling). Their passes run over the
engine's pieces (engine.core.paged.PagedPass, the Pooler), never the engine itself."""
from __future__ import annotations

from typing import Sequence as Seq

from engine.api.errors import EngineBusy
from engine.api.lora import LoRARequest, per_prompt_lora
from engine.api.outputs import ChoiceScores, ClassificationOutput, EmbeddingOutput, ScoringOutput
from engine.api.pooling import PoolingParams
from engine.api.prompts import Prompt, per_prompt
from engine.pooling import score_pairs
from engine.scoring import score_choices


class ReadingCalls:
    """LLMEngine's calls that sample nothing (a mixin: they use the engine's tokenizer, adapters,
    pooler and PagedPass, which LLMEngine builds)."""

    def score_choices(self, prompts: Seq[Prompt], choices: Seq[Seq[str | list[int]]],
                      lora_request: LoRARequest | Seq[LoRARequest | None] | None = None) -> list[ChoiceScores]:
        """Log-likelihood of each choice after its row's prompt: choices[i] are the candidates for
        prompts[i]. A text choice after a text prompt is tokenized as part of prompt + choice (its
        tokens are those beyond the prompt's), so write it as it would continue the prompt, e.g.
        with its leading space. One ChoiceScores per row; rows of each adapter (lora_request: one
        for all rows or one per row) are scored together."""
        self.pooling_info.check("generate")
        if len(prompts) != len(choices):
            raise ValueError(f"got {len(prompts)} prompts but {len(choices)} choice lists")
        loras = per_prompt_lora(lora_request, len(prompts))
        prompt_ids, choice_ids, images, failed = [], [], [], {}
        for i, (p, cs) in enumerate(zip(prompts, choices)):
            spans = []
            try:  # an image prompt (engine.multimodal): its choices are tokenized on their own
                ids, spans = self._image_prompt(p) if isinstance(p, dict) else (self._tokenize(p), [])
                cids = [self.tokenizer.continuation(None if spans else p, ids, c) for c in cs]
            except (TypeError, ValueError) as exc:
                failed[i] = str(exc)
                ids, cids = [], []
            prompt_ids.append(ids)
            choice_ids.append(cids)
            images.append(spans)
        if self.has_unfinished():
            raise EngineBusy("score_choices() called while generation requests are still running")
        scores = self.adapters.per_adapter(
            loras, lambda rows: score_choices(self.paged, [prompt_ids[i] for i in rows], [choice_ids[i] for i in rows],
                                              [images[i] for i in rows]),
            lambda message: ChoiceScores([], [], 0, message))
        for i, message in failed.items():
            scores[i] = ChoiceScores([], [], 0, message)
        return scores

    def embed(self, prompts: Seq[Prompt] | Prompt, pooling_params: PoolingParams | Seq[PoolingParams] | None = None,
              lora_request: LoRARequest | Seq[LoRARequest | None] | None = None) -> list[EmbeddingOutput]:
        """One embedding per prompt (text or token ids), in input order; a bad row gets its error."""
        self._pooling_idle("embed")
        return self._pool_rows(self.pooler.embed, prompts, pooling_params, lora_request,
                               lambda message: EmbeddingOutput([], 0, message))

    def classify(self, prompts: Seq[Prompt] | Prompt, pooling_params: PoolingParams | Seq[PoolingParams] | None = None,
                 lora_request: LoRARequest | Seq[LoRARequest | None] | None = None) -> list[ClassificationOutput]:
        """Class probabilities (and the most probable id2label name) per prompt, in input order."""
        self._pooling_idle("classify")
        return self._pool_rows(self.pooler.classify, prompts, pooling_params, lora_request,
                               lambda message: ClassificationOutput([], None, 0, message))

    def score(self, text_1: Prompt | Seq[Prompt], text_2: Prompt | Seq[Prompt], pooling_params: PoolingParams | None = None,
              lora_request: LoRARequest | Seq[LoRARequest | None] | None = None) -> list[ScoringOutput]:
        """One score per pair (one text_1 for every text_2, or two lists): a cross-encoder's, or a cosine."""
        self._pooling_idle("score")
        firsts, seconds = score_pairs(text_1, text_2)
        return self.adapters.per_adapter(
            per_prompt_lora(lora_request, len(firsts)),
            lambda rows: self.pooler.score([firsts[i] for i in rows], [seconds[i] for i in rows], pooling_params),
            lambda message: ScoringOutput(None, 0, message))

    def _pooling_idle(self, task: str) -> None:
        self.pooling_info.check(task)
        if self.has_unfinished():
            raise EngineBusy(f"{task}() called while generation requests are still running")

    def _pool_rows(self, task, prompts, pooling_params, lora_request, failed) -> list:
        """embed / classify: the pooler's `task` over the prompts, once per adapter they run under."""
        prompts, params = per_prompt(prompts, pooling_params, PoolingParams)
        return self.adapters.per_adapter(per_prompt_lora(lora_request, len(prompts)),
                                         lambda rows: task([prompts[i] for i in rows], [params[i] for i in rows]),
                                         failed)
