"""Sampling checked against references computed here: top-k, top-p and min-p against
transformers' own warpers (every sampled token allowed, frequencies by a chi-square test at
fixed seeds), presence/frequency penalties against the formula, logprobs against log_softmax of
transformers' logits."""
from __future__ import annotations

import math
from collections import Counter

import pytest
import torch
from transformers.generation.logits_process import (MinPLogitsWarper, TemperatureLogitsWarper, TopKLogitsWarper,
                                                    TopPLogitsWarper)

from engine import EngineConfig, LLMEngine, SamplingParams
from engine.sample.sampler import FLOAT_FIELDS, INT_FIELDS, SamplingTensors, apply_penalties

PROMPT = "abc"
TEMPERATURE = 0.8
SEEDS = 1000
"""Samples per control: one first token per seed, all drawn from the same distribution."""
CONTROLS = {"top_k": {"top_k": 6}, "top_p": {"top_p": 0.6}, "min_p": {"min_p": 0.2}}
MARGIN = 1e-3
"""No token may sit this close to a control's cut-off (else the allowed set depends on rounding)."""


def reference_probs(logits: torch.Tensor, top_k: int = 0, top_p: float = 1.0, min_p: float = 0.0) -> torch.Tensor:
    """(V,) the distribution a request samples its first token from, by transformers' warpers."""
    scores = TemperatureLogitsWarper(TEMPERATURE)(None, logits[None])
    if top_k:
        scores = TopKLogitsWarper(top_k)(None, scores)
    if top_p < 1:
        scores = TopPLogitsWarper(top_p)(None, scores)
    if min_p:
        scores = MinPLogitsWarper(min_p)(None, scores)
    return scores.softmax(dim=-1)[0]


def assert_clear_cut(logits: torch.Tensor, top_k: int = 0, top_p: float = 1.0, min_p: float = 0.0) -> None:
    """The setup is unambiguous: no token within MARGIN of the control's cut-off."""
    probs = (logits / TEMPERATURE).softmax(dim=-1).sort(descending=True).values
    if top_k:
        assert probs[top_k - 1] - probs[top_k] > MARGIN * probs[0]
    if top_p < 1:
        before = probs.cumsum(dim=0) - probs
        assert (before - top_p).abs().min() > MARGIN
    if min_p:
        assert ((probs - min_p * probs[0]).abs() / probs[0]).min() > MARGIN


def chi_square(counts: Counter, probs: torch.Tensor, n: int) -> tuple[float, int]:
    """Pearson's statistic and degrees of freedom over the allowed tokens; tokens expected fewer
    than 5 times are pooled into one cell."""
    expected = {t: n * float(p) for t, p in enumerate(probs) if p > 0}
    cells, rest_seen, rest_expected = [], 0, 0.0
    for t, e in expected.items():
        if e >= 5:
            cells.append((counts[t], e))
        else:
            rest_seen, rest_expected = rest_seen + counts[t], rest_expected + e
    if rest_expected:
        cells.append((rest_seen, rest_expected))
    return sum((o - e) ** 2 / e for o, e in cells), len(cells) - 1


def chi_square_critical(df: int, z: float = 3.0902) -> float:
    """The chi-square value exceeded with probability 0.001 (z: the normal's 0.999 quantile), by
    the Wilson-Hilferty approximation (within 1% for df >= 3; no scipy needed)."""
    return df * (1 - 2 / (9 * df) + z * math.sqrt(2 / (9 * df))) ** 3


@pytest.fixture(scope="module")
def samples(tiny_model_dir, reference_model):
    """control -> (first tokens of SEEDS seeded requests, transformers' logits for the prompt).
    All controls run in one mixed batch, so a row's settings must not leak to its neighbours."""
    path = tiny_model_dir("llama")
    llm = LLMEngine(EngineConfig(model=str(path), max_num_seqs=len(CONTROLS) * SEEDS, max_batch_tokens=16384))
    ids = llm.tokenizer.encode(PROMPT)
    with torch.no_grad():
        logits = reference_model(path)(torch.tensor([ids])).logits[0, -1].float()
    params = [SamplingParams(max_tokens=1, temperature=TEMPERATURE, seed=seed, **kw)
              for kw in CONTROLS.values() for seed in range(SEEDS)]
    outs = llm.generate([ids] * len(params), params)
    tokens = [o.token_ids[0] for o in outs]
    return {name: (tokens[i * SEEDS:(i + 1) * SEEDS], logits) for i, name in enumerate(CONTROLS)}


@pytest.mark.parametrize("control", CONTROLS)
def test_sampled_tokens_stay_inside_the_allowed_set(control, samples):
    tokens, logits = samples[control]
    assert_clear_cut(logits, **CONTROLS[control])
    allowed = set(reference_probs(logits, **CONTROLS[control]).nonzero().flatten().tolist())
    assert 1 < len(allowed) < 30, allowed  # the control really cuts, and leaves a choice
    outside = Counter(t for t in tokens if t not in allowed)
    assert not outside, f"{control}: sampled outside the allowed set {sorted(allowed)}: {dict(outside)}"


@pytest.mark.parametrize("control", CONTROLS)
def test_sampled_frequencies_match_the_reference(control, samples):
    tokens, logits = samples[control]
    probs = reference_probs(logits, **CONTROLS[control])
    stat, df = chi_square(Counter(tokens), probs, len(tokens))
    assert df >= 2
    assert stat < chi_square_critical(df), (
        f"{control}: chi-square {stat:.1f} >= {chi_square_critical(df):.1f} (df={df}); counts "
        f"{sorted(Counter(tokens).items())}, expected {[(t, round(len(tokens) * float(p), 1)) for t, p in enumerate(probs) if p > 0]}")


def test_presence_and_frequency_penalties_change_the_logits_exactly():
    """vLLM's semantics, computed element by element: repetition over tokens seen (prompt or
    output), then frequency x occurrences in the output, then presence if it occurred at all.
    Every value is a multiple of 1/8, so float32 has no rounding and equality is exact."""
    gen = torch.Generator().manual_seed(0)
    rows, vocab = 4, 32
    logits = torch.randint(-64, 64, (rows, vocab), generator=gen).float() / 8
    counts = torch.randint(0, 4, (rows, vocab), generator=gen) * (torch.rand(rows, vocab, generator=gen) < 0.4)
    seen = (counts > 0) | (torch.rand(rows, vocab, generator=gen) < 0.2)
    settings = [  # (repetition, presence, frequency)
        (1.0, 0.5, 0.0), (1.0, 0.0, 1.5), (2.0, -0.75, 0.25), (1.0, 2.0, -2.0)]
    floats = torch.zeros(rows, len(FLOAT_FIELDS))
    for i, (rep, pres, freq) in enumerate(settings):
        floats[i, FLOAT_FIELDS.index("temperature")] = 1.0
        floats[i, FLOAT_FIELDS.index("top_p")] = 1.0
        floats[i, FLOAT_FIELDS.index("repetition_penalty")] = rep
        floats[i, FLOAT_FIELDS.index("presence_penalty")] = pres
        floats[i, FLOAT_FIELDS.index("frequency_penalty")] = freq
    st = SamplingTensors(floats, torch.zeros(rows, len(INT_FIELDS), dtype=torch.int64))
    got = apply_penalties(logits, st, counts.float(), seen)
    expected = logits.clone()
    for i, (rep, pres, freq) in enumerate(settings):
        for v in range(vocab):
            x = float(logits[i, v])
            if seen[i, v]:
                x = x / rep if x > 0 else x * rep
            x -= freq * int(counts[i, v])
            x -= pres if counts[i, v] > 0 else 0.0
            expected[i, v] = x
    assert torch.equal(got, expected), (got - expected).abs().max()
    assert not torch.equal(got, logits)


def test_logprobs_equal_log_softmax_of_transformers_logits(tiny_model_dir, reference_model):
    """The chosen token's and the top-N logprobs are the model's own (raw logits, before
    temperature and filters), for a greedy and a sampled row, at every step."""
    path = tiny_model_dir("llama")
    model = reference_model(path)
    llm = LLMEngine(EngineConfig(model=str(path)))
    prompts = ["logprobs please", "Hello world"]
    params = [SamplingParams(max_tokens=8, temperature=0, logprobs=5, ignore_eos=True),
              SamplingParams(max_tokens=8, temperature=TEMPERATURE, top_k=20, seed=3, logprobs=5, ignore_eos=True)]
    checked = 0
    for prompt, out in zip(prompts, llm.generate(prompts, params)):
        ids = llm.tokenizer.encode(prompt)
        with torch.no_grad():
            ref = model(torch.tensor([ids + out.token_ids])).logits[0, len(ids) - 1:-1].float().log_softmax(-1)
        assert len(out.logprobs) == len(out.token_ids) == 8
        for step, (token, entry) in enumerate(zip(out.token_ids, out.logprobs)):
            values, top = ref[step].topk(6)
            assert token in entry
            if values[4] - values[5] > 1e-4:  # the top 5 are unambiguous
                assert set(entry) == set(top[:5].tolist()) | {token}, (step, entry, top.tolist())
            for t, lp in entry.items():
                assert abs(lp - float(ref[step, t])) < 1e-4, (prompt, step, t, lp, float(ref[step, t]))
                checked += 1
    assert checked >= 2 * 8 * 5


def test_two_pass_argmax_equals_argmax_with_ties_and_a_tail():
    from engine.sample.sampler import argmax

    g = torch.Generator().manual_seed(0)
    for v in (100, 1000, 1024 + 37, 16384, 16384 + 37, 128256):
        x = torch.randn(9, v, generator=g)
        x[1, :] = 0.0  # all tied: the first index
        x[2, [5, v - 1]] = 50.0  # a tie between the first chunk and the tail
        x[3, v - 1] = 60.0  # the tail's own maximum
        x[4, [v // 2, v // 2 + 1]] = 70.0  # a tie inside one chunk
        assert torch.equal(argmax(x), x.argmax(dim=-1)), v



def test_gumbel_noise_is_finite_at_every_draw_so_a_masked_token_never_wins():
    from engine.sample.sampler import argmax, gumbel_noise

    bits = torch.tensor([[(1 << 24) - 1, 0, 1 << 23, (1 << 24) - 2]], dtype=torch.int64)
    assert ((bits.to(torch.float32) + 0.5) / (1 << 24)).max().item() == 1.0  # the draw that rounds to u = 1
    noise = gumbel_noise(bits)
    assert torch.isfinite(noise).all()
    masked = torch.tensor([[float("-inf"), 0.0, 1.0, 0.5]])  # token 0 forbidden, with the top draw
    assert argmax(masked + noise).item() != 0


def test_a_row_at_top_p_1_keeps_its_whole_tail_beside_a_top_p_row():
    """In float32 the cumulative mass of 32k tokens reaches 1 before the last of them: a row at
    top_p 1 must still keep every token when another row of its batch turns top-p filtering on,
    so that its seeded draw does not depend on its neighbours."""
    from engine.sample.sampler import SamplingFlags, _filter

    vocab = 32000
    logits = torch.full((2, vocab), math.log(0.005 / (vocab - 1)))
    logits[:, 0] = math.log(0.995)
    floats = torch.tensor([[1.0, 1.0, 0.0, 1.0, 0.0, 0.0], [1.0, 0.5, 0.0, 1.0, 0.0, 0.0]])
    st = SamplingTensors(floats=floats, ints=torch.zeros((2, 3), dtype=torch.int64))
    kept = _filter(logits.clone(), st, SamplingFlags(all_greedy=False, top_p=True)) > torch.finfo(torch.float32).min
    assert kept[0].all()  # top_p 1: nothing dropped
    assert kept[1].sum() == 1  # top_p 0.5: only the most likely token
