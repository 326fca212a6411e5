"""Structured outputs (xgrammar): constrained rows mixed with plain ones; every output that
stops is valid; n samples per prompt."""
from __future__ import annotations

import json
import re

import jsonschema
import pytest

from engine import EngineConfig, LLMEngine, SamplingParams, StructuredOutputsParams
from engine.api.config import SCHEDULING_MODES
from schemas import SCHEMAS


@pytest.fixture(scope="module")
def engines():
    made = {}

    def get(mode: str) -> LLMEngine:
        if mode not in made:
            made[mode] = LLMEngine(EngineConfig(model="builtin:tiny", max_num_seqs=32, scheduling=mode))
        return made[mode]

    return get


def check_json(outs, schemas, label: str) -> None:
    stopped = [(o, s) for o, s in zip(outs, schemas) if o.finish_reason == "stop"]
    for o, schema in stopped:
        jsonschema.validate(json.loads(o.text), schema)
    assert len(stopped) >= 0.9 * len(outs), f"{label}: only {len(stopped)} of {len(outs)} stopped within max_tokens"


@pytest.mark.parametrize("mode", SCHEDULING_MODES)
def test_every_schema_of_the_corpus_gives_valid_json_greedy_and_seeded(engines, mode):
    assert len(SCHEMAS) >= 30
    llm = engines(mode)
    prompts = [f"Item {i}: label it." for i in range(len(SCHEMAS))]
    greedy = [SamplingParams(max_tokens=256, temperature=0, structured_outputs={"json": s}) for s in SCHEMAS]
    seeded = [SamplingParams(max_tokens=256, temperature=1.0, seed=i, structured_outputs=StructuredOutputsParams(
        json=json.dumps(s))) for i, s in enumerate(SCHEMAS)]
    check_json(llm.generate(prompts, greedy), SCHEMAS, f"{mode} greedy")
    check_json(llm.generate(prompts, seeded), SCHEMAS, f"{mode} seeded")


@pytest.mark.parametrize("mode", SCHEDULING_MODES)
def test_regex_choice_grammar_and_plain_rows_in_one_batch(engines, mode):
    llm = engines(mode)
    shared = "You are a careful labeler. Answer in the format asked. " * 2  # prefix-cached blocks too
    params = [SamplingParams(max_tokens=32, temperature=0.9, seed=3, structured_outputs={"regex": r"[a-f]{2,4}-\d{3}"}),
              SamplingParams(max_tokens=32, temperature=0, structured_outputs={"choice": ["yes", "no", "maybe so"]}),
              SamplingParams(max_tokens=48, temperature=0.7, seed=4, structured_outputs={
                  "grammar": 'root ::= "(" item ("," item)* ")"\nitem ::= [0-9] | "x"'}),
              SamplingParams(max_tokens=12, temperature=0),
              SamplingParams(max_tokens=32, temperature=0, structured_outputs={"json_object": True})]
    outs = llm.generate([shared + f"row {i}" for i in range(len(params))], params)
    assert re.fullmatch(r"[a-f]{2,4}-\d{3}", outs[0].text) and outs[0].finish_reason == "stop"
    assert outs[1].text in {"yes", "no", "maybe so"}
    assert re.fullmatch(r"\((?:[0-9]|x)(?:,(?:[0-9]|x))*\)", outs[2].text) or outs[2].finish_reason == "length"
    plain = llm.generate([shared + "row 3"], params[3])[0]
    assert outs[3].token_ids == plain.token_ids  # a plain row is not touched by its constrained neighbours
    if outs[4].finish_reason == "stop":
        assert isinstance(json.loads(outs[4].text), dict)


def test_a_row_cut_by_max_tokens_keeps_length_and_is_not_valid(engines):
    llm = engines("static")
    out = llm.generate(["x"], SamplingParams(max_tokens=3, temperature=0, structured_outputs={
        "json": {"type": "object", "properties": {"long": {"type": "string", "minLength": 20}}, "required": ["long"]}}))[0]
    assert out.finish_reason == "length"
    with pytest.raises(ValueError):
        json.loads(out.text)


def test_invalid_constraints_fail_their_request_alone(engines):
    llm = engines("static")
    outs = llm.generate(["a", "b", "c"], [SamplingParams(max_tokens=4, structured_outputs={"regex": "(unclosed"}),
                                          SamplingParams(max_tokens=4, temperature=0),
                                          SamplingParams(max_tokens=4, structured_outputs={"grammar": "root ::= nope"})])
    assert outs[0].finish_reason == "error" and "structured_outputs.regex" in outs[0].error
    assert outs[1].finish_reason == "length"
    assert outs[2].finish_reason == "error" and "structured_outputs.grammar" in outs[2].error
    with pytest.raises(ValueError, match="exactly one"):
        StructuredOutputsParams(regex="a", choice=["b"])
    with pytest.raises(ValueError, match="unknown keys"):
        SamplingParams(structured_outputs={"jsonschema": {}})


@pytest.mark.parametrize("mode", SCHEDULING_MODES)
def test_n_samples_share_the_prompt_and_reproduce_in_any_batch(engines, mode):
    llm = engines(mode)
    prompt = "Write something: " + "lorem ipsum " * 6
    sp = SamplingParams(max_tokens=12, temperature=1.0, seed=11, n=4)
    alone = llm.generate([prompt], sp)[0]
    mixed = llm.generate(["other", prompt, "another one"], [SamplingParams(max_tokens=5, seed=1), sp,
                                                             SamplingParams(max_tokens=7, temperature=0)])[1]
    assert [s.token_ids for s in alone.samples] == [s.token_ids for s in mixed.samples]
    assert [s.index for s in alone.samples] == [0, 1, 2, 3]
    assert len({tuple(s.token_ids) for s in alone.samples}) > 1  # distinct at temperature 1
    one = llm.generate([prompt], SamplingParams(max_tokens=12, temperature=1.0, seed=11))[0]
    assert alone.token_ids == one.token_ids == alone.samples[0].token_ids  # sample 0 is the n = 1 output
    assert len(one.samples) == 1 and one.samples[0].text == one.text
    stats = llm.batch_stats[-2]
    assert stats.cached_prompt_tokens >= 3 * (len(llm.tokenizer.encode(prompt)) // 16 * 16)


def test_n_out_of_range_is_refused():
    with pytest.raises(ValueError, match="n must be >= 1"):
        SamplingParams(n=0)
    with pytest.raises(ValueError, match="n must be <= 128"):
        SamplingParams(n=1000)


def test_choices_with_newlines_quotes_and_control_characters_are_produced_exactly(engines):
    """A choice is a literal, whatever it holds: a raw newline or carriage return ended the
    grammar's string literal (the request failed to compile)."""
    choices = ["line1\nline2", "x\ry", 'q"uo\\te', "tab\there", "ctl\x01z\x7f", "\u00e9t\u00e9"]
    outs = engines("continuous").generate(["Pick:"] * len(choices), [
        SamplingParams(max_tokens=20, temperature=0, structured_outputs={"choice": [c]}) for c in choices])
    assert [(o.text, o.finish_reason) for o in outs] == [(c, "stop") for c in choices]


def test_min_tokens_does_not_overrule_a_grammar_that_allows_only_its_end(engines):
    """min_tokens holds back EOS, the completed grammar allows nothing else: the grammar wins
    and the row ends there, rather than emitting token 0 (the argmax of a row of -inf)."""
    out = engines("continuous").generate(["Hi"], SamplingParams(max_tokens=10, temperature=0, min_tokens=6,
                                                                structured_outputs={"choice": ["yes"]}))[0]
    assert out.text == "yes" and out.finish_reason == "stop" and 0 not in out.token_ids


def test_a_row_whose_grammar_completes_on_its_last_allowed_token_stops(engines):
    llm = engines("continuous")
    outs = llm.generate(["p", "q"], [SamplingParams(max_tokens=1, temperature=0, structured_outputs={"regex": "[ab]"}),
                                     SamplingParams(max_tokens=2, temperature=0, structured_outputs={"regex": "[ab]{3}"})])
    assert outs[0].finish_reason == "stop" and outs[0].text in {"a", "b"}  # whole: not "length"
    assert outs[1].finish_reason == "length"  # cut: "length" on a constrained row means incomplete


def test_the_compiled_grammar_cache_is_bounded(engines, monkeypatch):
    import engine.structured.grammar as grammar

    llm = engines("static")
    monkeypatch.setattr(grammar, "CACHE_ENTRIES", 3)
    for i in range(6):
        llm.grammar.compile(StructuredOutputsParams(regex=f"x{{{i + 1}}}"))
    assert len(llm.grammar._compiled) == 3
    assert list(llm.grammar._compiled)[-1] == StructuredOutputsParams(regex="x{6}").key()
    monkeypatch.setattr(grammar, "CACHE_BYTES", 1)
    llm.grammar.compile(StructuredOutputsParams(regex="y"))
    assert len(llm.grammar._compiled) == 1  # the newest stays, however large


@pytest.mark.parametrize("rows", [None, [1, 4, 6]], ids=["every-row", "some-rows"])
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_the_cpu_bitmask_masks_exactly_what_xgrammars_kernel_does(rows, dtype):
    """The additive CPU mask against xgrammar's own kernel, on masks with all-zero, all-one and
    mixed words; a padded LM head's extra columns (past the grammar's vocabulary) are masked too."""
    import torch
    import xgrammar

    from engine.structured import apply_bitmask

    vocab, padded, batch = 1000, 1024 + 16, 8
    gen = torch.Generator().manual_seed(0)
    words = torch.randint(-2**31, 2**31 - 1, (batch, (vocab + 31) // 32), dtype=torch.int32, generator=gen)
    kind = torch.randint(0, 3, words.shape, generator=gen)
    mask = torch.where(kind == 0, 0, torch.where(kind == 1, -1, words)).to(torch.int32)
    logits = torch.randn(batch, padded, generator=gen).to(getattr(torch, dtype))
    chosen = list(range(batch)) if rows is None else rows

    ours = logits.clone()
    apply_bitmask(ours, mask, chosen, vocab)
    theirs = logits[:, :vocab].float().clone()
    xgrammar.apply_token_bitmask_inplace(theirs, mask, vocab_size=vocab, indices=chosen)
    assert torch.equal(ours[:, :vocab].float(), theirs)
    assert torch.isneginf(ours[chosen, vocab:]).all()  # no token of the grammar: never allowed
    others = [i for i in range(batch) if i not in chosen]
    assert torch.equal(ours[others], logits[others])  # rows without a grammar are untouched
    assert 0 < int(torch.isneginf(ours[chosen, :vocab]).sum()) < len(chosen) * vocab
