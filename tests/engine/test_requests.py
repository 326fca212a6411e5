"""Per-request behaviour: errors, stop conditions, sampling controls, logprobs, seeds."""
from __future__ import annotations

import pytest
import torch

from engine import EngineConfig, LLMEngine, SamplingParams
from parity import assert_same_tokens


@pytest.fixture(scope="module")
def llm():
    return LLMEngine(EngineConfig(model="builtin:tiny", max_batch_tokens=2048, max_num_seqs=16,
                                  max_model_len=256))


def script(llm, text: str, monkeypatch):
    """Replaces the model with one that always continues `text` (then emits EOS): each token's
    successor is fixed, so every row of a batch follows the script from its last prompt token."""
    ids = llm.tokenizer.hf(text, add_special_tokens=False)["input_ids"]
    eos = next(iter(llm.tokenizer.eos_token_ids))
    successor = {1: ids[0]}  # BOS -> first token
    for a, b in zip(ids, ids[1:] + [eos]):
        assert successor.setdefault(a, b) == b, "script tokens must be distinct"
    table = torch.full((llm.runner.vocab_size,), eos, dtype=torch.long)
    for a, b in successor.items():
        table[a] = b

    def run(cache, chunks, keep=None, all_logits=False):
        current = torch.tensor([c.seq.token_ids[c.start + c.count - 1] for c in chunks if c.samples])
        return torch.nn.functional.one_hot(table[current], llm.runner.vocab_size).float() * 50

    monkeypatch.setattr(llm.runner, "run", run)
    return ids


def test_bad_requests_fail_alone_and_the_rest_run(llm):
    prompts = ["fine", "", "x" * 300, [1, 2, 99999], 42, "also fine"]
    params = [SamplingParams(max_tokens=5, temperature=0)] * 5 + [SamplingParams(max_tokens=5000)]
    outs = llm.generate(prompts, params)
    assert outs[0].finish_reason in ("stop", "length")
    assert [o.finish_reason for o in outs[1:]] == ["error"] * 5
    assert outs[0].error is None and outs[0].num_generated_tokens >= 1
    assert "empty prompt" in outs[1].error
    assert "max_model_len (256)" in outs[2].error and "301" in outs[2].error
    assert "outside the vocabulary" in outs[3].error
    assert "string or a list of token ids" in outs[4].error
    assert "max_model_len" in outs[5].error
    assert [o.index for o in outs] == list(range(6))


def test_empty_prompt_is_an_error(llm):
    out = llm.generate([[]], SamplingParams(max_tokens=4))[0]
    assert out.finish_reason == "error" and "empty prompt" in out.error


def test_request_larger_than_the_batch_budget_is_an_error():
    llm = LLMEngine(EngineConfig(model="builtin:tiny", max_batch_tokens=64))
    small, big = llm.generate(["hi", "y" * 60], SamplingParams(max_tokens=8, temperature=0))
    assert small.finish_reason in ("stop", "length")
    assert big.finish_reason == "error" and "max_batch_tokens (64)" in big.error


def test_stop_string_cuts_text_at_a_character_boundary(llm, monkeypatch):
    script(llm, "Hé€x!yz", monkeypatch)
    out = llm.generate([[1]], SamplingParams(max_tokens=20, temperature=0, stop=["€x"]))[0]
    assert out.text == "Hé" and out.finish_reason == "stop" and out.stop_reason == "€x"
    out = llm.generate([[1]], SamplingParams(max_tokens=20, stop=["x!"], include_stop_str_in_output=True,
                                             temperature=0))[0]
    assert out.text == "Hé€x!"


def test_eos_stop_token_and_length(llm, monkeypatch):
    ids = script(llm, "abcdef", monkeypatch)
    eos = next(iter(llm.tokenizer.eos_token_ids))
    outs = llm.generate([[1]] * 4, [
        SamplingParams(max_tokens=20, temperature=0),
        SamplingParams(max_tokens=3, temperature=0),
        SamplingParams(max_tokens=20, temperature=0, stop_token_ids=[ids[2]]),
        SamplingParams(max_tokens=9, temperature=0, ignore_eos=True),
    ])
    assert (outs[0].text, outs[0].finish_reason, outs[0].token_ids[-1]) == ("abcdef", "stop", eos)
    assert (outs[1].text, outs[1].finish_reason, len(outs[1].token_ids)) == ("abc", "length", 3)
    assert (outs[2].text, outs[2].finish_reason, outs[2].stop_reason) == ("ab", "stop", ids[2])
    assert outs[3].finish_reason == "length" and len(outs[3].token_ids) == 9


def test_min_tokens_holds_back_eos(llm, monkeypatch):
    script(llm, "ab", monkeypatch)
    out = llm.generate([[1]], SamplingParams(max_tokens=10, min_tokens=5, temperature=0))[0]
    assert len(out.token_ids) >= 5 and out.text.startswith("ab")
    assert out.token_ids[2] not in llm.tokenizer.eos_token_ids


@pytest.mark.parametrize("stops", [["A"], ["A", "zzzz"]])
def test_a_stop_string_held_back_by_min_tokens_neither_ends_the_row_then_nor_later(llm, monkeypatch, stops):
    """"A" ends at the 2nd token, inside min_tokens=4: it is held back, and the row runs on to
    its EOS ("stop" by EOS, the whole text). Neither a later token rechecking the window (it
    ended the row as "length") nor a longer stop string beside it (it moved where "A" may count
    from) may let it count."""
    script(llm, "xAbcd\u00e9!", monkeypatch)
    out = llm.generate([[1]], SamplingParams(max_tokens=12, temperature=0, stop=stops, min_tokens=4))[0]
    assert out.text == "xAbcd\u00e9!" and out.finish_reason == "stop" and out.stop_reason is None


def test_a_stop_string_after_min_tokens_still_stops_the_row(llm, monkeypatch):
    script(llm, "xAbcdQef", monkeypatch)  # "A" is held back, "Q" comes after min_tokens
    out = llm.generate([[1]], SamplingParams(max_tokens=12, temperature=0, stop=["A", "Q"], min_tokens=3))[0]
    assert out.text == "xAbcd" and out.finish_reason == "stop" and out.stop_reason == "Q"


def test_logprobs_of_chosen_and_top_tokens(llm):
    out = llm.generate(["logprobs please"], SamplingParams(max_tokens=6, temperature=0, logprobs=3))[0]
    assert len(out.logprobs) == len(out.token_ids)
    for tok, entry in zip(out.token_ids, out.logprobs):
        assert tok in entry and 3 <= len(entry) <= 4
        assert all(v <= 0 for v in entry.values())
        assert entry[tok] == pytest.approx(max(entry.values()))  # greedy picks the most likely


def test_seeded_sampling_ignores_batch_composition_budget_and_mode():
    prompts = [f"sample {i} " + "z" * (i * 7) for i in range(10)]
    target = SamplingParams(max_tokens=16, temperature=1.0, top_p=0.9, top_k=50, seed=1234)
    others = [SamplingParams(max_tokens=4 + i, temperature=0.7, seed=i) for i in range(9)]
    runs = []
    for mode, budget, rows in [("static", 4096, 64), ("static", 300, 2), ("static", 4096, 1),
                               ("continuous", 4096, 64), ("continuous", 300, 2), ("continuous", 250, 3)]:
        llm = LLMEngine(EngineConfig(model="builtin:tiny", max_batch_tokens=budget, max_num_seqs=rows,
                                     scheduling=mode))
        runs.append(llm.generate(prompts[3:4], target)[0].token_ids)
        mixed = llm.generate(prompts, others[:3] + [target] + others[3:])
        runs.append(mixed[3].token_ids)
    assert all(r == runs[0] for r in runs), runs
    assert len(set(map(tuple, runs))) == 1


def test_unseeded_requests_are_reproducible_per_engine_seed():
    a = LLMEngine(EngineConfig(model="builtin:tiny", seed=7))
    b = LLMEngine(EngineConfig(model="builtin:tiny", seed=7))
    p = SamplingParams(max_tokens=12, temperature=1.0)
    assert [o.token_ids for o in a.generate(["x", "y"], p)] == [o.token_ids for o in b.generate(["x", "y"], p)]
    c = LLMEngine(EngineConfig(model="builtin:tiny", seed=8))
    assert [o.token_ids for o in c.generate(["x", "y"], p)] != [o.token_ids for o in b.generate(["x", "y"], p)]


def test_sampling_follows_the_distribution(llm):
    """Seeded samples over many seeds hit tokens roughly in proportion to their probability."""
    prompt = "distribution"
    counts = torch.zeros(llm.runner.vocab_size)
    params = [SamplingParams(max_tokens=1, temperature=1.0, seed=s, logprobs=0) for s in range(400)]
    outs = llm.generate([prompt] * 400, params)
    for o in outs:
        counts[o.token_ids[0]] += 1
    ref = llm.generate([prompt], SamplingParams(max_tokens=1, temperature=0, logprobs=5))[0]
    top_tok, top_lp = max(ref.logprobs[0].items(), key=lambda kv: kv[1])
    expected = float(torch.tensor(top_lp).exp())
    assert abs(counts[top_tok] / 400 - expected) < 0.1, (counts[top_tok] / 400, expected)


def test_top_k_one_equals_greedy(llm):
    prompts = ["top k one", "another prompt"]
    greedy = llm.generate(prompts, SamplingParams(max_tokens=10, temperature=0))
    topk1 = llm.generate(prompts, SamplingParams(max_tokens=10, temperature=1.5, top_k=1, seed=3))
    assert [o.token_ids for o in greedy] == [o.token_ids for o in topk1]


@pytest.fixture(scope="module")
def tiny_reference():
    """builtin:tiny in transformers, float32."""
    from transformers import AutoModelForCausalLM

    from engine.models.builtin import builtin_path

    return AutoModelForCausalLM.from_pretrained(builtin_path("builtin:tiny"), dtype=torch.float32).eval()


def penalised_greedy(model, ids: list[int], steps: int, presence: float, frequency: float):
    """(tokens, scores): greedy decoding over transformers' logits with presence and frequency
    penalties applied here (over the output tokens only), and the scores each step chose from."""
    from transformers import DynamicCache

    out, scores, cache, step_ids = [], [], DynamicCache(), ids
    for _ in range(steps):
        with torch.no_grad():
            logits = model(torch.tensor([step_ids]), cache=cache, use_cache=True).logits[0, -1].float()
        counts = torch.bincount(torch.tensor(out, dtype=torch.long), minlength=logits.shape[0]).float()
        score = logits - frequency * counts - presence * (counts > 0).float()
        out.append(int(score.argmax()))
        scores.append(score)
        step_ids = out[-1:]
    return out, scores


@pytest.mark.parametrize("presence,frequency", [(1.5, 0.0), (-1.0, 0.0), (0.0, 0.5), (0.8, -0.6)])
def test_presence_and_frequency_penalties_decode_like_the_reference(llm, tiny_reference, forgiveness, presence,
                                                                     frequency):
    """Negative values make tokens repeat, so presence (once per token) and frequency (per
    occurrence) lead to different outputs."""
    ids = llm.tokenizer.encode("penalty")
    base, pen = llm.generate([ids, ids], [
        SamplingParams(max_tokens=40, temperature=0, ignore_eos=True),
        SamplingParams(max_tokens=40, temperature=0, ignore_eos=True, presence_penalty=presence,
                       frequency_penalty=frequency)])
    ref, scores = penalised_greedy(tiny_reference, ids, 40, presence=presence, frequency=frequency)
    assert_same_tokens(pen.token_ids, ref, scores, f"presence={presence} frequency={frequency}", forgiveness)
    assert pen.token_ids != base.token_ids  # the penalties changed the output, so the comparison means something


def test_continuous_refills_freed_rows_and_keeps_input_order():
    """Rows that finish early are replaced at once: fewer forward passes than static batches,
    the same tokens, results in input order, the KV budget and row limit never exceeded."""
    prompts = [f"request {i}: " + "q" * (i % 5) for i in range(12)]
    params = [SamplingParams(max_tokens=4 if i % 2 else 24, temperature=0, ignore_eos=True) for i in range(12)]
    outs, stats = {}, {}
    for mode in ("static", "continuous"):
        llm = LLMEngine(EngineConfig(model="builtin:tiny", max_batch_tokens=4 * 48, max_num_seqs=4,
                                     scheduling=mode, max_num_batched_tokens=64))
        outs[mode] = llm.generate(prompts, params)
        stats[mode] = llm.batch_stats
        assert [o.index for o in outs[mode]] == list(range(12))
        assert all(s.reserved_tokens <= 4 * 48 and s.peak_rows <= 4 for s in stats[mode])
    assert [o.token_ids for o in outs["static"]] == [o.token_ids for o in outs["continuous"]]
    assert [len(o.token_ids) for o in outs["continuous"]] == [p.max_tokens for p in params]
    cont, = stats["continuous"]
    assert cont.rows == 12 and cont.prefill_steps > 3
    steps = {m: sum(s.decode_steps + s.prefill_steps for s in stats[m]) for m in stats}
    assert steps["continuous"] < steps["static"], steps


def test_continuous_mode_fails_bad_requests_alone():
    llm = LLMEngine(EngineConfig(model="builtin:tiny", max_batch_tokens=64, max_num_seqs=2, scheduling="continuous"))
    outs = llm.generate(["fine", "x" * 100, "", "also fine"], SamplingParams(max_tokens=8, temperature=0))
    assert [o.finish_reason for o in outs] == ["length", "error", "error", "length"]
    assert "max_batch_tokens (64)" in outs[1].error and "empty prompt" in outs[2].error


def test_batched_tokens_default_to_1024_on_cpu_and_the_old_name_still_sets_them():
    assert LLMEngine(EngineConfig(model="builtin:tiny", device="cpu")).scheduler.max_num_batched_tokens == 1024
    assert LLMEngine(EngineConfig(model="builtin:tiny", max_num_batched_tokens=300)).scheduler.max_num_batched_tokens == 300
    with pytest.warns(DeprecationWarning, match="max_num_batched_tokens"):
        old = EngineConfig(model="builtin:tiny", max_prefill_tokens=300)
    assert old.max_num_batched_tokens == 300 and old.max_prefill_tokens is None
    with pytest.raises(ValueError, match="not both"):
        EngineConfig(max_prefill_tokens=300, max_num_batched_tokens=200)


def test_requests_record_first_token_and_finish_times():
    llm = LLMEngine(EngineConfig(model="builtin:tiny", max_num_seqs=2, scheduling="continuous"))
    seqs = [llm.add_request(f"p{i}", SamplingParams(max_tokens=3 + i, temperature=0, ignore_eos=True))
            for i in range(4)]
    while llm.has_unfinished():
        llm.step()
    assert all(s.first_token_time is not None and s.first_token_time <= s.finish_time for s in seqs)
    # longest first: requests 3 and 2 fill both rows; request 0 joins only after one of them ends
    assert seqs[0].first_token_time >= min(seqs[2].finish_time, seqs[3].finish_time)
