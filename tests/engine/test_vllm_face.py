"""engine.LLM, vLLM's offline class: vLLM's documented offline examples (basic generate, chat, n
samples with a seed, structured outputs, logprobs), written as vLLM's docs write them with only
the import line changed (and a local model: the Hub is out of reach), and RequestOutput /
CompletionOutput against the engine's own Completion."""
from __future__ import annotations

import json
import math

import pytest

from real_vocab import build_real_vocab_model

CHAT_TEMPLATE = ("{% for m in messages %}<s>[{{ m['role'] }}] {{ m['content'] }}\n{% endfor %}"
                 "{% if add_generation_prompt %}[assistant] {% endif %}")


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    from transformers import AutoTokenizer

    path = build_real_vocab_model(tmp_path_factory.mktemp("vllm_face"))
    tok = AutoTokenizer.from_pretrained(path)
    tok.chat_template = CHAT_TEMPLATE
    tok.save_pretrained(path)
    return str(path)


@pytest.fixture(scope="module")
def llm(model):
    from engine import LLM

    return LLM(model=model, max_num_seqs=16)


def test_basic_example(model, capsys):
    from engine import LLM, SamplingParams

    prompts = ["Hello, my name is", "The president of the United States is", "The capital of France is",
               "The future of AI is"]
    sampling_params = SamplingParams(temperature=0.8, top_p=0.95)
    llm = LLM(model=model)
    outputs = llm.generate(prompts, sampling_params)
    for output in outputs:
        prompt = output.prompt
        generated_text = output.outputs[0].text
        print(f"Prompt: {prompt!r}, Generated text: {generated_text!r}")
    printed = capsys.readouterr().out.splitlines()
    assert len(printed) == 4 and printed[2].startswith("Prompt: 'The capital of France is', Generated text: ")
    assert [o.request_id for o in outputs] == ["0", "1", "2", "3"] and all(o.finished for o in outputs)
    assert all(len(o.outputs[0].token_ids) == 16 or o.outputs[0].finish_reason == "stop" for o in outputs)


def test_chat_example(llm):
    from engine import SamplingParams

    sampling_params = SamplingParams(temperature=0.5)
    conversation = [
        {"role": "system", "content": "You are a helpful assistant"},
        {"role": "user", "content": "Hello"},
        {"role": "assistant", "content": "Hello! How can I assist you today?"},
        {"role": "user", "content": "Write an essay about the importance of higher education."},
    ]
    outputs = llm.chat(conversation, sampling_params, use_tqdm=False)
    assert len(outputs) == 1
    assert outputs[0].prompt.startswith("<s>[system] You are a helpful assistant\n") and \
        outputs[0].prompt.endswith("[assistant] ")
    # the template wrote <s> itself: the prompt's ids hold it once, not twice
    assert outputs[0].prompt_token_ids.count(llm.get_tokenizer().bos_token_id) == 4
    batch = llm.chat([conversation, conversation[:2]], SamplingParams(temperature=0, max_tokens=8))
    alone = llm.chat(conversation[:2], SamplingParams(temperature=0, max_tokens=8))
    assert len(batch) == 2 and batch[1].outputs[0].token_ids == alone[0].outputs[0].token_ids


def test_n_samples_with_a_seed(llm):
    from engine import SamplingParams

    params = SamplingParams(n=3, seed=42, temperature=1.0, max_tokens=12)
    first = llm.generate("Once upon a time", params)
    again = llm.generate(["Once upon a time", "Another prompt"], params)
    assert [c.index for c in first[0].outputs] == [0, 1, 2]
    assert [c.token_ids for c in first[0].outputs] == [c.token_ids for c in again[0].outputs]
    assert len({tuple(c.token_ids) for c in first[0].outputs}) > 1


def test_structured_outputs_example(llm):
    from engine import SamplingParams, StructuredOutputsParams

    structured_outputs_params_choice = StructuredOutputsParams(choice=["Positive", "Negative"])
    sampling_params_choice = SamplingParams(structured_outputs=structured_outputs_params_choice)
    prompt_choice = "Classify this sentiment: vLLM is wonderful!"
    outputs = llm.generate(prompts=prompt_choice, sampling_params=sampling_params_choice)
    assert outputs[0].outputs[0].text in ("Positive", "Negative")
    schema = {"type": "object", "properties": {"brand": {"type": "string", "maxLength": 8},
                                               "model": {"type": "string", "maxLength": 8}},
              "required": ["brand", "model"]}
    sampling_params_json = SamplingParams(structured_outputs=StructuredOutputsParams(json=schema), max_tokens=64)
    out = llm.generate("Generate a JSON with the brand and model of a car", sampling_params_json)[0].outputs[0]
    assert out.finish_reason == "stop" and set(json.loads(out.text)) == {"brand", "model"} and out.error is None


def test_logprobs_example(llm):
    from engine import SamplingParams

    outputs = llm.generate(["The capital of France is"], SamplingParams(max_tokens=6, temperature=0, logprobs=5))
    completion = outputs[0].outputs[0]
    assert len(completion.logprobs) == len(completion.token_ids)
    total = 0.0
    for token, position in zip(completion.token_ids, completion.logprobs):
        assert token in position and len(position) in (5, 6)  # the top 5, and the chosen one if not among them
        best = max(position.values(), key=lambda p: p.logprob)
        assert best.rank == 1 and position[token].rank == 1  # greedy: the chosen one is the most probable
        assert position[token].decoded_token == llm.get_tokenizer().convert_ids_to_tokens(token)
        total += position[token].logprob
    assert math.isclose(completion.cumulative_logprob, total)
    assert llm.generate("x", SamplingParams(max_tokens=2))[0].outputs[0].cumulative_logprob is None


def test_a_tokens_rank_is_its_rank_in_the_whole_vocabulary(llm, model):
    """vLLM's Logprob.rank: a sampled token outside the returned top-N, and each prompt token,
    ranked among all 32k tokens (it was ranked among the few returned entries), against the
    logits transformers computes for the same tokens."""
    import torch
    from transformers import AutoModelForCausalLM

    from engine import SamplingParams

    params = SamplingParams(max_tokens=12, temperature=3.0, seed=5, logprobs=1, prompt_logprobs=0, ignore_eos=True)
    out = llm.generate("The capital of France is", params)[0]
    sample = out.outputs[0]
    ids = out.prompt_token_ids + sample.token_ids
    ref = AutoModelForCausalLM.from_pretrained(model, dtype=torch.float32).eval()
    with torch.no_grad():
        rows = ref(torch.tensor([ids])).logits[0].float()

    def rank(row: int, token: int) -> int:
        return int((rows[row] > rows[row, token]).sum()) + 1

    start = len(out.prompt_token_ids)
    got = [position[t].rank for t, position in zip(sample.token_ids, sample.logprobs)]
    want = [rank(start - 1 + i, t) for i, t in enumerate(sample.token_ids)]
    assert max(got) > 2, got  # hot sampling picks tokens outside the top one
    assert all(abs(a - b) <= max(1, b // 100) for a, b in zip(got, want)), (got, want)  # (near-ties)
    prompt = [position[t].rank for t, position in zip(out.prompt_token_ids[1:], out.prompt_logprobs[1:])]
    want = [rank(k, t) for k, t in enumerate(out.prompt_token_ids[1:])]
    assert all(abs(a - b) <= max(1, b // 100) for a, b in zip(prompt, want)), (prompt, want)


def test_prompts_as_token_ids_and_vllm_dicts_give_the_same_outputs(llm):
    from engine import SamplingParams

    params = SamplingParams(max_tokens=8, temperature=0)
    ids = llm.get_tokenizer()("A short prompt")["input_ids"]
    outs = llm.generate(["A short prompt", {"prompt": "A short prompt"}, {"prompt_token_ids": ids}, ids], params)
    assert len({tuple(o.outputs[0].token_ids) for o in outs}) == 1
    assert [o.prompt for o in outs] == ["A short prompt", "A short prompt", None, None]
    assert all(o.prompt_token_ids == ids for o in outs)
    engine_out = llm.llm_engine.generate(["A short prompt"], params)[0]
    assert outs[0].outputs[0].text == engine_out.text and outs[0].outputs[0].finish_reason == engine_out.finish_reason
    bad = llm.generate(["", "fine"], params)
    assert bad[0].outputs[0].finish_reason == "error" and "empty prompt" in bad[0].outputs[0].error
    assert bad[1].outputs[0].finish_reason in ("stop", "length")
    with pytest.raises(ValueError, match=r"a prompt dict takes 'prompt' \(with 'multi_modal_data' for images\) or "
                                         r"'prompt_token_ids', got \['text'\]"):
        llm.generate({"text": "x"})
    with pytest.raises(ValueError, match="a prompt dict takes"):
        llm.generate({"prompt_token_ids": [1, 2], "multi_modal_data": {"image": b"x"}})
    # an image prompt to a text-only model fails that row alone (engine.multimodal)
    image = llm.generate([{"prompt": "look", "multi_modal_data": {"image": b"not read"}}, "fine"], params)
    assert "is a text-only model: it takes no images" in image[0].outputs[0].error
    assert image[1].outputs[0].error is None


def test_unknown_engine_arguments_are_refused_naming_them(model):
    from engine import LLM

    with pytest.raises(TypeError, match=r"unknown engine arguments \['swap_space'\]"):
        LLM(model=model, swap_space=4)
