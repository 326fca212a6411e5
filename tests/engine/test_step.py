"""The engine's step: host syncs, the KV pool, and the plan handed from scheduler to runner."""
from __future__ import annotations

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from engine import EngineConfig, LLMEngine, SamplingParams
from engine.api.config import SCHEDULING_MODES
from engine.models.tokenizer import StopStringChecker
from lora_models import greedy

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
            # the fast paths' checks (engine.runner.fast_paths) read the device once per engine, at
            # first use: done here, so the steps counted below are the engine's steady state
            engines[mode].generate(["warm"], SamplingParams(max_tokens=2))
        return engines[mode]

    return get


MIXED = [SamplingParams(max_tokens=12, temperature=0),
         SamplingParams(max_tokens=9, temperature=0.9, top_k=20, top_p=0.8, min_p=0.05, seed=1),
         SamplingParams(max_tokens=14, temperature=0.7, repetition_penalty=1.2, presence_penalty=0.5,
                        frequency_penalty=0.3, seed=2, min_tokens=4),
         SamplingParams(max_tokens=10, temperature=0, stop=["zz", "\u00e9"]),
         SamplingParams(max_tokens=11, temperature=0, ignore_eos=True, stop_token_ids=[7]),
         SamplingParams(max_tokens=8, temperature=0.5, seed=3, logprobs=3)]


class HostReads:
    """Counts what moves device values to the host besides dispatched ops: .cpu(), .tolist()
    and .nonzero() on tensors (on a GPU each one waits for the stream)."""

    def __init__(self, monkeypatch):
        self.calls: list[str] = []
        for name in ("cpu", "tolist", "nonzero"):
            original = getattr(torch.Tensor, name)

            def counted(t, *a, _name=name, _original=original, **k):
                self.calls.append(_name)
                return _original(t, *a, **k)

            monkeypatch.setattr(torch.Tensor, name, counted)


@pytest.mark.parametrize("mode", SCHEDULING_MODES)
def test_each_step_reads_the_device_once(llm_factory, mode, monkeypatch):
    """Sampling, penalties, min_tokens, stop strings, stop ids and the forward pass, in decode
    steps and in passes that carry prefill chunks: no item()/bool() on a tensor, and exactly
    one transfer to the host (the sampled tokens and finish flags)."""
    llm = llm_factory(mode)
    prompts = ["hello there", "a much longer prompt than the others, to pad", "x", "stop strings here", "ids",
               "logprobs too"]
    seqs = [llm.add_request(p, sp) for p, sp in zip(prompts, MIXED)]
    reads = HostReads(monkeypatch)
    steps = prefill_steps = 0
    while llm.has_unfinished():
        before = llm.scheduler.waiting + llm.scheduler.cohort
        reads.calls.clear()
        with SyncCounter() as counter:
            llm.step()
        steps += 1
        prefill_steps += bool(set(map(id, before)) - set(map(id, llm.scheduler.waiting + llm.scheduler.cohort)))
        assert counter.syncs == [], f"step {steps} synced: {counter.syncs}"
        assert reads.calls == ["cpu"], f"step {steps} read the device: {reads.calls}"
    assert steps >= 8 and prefill_steps >= 1
    assert len(seqs[-1].logprobs) == seqs[-1].num_output_tokens and all(len(e) >= 3 for e in seqs[-1].logprobs)


def test_the_kv_pool_is_allocated_once_and_reused(llm_factory):
    llm = llm_factory("static")
    llm.generate(["short", "a bit longer prompt"], SamplingParams(max_tokens=8, temperature=0))
    layer = llm.cache.layers[0]
    pointer, size = layer.keys.data_ptr(), llm.cache.nbytes()
    # other lengths, row counts and scoring: the same buffers
    llm.generate(["y" * 200, "z"], SamplingParams(max_tokens=40, temperature=0))
    llm.generate(["q"] * 8, SamplingParams(max_tokens=3, temperature=0))
    llm.score_choices(["Is it good?"], [[" yes", " no"]])
    assert layer.keys.data_ptr() == pointer and llm.cache.nbytes() == size
    assert llm.cache.capacity == 4096 and llm.pool.num_free == llm.pool.num_blocks


@pytest.mark.parametrize("mode", SCHEDULING_MODES)
def test_preempted_rows_give_the_tokens_of_a_run_that_never_preempts(mode):
    """A pool too small for every row to grow: rows are preempted and recomputed, and greedy and
    seeded rows come out token for token as with a pool that holds everything."""
    prompts = [f"row {i}: " + "abcdefgh"[i % 8] * (5 + 3 * i) for i in range(8)]
    params = [SamplingParams(max_tokens=40, temperature=0 if i % 2 else 0.8, seed=i, ignore_eos=True)
              for i in range(8)]
    roomy = LLMEngine(EngineConfig(model="builtin:tiny", max_batch_tokens=4096, max_num_seqs=8, scheduling=mode))
    tight = LLMEngine(EngineConfig(model="builtin:tiny", max_batch_tokens=320, max_num_seqs=8, scheduling=mode))
    want = [o.token_ids for o in roomy.generate(prompts, params)]
    got = [o.token_ids for o in tight.generate(prompts, params)]
    assert sum(s.preemptions for s in tight.batch_stats) > 0
    assert sum(s.preemptions for s in roomy.batch_stats) == 0
    assert got == want
    assert all(s.reserved_tokens <= 320 for s in tight.batch_stats)


def test_stop_strings_are_found_across_tokens_and_multibyte_characters(llm_factory):
    """The check decodes a window of the latest tokens: a stop string split over several
    tokens, or inside a multi-byte character's byte tokens, is still found, and the text is
    cut before it."""
    from engine.models.builtin import byte_tokenizer
    from engine.models.tokenizer import Tokenizer

    tok = Tokenizer(byte_tokenizer())
    ids = tok.hf("ab\u20acxy!", add_special_tokens=False)["input_ids"]  # the euro sign is 3 byte tokens
    checker = StopStringChecker(["\u20acx"])
    hits = [checker.found(tok.decode_windows([ids[max(0, k + 1 - checker.window): k + 1]])[0])
            for k in range(len(ids))]
    assert hits.index(True) == 5  # a, b, 3 bytes of the euro sign, then x


def _trained_tokenizer(kind: str):
    """A small BPE tokenizer trained here: byte-level (GPT-2 style) or SentencePiece-like."""
    from tokenizers import Tokenizer as RustTokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    rust = RustTokenizer(models.BPE(byte_fallback=kind == "metaspace"))
    if kind == "bytelevel":
        rust.pre_tokenizer, rust.decoder = pre_tokenizers.ByteLevel(add_prefix_space=False), decoders.ByteLevel()
        alphabet = pre_tokenizers.ByteLevel.alphabet()
    else:
        rust.pre_tokenizer = pre_tokenizers.Metaspace()
        rust.decoder = decoders.Sequence([decoders.ByteFallback(), decoders.Metaspace()])
        alphabet = []
    corpus = ["the end. \u20ac5 Answer: yes!", "stop here; THE END\n\nnext \u2603 snow", "ab\u20acxy! done."] * 20
    trainer = trainers.BpeTrainer(vocab_size=300, initial_alphabet=alphabet,
                                  special_tokens=[f"<0x{b:02X}>" for b in range(256)] if kind == "metaspace" else [])
    rust.train_from_iterator(corpus, trainer)
    return PreTrainedTokenizerFast(tokenizer_object=rust)


@pytest.mark.parametrize("kind", ["bytes", "bytelevel", "metaspace"])
def test_stop_string_checks_skip_only_tokens_that_cannot_complete_one(kind):
    """A step decodes the window only when its token can complete a stop string: on random
    token sequences, every token that completes one (the window ending at it holds a stop
    string, the window before it none) is marked as a possible end."""
    import random

    from engine.models.builtin import byte_tokenizer
    from engine.models.tokenizer import Tokenizer

    tok = Tokenizer(byte_tokenizer() if kind == "bytes" else _trained_tokenizer(kind))
    vocab = len(tok.hf)
    rng = random.Random(0)
    for stops in (["\u20acx"], ["END", "!"], ["\u2603", ";"], ["\n\n"], ["x", ". "]):
        enders = tok.stop_enders(stops, vocab + 3)
        if any(s[-1].isspace() for s in stops):
            assert enders is None
            continue
        assert enders is not None and len(enders) == vocab + 3 and 0 < enders.sum() < len(enders)
        checker = StopStringChecker(stops, enders)
        targets = [tok.hf(s, add_special_tokens=False)["input_ids"] for s in stops]
        completed = 0
        for _ in range(200):
            ids = [rng.randrange(vocab) for _ in range(rng.randrange(1, 12))] + rng.choice(targets)
            ids += [rng.randrange(vocab) for _ in range(3)]
            windows = [ids[max(0, k + 1 - checker.window): k + 1] for k in range(len(ids))]
            hits = [checker.found(t) for t in tok.decode_windows(windows)]
            for k in range(len(ids)):
                if hits[k] and not (k and hits[k - 1]):
                    completed += 1
                    assert checker.may_stop(ids[k]), (stops, ids[: k + 1])
        assert completed >= 200


@pytest.mark.parametrize("mode", SCHEDULING_MODES)
def test_logprob_rows_and_plain_rows_in_one_batch(llm_factory, mode):
    """Rows with and without logprobs in one pass; prompts longer than the pass budget arrive in chunks."""
    llm = LLMEngine(EngineConfig(model="builtin:tiny", max_batch_tokens=1024, max_num_seqs=4,
                                 max_num_batched_tokens=8, scheduling=mode))
    outs = llm.generate(["abcdef", "ghijkl", "mnopqr"],
                        [SamplingParams(max_tokens=4, temperature=0, logprobs=2),
                         SamplingParams(max_tokens=4, temperature=0), SamplingParams(max_tokens=5, temperature=0)])
    assert len(outs[0].logprobs) == len(outs[0].token_ids) and outs[1].logprobs is None
    assert sum(s.prefill_steps for s in llm.batch_stats) >= 3  # 21 prompt tokens, 8 per pass


def failing_passes(monkeypatch, prompts, params, fail):
    """(the tokens an undisturbed engine gives, an engine whose passes first call `fail(chunks)`,
    which raises to make the pass fail)."""
    want = [o.token_ids for o in LLMEngine(EngineConfig(model="builtin:tiny")).generate(prompts, params)]
    llm = LLMEngine(EngineConfig(model="builtin:tiny"))
    real = llm.runner.run

    def run(cache, chunks, **kw):
        fail(chunks)
        return real(cache, chunks, **kw)

    monkeypatch.setattr(llm.runner, "run", run)
    return want, llm


def test_out_of_memory_in_a_pass_requeues_its_prefills_and_the_engine_carries_on(monkeypatch):
    """A pass that runs out of memory: its prefill rows go back to the queue, passes get smaller,
    the pool is intact (every block free again at the end) and the tokens equal an undisturbed run."""
    prompts = [f"prompt {i} " + "z" * (10 * i) for i in range(6)]
    params = SamplingParams(max_tokens=10, temperature=0, ignore_eos=True)
    failed = []

    def fail(chunks):
        if not failed and sum(c.count for c in chunks) > 64:
            failed.append(len(chunks))
            raise torch.OutOfMemoryError("CUDA out of memory (simulated)")

    want, llm = failing_passes(monkeypatch, prompts, params, fail)
    got = [o.token_ids for o in llm.generate(prompts, params)]
    assert failed and got == want
    assert llm.scheduler.max_num_batched_tokens == 512
    assert llm.pool.num_free == llm.pool.num_blocks


@pytest.mark.parametrize("error", [torch.OutOfMemoryError("CUDA out of memory (simulated)"), KeyboardInterrupt()])
def test_a_pass_that_raises_leaves_the_engine_usable(monkeypatch, error):
    """Out of memory in a pass of decoding rows alone (no prefill to requeue) or Ctrl-C: the
    error reaches the caller, the unfinished requests are ended, every block is back in the
    pool, and the next generate() runs and gives the tokens of a fresh engine."""
    prompts = [f"prompt {i} " + "q" * (6 * i) for i in range(4)]
    params = SamplingParams(max_tokens=12, temperature=0, ignore_eos=True)
    passes = []

    def fail(chunks):
        passes.append(len(chunks))
        if len(passes) == 5:  # a decode pass: every row past its prompt
            assert all(c.count == 1 for c in chunks)
            raise error

    want, llm = failing_passes(monkeypatch, prompts, params, fail)
    with pytest.raises(type(error)):
        llm.generate(prompts, params)
    assert not llm.has_unfinished() and llm.pool.num_free == llm.pool.num_blocks
    got = [o.token_ids for o in llm.generate(prompts, params)]
    assert got == want and len(passes) > 5


def test_the_engine_reports_its_pool_and_weights():
    llm = LLMEngine(EngineConfig(model="builtin:tiny", max_batch_tokens=1000, block_size=8))
    before = llm.memory
    llm.generate(["x"], SamplingParams(max_tokens=2))
    assert llm.memory == before
    assert before["kv_bytes"] == llm.cache.nbytes() * llm.cache.num_blocks // llm.cache.physical_blocks
    assert before["kv_blocks"] == 125 and before["kv_tokens"] == 1000 and before["block_size"] == 8
    model = llm.runner.model
    tensors = {t.data_ptr(): t for t in list(model.parameters()) + list(model.buffers())}  # a tied head once
    packed = [m for m in model.modules() if type(m).__name__ == "PackedLinear"]  # weights reordered by oneDNN
    assert len(packed) == llm.runner.packed_linears > 0
    assert before["weights_bytes"] == (sum(t.numel() * t.element_size() for t in tensors.values())
                                       + sum(m.packed_nbytes for m in packed))
    head = model.get_output_embeddings()
    assert type(head).__name__ == "OneDnnLinear"  # a CPU float32 head runs through oneDNN, on its own weight
    if model.config.tie_word_embeddings:
        assert head.weight is model.get_input_embeddings().weight


def test_a_tied_cpu_head_runs_on_the_embeddings_own_weight_with_transformers_tokens(tiny_model_dir, reference_model):
    """A CPU float32 head runs through oneDNN on the tied embedding's tensor, not on a prepacked
    copy: the weights are counted once, and the greedy tokens are transformers'."""
    path = tiny_model_dir("gemma2")
    llm = LLMEngine(EngineConfig(model=str(path), dtype="float32", device="cpu"))
    model = llm.runner.model
    head, embedding = model.get_output_embeddings(), model.get_input_embeddings()
    assert type(head).__name__ == "OneDnnLinear" and head.weight is embedding.weight
    unique = {p.data_ptr(): p.numel() * p.element_size() for p in list(model.parameters()) + list(model.buffers())}
    packed = sum(m.packed_nbytes for m in model.modules() if type(m).__name__ == "PackedLinear")
    assert llm.memory["weights_bytes"] == sum(unique.values()) + packed
    prompt = [5, 17, 33, 2, 9]
    got = llm.generate([prompt], SamplingParams(max_tokens=6, temperature=0, ignore_eos=True))[0].token_ids
    assert got == greedy(reference_model(path), prompt, 6)


def test_the_pool_sized_from_the_card_counts_this_engines_share_only(monkeypatch):
    """gpu_memory_utilization is this engine's share of the card, as in vLLM: two engines at 0.45
    fit one card. Memory another process held when this one started is not subtracted from its
    share (it was: the second engine's budget came out negative), but it must have been free;
    memory torch still caches from an engine this process dropped is free for the next one, and
    an engine still running beside it is not counted in its peak. CUDA's memory calls are stood
    in for: an 80 GiB card, 40 GiB held elsewhere, a 1 GiB CUDA context, 12 GiB of weights and
    activations at the profiling pass, 0.5 GiB of workspaces."""
    import types

    from engine.runner import memory

    gib = 1 << 30
    total, elsewhere, context, peak, workspaces = 80 * gib, 40 * gib, 1 * gib, 12 * gib, gib // 2
    card = {"reserved": 0, "allocated": 0, "used": elsewhere + context}  # what the stand-ins report

    class Probe:
        physical_blocks = 64

        def nbytes(self):
            return 64 * (1 << 20)  # 1 MiB a block

    for name in ("synchronize", "reset_peak_memory_stats", "empty_cache"):
        monkeypatch.setattr(torch.cuda, name, lambda *a, **k: None)
    monkeypatch.setattr(torch.cuda, "memory_reserved", lambda device=None: card["reserved"])
    monkeypatch.setattr(torch.cuda, "memory_allocated", lambda device=None: card["allocated"])
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda device=None: (total - card["used"], total))

    def size(util: float, cached: int = 0, live: int = 0) -> int:
        """An engine loading beside `cached` bytes torch caches from a dropped engine and `live`
        bytes of an engine still running, both in this process."""
        card.update(reserved=cached + live, allocated=live, used=elsewhere + context + cached + live)
        before = memory.used_before_load(torch.device("cuda", 0))
        card.update(reserved=cached + live + peak, used=elsewhere + context + cached + live + peak + workspaces)
        monkeypatch.setattr(torch.cuda, "max_memory_allocated", lambda device=None: live + peak)
        runner = types.SimpleNamespace(device=torch.device("cuda", 0), memory_before_load=before,
                                       new_cache=lambda n, bs: Probe(), run=lambda cache, chunks: None,
                                       drop_cache=lambda cache: None, vocab_size=32000)
        return memory.profile_pool_blocks(runner, 16, 1024, 1024, util)

    prompt_logits = 2 * ((256 << 20) // (4 * 32000)) * 32000 * 4  # what collecting prompt logprobs keeps: ~512 MiB
    share = (int(total * 0.45) - peak - workspaces - prompt_logits) // (1 << 20)  # 23 GiB of 1 MiB blocks
    assert size(0.45) == share
    assert size(0.45, cached=30 * gib) == share  # a rebuilt engine (a worker's restart) gets its share again
    assert size(0.2, live=20 * gib) == (int(total * 0.2) - peak - workspaces - prompt_logits) // (1 << 20)
    with pytest.raises(RuntimeError, match=r"gpu_memory_utilization=0.6 asks for 48.0 GiB .* only 39.0 GiB were free"):
        size(0.6)  # 48 GiB asked, 39 GiB were free
    with pytest.raises(RuntimeError, match=r"only 19.0 GiB were free"):
        size(0.45, live=20 * gib)  # the engine beside it holds 20 of the 39
