"""logit_bias, allowed_token_ids, bad_words, skip_special_tokens / spaces_between_special_tokens
and max_logprobs (vLLM's names) against transformers' own logits processors (SequenceBias,
PrefixConstrained, NoBadWords) on a random Llama with a real 32k vocabulary, greedy, in both
modes; seeded rows, n samples and structured outputs against what each option guarantees."""
from __future__ import annotations

import json

import pytest
import torch

from engine import EngineConfig, LLMEngine, SamplingParams
from engine.api.config import SCHEDULING_MODES
from engine.sample.token_options import bad_word_sequences
from parity import ForgivenRows, assert_same_tokens, reference
from real_vocab import build_real_vocab_model

PROMPTS = ["The parcel arrived late but", "Write a list of fruits:", "Once upon a time in a small town"]
NEW = 12


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return build_real_vocab_model(tmp_path_factory.mktemp("token_options"))


@pytest.fixture(scope="module")
def hf(model_dir):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()


@pytest.fixture(scope="module")
def engines(model_dir):
    return {mode: LLMEngine(EngineConfig(model=str(model_dir), scheduling=mode, max_num_seqs=8))
            for mode in SCHEDULING_MODES}


@pytest.fixture(scope="module")
def tally():
    t = ForgivenRows()
    yield t
    t.check()


def compare(llm, hf, params: SamplingParams, tally, label: str, **hf_kwargs) -> list[list[int]]:
    outs = llm.generate(PROMPTS, params)
    for prompt, out in zip(PROMPTS, outs):
        ids = llm.tokenizer.encode(prompt)
        ref, scores = reference(hf, ids, NEW, stop_at_eos=False, **hf_kwargs)
        assert_same_tokens(out.token_ids, ref, scores, f"{label} {prompt!r}", tally)
    return [o.token_ids for o in outs]


@pytest.mark.parametrize("mode", SCHEDULING_MODES)
def test_logit_bias_matches_transformers_sequence_bias(engines, hf, tally, mode):
    llm = engines[mode]
    plain = llm.generate(PROMPTS, SamplingParams(max_tokens=NEW, temperature=0, ignore_eos=True))
    bias = {plain[0].token_ids[0]: -100.0, plain[1].token_ids[2]: -7.5, 1000: 5.0}
    got = compare(llm, hf, SamplingParams(max_tokens=NEW, temperature=0, ignore_eos=True, logit_bias=bias), tally,
                  f"{mode} logit_bias", sequence_bias={(t,): b for t, b in bias.items()})
    assert got[0][0] != plain[0].token_ids[0]  # the bias changed what greedy picks


@pytest.mark.parametrize("mode", SCHEDULING_MODES)
def test_allowed_token_ids_match_transformers_prefix_constraint(engines, hf, tally, mode):
    allowed = list(range(300, 700)) + [29871]
    got = compare(engines[mode], hf, SamplingParams(max_tokens=NEW, temperature=0, ignore_eos=True,
                                                    allowed_token_ids=allowed), tally,
                  f"{mode} allowed_token_ids", prefix_allowed_tokens_fn=lambda batch, ids: allowed)
    assert all(t in allowed for row in got for t in row)


@pytest.mark.parametrize("mode", SCHEDULING_MODES)
def test_bad_words_match_transformers_no_bad_words(engines, hf, tally, mode):
    llm = engines[mode]
    plain = llm.generate(PROMPTS, SamplingParams(max_tokens=NEW, temperature=0, ignore_eos=True))
    # words the unconstrained output writes (at word starts, "▁"): one of a single piece, one of two
    single, several = word_at(llm, plain[0].token_ids, 1), word_at(llm, plain[2].token_ids, 2)
    words = [single, several]
    banned = bad_word_sequences(llm.tokenizer, words)
    assert any(len(b) == 1 for b in banned) and any(len(b) > 1 for b in banned), (words, banned)
    got = compare(llm, hf, SamplingParams(max_tokens=NEW, temperature=0, ignore_eos=True, bad_words=words), tally,
                  f"{mode} bad_words", bad_words_ids=[list(b) for b in banned])
    assert got != [o.token_ids for o in plain]
    for row in got:
        assert not any(tuple(row[i:i + len(b)]) == b for b in banned for i in range(len(row)))


def word_at(llm, token_ids: list[int], pieces: int) -> str:
    """The text of the first `pieces` consecutive tokens of `token_ids` that each start a word."""
    tok = llm.tokenizer.hf
    starts = [t for t in token_ids if tok.convert_ids_to_tokens(t).startswith("\u2581") and
              len(tok.convert_ids_to_tokens(t)) > 2]
    for i in range(len(token_ids) - pieces + 1):
        run = token_ids[i:i + pieces]
        if all(t in starts for t in run):
            return tok.decode(run).strip()
    raise AssertionError(f"no {pieces} word-start tokens in a row in {tok.convert_ids_to_tokens(token_ids)}")


@pytest.mark.parametrize("mode", SCHEDULING_MODES)
def test_seeded_rows_and_n_samples_keep_each_option(engines, mode):
    llm = engines[mode]
    allowed = [400, 401, 402, 403]
    forced = llm.generate(PROMPTS[0], SamplingParams(max_tokens=8, seed=3, ignore_eos=True, logit_bias={777: 100}))[0]
    assert forced.token_ids == [777] * 8
    outs = llm.generate(PROMPTS, SamplingParams(max_tokens=10, seed=5, n=3, ignore_eos=True, allowed_token_ids=allowed))
    assert all(t in allowed for o in outs for s in o.samples for t in s.token_ids)
    assert len({tuple(s.token_ids) for s in outs[0].samples}) > 1
    plain = llm.generate(PROMPTS[1], SamplingParams(max_tokens=10, seed=9, ignore_eos=True))[0]
    word = word_at(llm, plain.token_ids, 1)
    banned = bad_word_sequences(llm.tokenizer, [word])
    again = llm.generate(PROMPTS[1], SamplingParams(max_tokens=10, seed=9, ignore_eos=True, bad_words=[word], n=2))[0]
    for s in again.samples:
        assert not any(tuple(s.token_ids[i:i + len(b)]) == b for b in banned for i in range(10))
    mixed = llm.generate(PROMPTS * 2, [SamplingParams(max_tokens=10, seed=5, ignore_eos=True, allowed_token_ids=allowed),
                                       SamplingParams(max_tokens=10, seed=9, ignore_eos=True)] * 3)
    assert mixed[1].token_ids == plain.token_ids  # a row without options is untouched by its neighbours'
    schema = {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]}
    constrained = llm.generate(PROMPTS[0], SamplingParams(max_tokens=32, temperature=0, logit_bias={29896: 20.0},
                                                          structured_outputs={"json": schema}))[0]
    assert constrained.finish_reason == "stop" and set(json.loads(constrained.text)) == {"a"}


@pytest.mark.parametrize("mode", SCHEDULING_MODES)
def test_special_tokens_in_the_text_when_asked(engines, mode):
    llm = engines[mode]
    eos = llm.tokenizer.hf.eos_token_id
    params = dict(max_tokens=3, temperature=0, ignore_eos=True, logit_bias={eos: 100.0})
    assert llm.generate("x", SamplingParams(**params))[0].text == ""
    kept = llm.generate("x", SamplingParams(**params, skip_special_tokens=False))[0]
    joined = llm.generate("x", SamplingParams(**params, skip_special_tokens=False, spaces_between_special_tokens=False))[0]
    assert kept.token_ids == [eos] * 3
    assert kept.text == "</s> </s> </s>" and joined.text == llm.tokenizer.hf.decode([eos] * 3) == "</s></s></s>"


def test_max_logprobs_and_token_ids_outside_the_vocabulary(model_dir, engines):
    llm = engines["static"]
    outs = llm.generate(["a", "b", "c", "d"], [SamplingParams(max_tokens=2, logprobs=21),
                                               SamplingParams(max_tokens=2, logit_bias={32000: 1.0}),
                                               SamplingParams(max_tokens=2, allowed_token_ids=[5, 40000]),
                                               SamplingParams(max_tokens=2, logprobs=20)])
    assert outs[0].finish_reason == "error" and "logprobs 21 is above max_logprobs (20" in outs[0].error
    assert "token id 32000 is outside the vocabulary" in outs[1].error and "40000" in outs[2].error
    assert outs[3].finish_reason != "error" and all(len(p) >= 20 for p in outs[3].logprobs)
    wide = LLMEngine(EngineConfig(model=str(model_dir), max_logprobs=30))
    out = wide.generate("a", SamplingParams(max_tokens=2, logprobs=25))[0]
    assert out.finish_reason != "error" and all(len(p) >= 25 for p in out.logprobs)


def test_seeded_sampling_with_each_option_is_sampling_from_the_hand_masked_logits():
    """The sampler with a row's bias (logit_bias, allowed_token_ids, one-token bad words) and its
    bans (the last tokens of longer bad words) draws, for the same seeds and steps, exactly what
    it draws from logits masked by hand: the options change the distribution, not the noise."""
    from engine.sample.sampler import FLOAT_FIELDS, INT_FIELDS, Sampler, SamplingFlags, SamplingTensors

    g = torch.Generator().manual_seed(0)
    rows, vocab = 6, 3000
    logits = torch.randn(rows, vocab, generator=g) * 3
    bias = torch.zeros(rows, vocab)
    bias[0, [5, 17, 2999]] = torch.tensor([4.0, -3.0, 8.0])  # logit_bias
    bias[1] = float("-inf")
    bias[1, [10, 11, 12]] = 0.0  # allowed_token_ids
    bias[2, 7] = float("-inf")  # a one-token bad word
    ban = (torch.tensor([3, 3, 4]), torch.tensor([9, 20, 1500]))  # bad words' last tokens, now due
    floats = torch.zeros(rows, len(FLOAT_FIELDS))
    floats[:, 0], floats[:, 1], floats[:, 3] = 0.8, 1.0, 1.0  # temperature, top_p, repetition_penalty
    ints = torch.zeros(rows, len(INT_FIELDS), dtype=torch.int64)
    ints[:, 1], ints[:, 2] = torch.arange(rows) + 11, -1  # seeds; no logprobs
    st, steps = SamplingTensors(floats, ints), torch.full((rows,), 4)
    sampler, flags = Sampler(vocab, torch.device("cpu")), SamplingFlags(all_greedy=False, bias=True, bad_words=True)
    masked = logits + bias
    masked[ban] = float("-inf")
    for step in range(5):
        got, _ = sampler(logits, st, flags, steps + step, bias=bias, ban=ban)
        want, _ = sampler(masked, st, SamplingFlags(all_greedy=False), steps + step)
        assert torch.equal(got, want), step
        assert got[1].item() in (10, 11, 12) and got[2].item() != 7 and got[3].item() not in (9, 20)
