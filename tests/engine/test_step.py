"""The engine's step: host syncs, the KV pool, and the plan handed from scheduler to runner."""
from __future__ import annotations

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from engine import EngineConfig, LLMEngine, SamplingParams
from engine.config import SCHEDULING_MODES
from engine.tokenizer import StopStringChecker

SYNC_OPS = {"aten::_local_scalar_dense", "aten::item", "aten::is_nonzero", "aten::equal"}
"""Ops that read a device value on the host (item(), bool(), int(), if tensor: ...)."""


class SyncCounter(TorchDispatchMode):
    def __init__(self):
        super().__init__()
        self.syncs: list[str] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        name = func._schema.name
        if name in SYNC_OPS:
            self.syncs.append(name)
        return func(*args, **(kwargs or {}))


@pytest.fixture(scope="module")
def llm_factory():
    engines = {}

    def get(mode):
        if mode not in engines:
            engines[mode] = LLMEngine(EngineConfig(model="builtin:tiny", max_batch_tokens=4096, max_num_seqs=8,
                                                   scheduling=mode))
        return engines[mode]

    return get


MIXED = [SamplingParams(max_tokens=12, temperature=0),
         SamplingParams(max_tokens=9, temperature=0.9, top_k=20, top_p=0.8, min_p=0.05, seed=1),
         SamplingParams(max_tokens=14, temperature=0.7, repetition_penalty=1.2, presence_penalty=0.5,
                        frequency_penalty=0.3, seed=2, min_tokens=4),
         SamplingParams(max_tokens=10, temperature=0, stop=["zz", "\u00e9"]),
         SamplingParams(max_tokens=11, temperature=0, ignore_eos=True, stop_token_ids=[7])]


@pytest.mark.parametrize("mode", SCHEDULING_MODES)
def test_decode_steps_read_nothing_from_the_device_but_the_sampled_tokens(llm_factory, mode):
    """Sampling, penalties, min_tokens, stop strings, stop ids, the mask and the forward pass:
    no item()/bool() on a tensor in any decode step (on a GPU each would stall the stream)."""
    llm = llm_factory(mode)
    prompts = ["hello there", "a much longer prompt than the others, to pad", "x", "stop strings here", "ids"]
    for p, sp in zip(prompts, MIXED):
        llm.add_request(p, sp)
    decode_steps = 0
    while llm.has_unfinished():
        decode = llm.batch.num_rows > 0 and not llm.scheduler.pending and not (
            mode == "continuous" and llm.scheduler.has_waiting())
        with SyncCounter() as counter:
            llm.step()
        if decode:
            decode_steps += 1
            assert counter.syncs == [], f"decode step {decode_steps} synced: {counter.syncs}"
    assert decode_steps >= 8


def test_the_kv_pool_is_allocated_once_and_reused(llm_factory):
    llm = llm_factory("static")
    llm.generate(["short", "a bit longer prompt"], SamplingParams(max_tokens=8, temperature=0))
    layer = llm.cache.layers[0]
    pointer, size = layer.flat_keys.data_ptr(), llm.cache.nbytes()
    # other widths, row counts and scoring: the same buffers, laid out differently
    llm.generate(["y" * 200, "z"], SamplingParams(max_tokens=40, temperature=0))
    llm.generate(["q"] * 8, SamplingParams(max_tokens=3, temperature=0))
    llm.score_choices(["Is it good?"], [[" yes", " no"]])
    assert layer.flat_keys.data_ptr() == pointer and llm.cache.nbytes() == size
    assert llm.cache.capacity == 4096


def test_a_wider_request_joining_keeps_the_running_rows(llm_factory):
    """continuous: a request wider than the layout relays the pool out in place; rows already
    running keep their keys and values (their tokens equal a run on their own)."""
    llm = llm_factory("continuous")
    alone = llm.generate(["first row"], SamplingParams(max_tokens=30, temperature=0))[0].token_ids
    llm.add_request("first row", SamplingParams(max_tokens=30, temperature=0))
    seq = llm.scheduler.waiting[0]
    for _ in range(5):
        llm.step()
    layout = llm.cache.rows, llm.cache.width
    llm.add_request("w" * 300, SamplingParams(max_tokens=60, temperature=0))
    while llm.has_unfinished():
        llm.step()
    assert (llm.cache.rows, llm.cache.width) != layout
    assert seq.output_token_ids == alone


def test_stop_strings_are_found_across_tokens_and_multibyte_characters(llm_factory):
    """The check decodes a window of the latest tokens: a stop string split over several
    tokens, or inside a multi-byte character's byte tokens, is still found, and the text is
    cut before it."""
    from engine.builtin import byte_tokenizer
    from engine.tokenizer import Tokenizer

    tok = Tokenizer(byte_tokenizer())
    ids = tok.hf("ab\u20acxy!", add_special_tokens=False)["input_ids"]  # the euro sign is 3 byte tokens
    checker = StopStringChecker(["\u20acx"])
    hits = [checker.found(tok.decode_windows([ids[max(0, k + 1 - checker.window): k + 1]])[0])
            for k in range(len(ids))]
    assert hits.index(True) == 5  # a, b, 3 bytes of the euro sign, then x


@pytest.mark.parametrize("mode", SCHEDULING_MODES)
def test_logprob_rows_and_plain_rows_in_one_batch(llm_factory, mode):
    """A prefill group without logprob rows joins a batch that has one (separate prefills)."""
    llm = LLMEngine(EngineConfig(model="builtin:tiny", max_batch_tokens=1024, max_num_seqs=4,
                                 max_prefill_tokens=8, scheduling=mode))
    outs = llm.generate(["abcdef", "ghijkl", "mnopqr"],
                        [SamplingParams(max_tokens=4, temperature=0, logprobs=2),
                         SamplingParams(max_tokens=4, temperature=0), SamplingParams(max_tokens=5, temperature=0)])
    assert len(outs[0].logprobs) == len(outs[0].token_ids) and outs[1].logprobs is None
    assert llm.batch_stats[0].prefill_steps == 3
