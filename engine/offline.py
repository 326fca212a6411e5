"""`engine.LLM`: vLLM's offline class over an engine (`engine.build`: LLMEngine, or EncoderEngine for an
encoder), so code written for `vllm.LLM` runs with its import line changed. A thin face over the
engine's public methods: its results reshaped into vLLM's RequestOutput / CompletionOutput
(engine.api.request_output); the engine and Completion stay as they are."""
from __future__ import annotations

import itertools
from collections.abc import Sequence as Seq
from dataclasses import fields

from engine.api.config import EngineConfig
from engine.api.errors import ModelLoadError
from engine.api.lora import per_prompt_lora
from engine.api.pooling import PoolingParams
from engine.api.request_output import (ClassificationRequestOutput, EmbeddingRequestOutput, RequestOutput,
                                       ScoringRequestOutput, completion_outputs, prompt_logprobs_of)
from engine.api.sampling_params import SamplingParams
from engine.multimodal import image_parts

CONFIG_FIELDS = {f.name for f in fields(EngineConfig)}


def _one(prompts) -> bool:
    """Whether `prompts` is one prompt (a string, a vLLM prompt dict, a list of token ids)."""
    return isinstance(prompts, (str, dict)) or (isinstance(prompts, list) and bool(prompts) and isinstance(prompts[0], int))


def _as_list(prompts) -> list:
    """One prompt or a list of them -> a list."""
    return [prompts] if _one(prompts) else list(prompts)


class LLM:
    """vLLM's `LLM(model, **engine_args)`: any EngineConfig field is a keyword (vLLM's names)."""

    def __init__(self, model: str, **engine_args):
        unknown = sorted(set(engine_args) - CONFIG_FIELDS)
        if unknown:
            raise TypeError(f"LLM() got unknown engine arguments {unknown}; the engine takes the EngineConfig "
                            f"fields: {', '.join(sorted(CONFIG_FIELDS - {'model'}))}")
        from engine.builder import build

        self.llm_engine = build(EngineConfig(model=model, **engine_args))
        self._ids = itertools.count()

    def get_tokenizer(self):
        """The Hugging Face tokenizer (vLLM's name)."""
        return self.llm_engine.tokenizer.hf

    # -- generation --------------------------------------------------------------------------------

    def generate(self, prompts, sampling_params: SamplingParams | Seq[SamplingParams] | None = None,
                 use_tqdm: bool = False, lora_request=None) -> list[RequestOutput]:
        """One RequestOutput per prompt, in order. A prompt is a string, a list of token ids, or
        vLLM's {"prompt": ...} / {"prompt_token_ids": [...]}; one or a list of them."""
        texts, ids = self._prompts(prompts)
        return self._generate(texts, ids, sampling_params, lora_request)

    def chat(self, messages, sampling_params: SamplingParams | Seq[SamplingParams] | None = None,
             use_tqdm: bool = False, lora_request=None, chat_template: str | None = None,
             add_generation_prompt: bool = True, continue_final_message: bool = False,
             tools: list | None = None, chat_template_kwargs: dict | None = None) -> list[RequestOutput]:
        """One conversation (a list of {"role", "content"} messages) or a list of them, rendered by
        the tokenizer's chat template (or `chat_template`), then generated. Content parts
        {"type": "image_url", "image_url": {"url": ...}} and {"type": "image_pil", "image_pil": ...}
        put images in a vision-language model's prompt (its processor's template renders them)."""
        conversations = [messages] if messages and isinstance(messages[0], dict) else list(messages)
        refusal = self.llm_engine.refusal("generate")
        if refusal is not None:
            raise ModelLoadError(refusal)
        tok = self.get_tokenizer()
        images = self.llm_engine.images
        if images is None and chat_template is None and not getattr(tok, "chat_template", None):
            raise ValueError("the tokenizer has no chat template: pass chat_template=")
        texts, ids = [], []
        for conversation in conversations:
            converted, sources = image_parts(list(conversation))
            if images is not None or sources:  # a vision-language model's processor renders images
                prompt = self.llm_engine.chat_image_prompt(
                    converted, sources, chat_template=chat_template, add_generation_prompt=add_generation_prompt
                    and not continue_final_message, continue_final_message=continue_final_message, tools=tools,
                    **(chat_template_kwargs or {}))
                texts.append(prompt["prompt"])
                ids.append(prompt)
                continue
            text = tok.apply_chat_template(list(conversation), tokenize=False, chat_template=chat_template,
                                           add_generation_prompt=add_generation_prompt and not continue_final_message,
                                           continue_final_message=continue_final_message, tools=tools,
                                           **(chat_template_kwargs or {}))
            texts.append(text)
            ids.append(tok(text, add_special_tokens=False)["input_ids"])  # the template wrote the specials
        return self._generate(texts, ids, sampling_params, lora_request)

    def _generate(self, texts: list, ids: list, sampling_params, lora_request) -> list[RequestOutput]:
        completions = self.llm_engine.generate(ids, sampling_params, lora_request=lora_request)
        loras = per_prompt_lora(lora_request, len(ids))
        decode = self.llm_engine.tokenizer.hf.convert_ids_to_tokens
        return [RequestOutput(str(next(self._ids)), text,
                              prompt_ids if isinstance(prompt_ids, list) else c.prompt_token_ids,  # an image prompt's
                              prompt_logprobs_of(c, decode), completion_outputs(c, decode, lora), True, c.num_cached_tokens, lora)
                for text, prompt_ids, c, lora in zip(texts, ids, completions, loras)]

    def _prompts(self, prompts) -> tuple[list, list]:
        """(texts or None, token ids) of each prompt; a text that does not tokenize stays a text,
        for the engine to fail that row alone."""
        texts, ids = [], []
        tokenize = self.llm_engine.tokenize
        for p in _as_list(prompts):
            if isinstance(p, dict):
                unknown = set(p) - {"prompt", "prompt_token_ids", "multi_modal_data"}
                if unknown or ("multi_modal_data" in p and "prompt_token_ids" in p):
                    raise ValueError(f"a prompt dict takes 'prompt' (with 'multi_modal_data' for images) or "
                                     f"'prompt_token_ids', got {sorted(p)}")
                if "multi_modal_data" in p:  # the engine loads its images and fails that row alone
                    texts.append(p.get("prompt"))
                    ids.append({"prompt": p.get("prompt"), "multi_modal_data": p["multi_modal_data"]})
                    continue
                if "prompt_token_ids" in p:
                    texts.append(p.get("prompt"))
                    ids.append(list(p["prompt_token_ids"]))
                    continue
                p = p["prompt"]
            if isinstance(p, str):
                texts.append(p)
                try:
                    ids.append(tokenize(p))
                except ValueError:
                    ids.append(p)
            else:
                texts.append(None)
                ids.append(list(p))
        return texts, ids

    # -- pooling -----------------------------------------------------------------------------------

    @staticmethod
    def _pooled(prompts) -> list:
        """The prompts as the pooling calls take them: texts or token-id lists."""
        return [p.get("prompt_token_ids", p.get("prompt")) if isinstance(p, dict) else p for p in _as_list(prompts)]

    def embed(self, prompts, pooling_params: PoolingParams | None = None, use_tqdm: bool = False,
              lora_request=None) -> list[EmbeddingRequestOutput]:
        prompts = self._pooled(prompts)
        outs = self.llm_engine.embed(prompts, pooling_params, lora_request=lora_request)
        return [EmbeddingRequestOutput(str(next(self._ids)), o, o.prompt_token_ids) for o in outs]

    def classify(self, prompts, pooling_params: PoolingParams | None = None, use_tqdm: bool = False,
                 lora_request=None) -> list[ClassificationRequestOutput]:
        prompts = self._pooled(prompts)
        outs = self.llm_engine.classify(prompts, pooling_params, lora_request=lora_request)
        return [ClassificationRequestOutput(str(next(self._ids)), o, o.prompt_token_ids) for o in outs]

    def score(self, data_1, data_2, pooling_params: PoolingParams | None = None, use_tqdm: bool = False,
              lora_request=None) -> list[ScoringRequestOutput]:
        """vLLM's score: one data_1 against every data_2, or two lists pair by pair; each a text, a
        token-id list or a vLLM prompt dict."""
        firsts = self._pooled(data_1)
        outs = self.llm_engine.score(firsts[0] if _one(data_1) else firsts, self._pooled(data_2), pooling_params,
                                     lora_request=lora_request)
        return [ScoringRequestOutput(str(next(self._ids)), o) for o in outs]
