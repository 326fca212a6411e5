"""A static batch in flight: left-padded rows sharing one KV cache, progress kept as tensors."""
from __future__ import annotations

import time

import torch

from engine.outputs import BatchStats
from engine.sampler import SamplingTensors
from engine.sequence import Sequence
from engine.tokenizer import Tokenizer, find_stop


class Batch:
    """Rows are left-padded to the longest prompt, so every row writes the same cache column
    each step. Finished rows are dropped (the cache compacted) once they are worth the copy."""

    def __init__(self, seqs: list[Sequence], tokenizer: Tokenizer, runner):
        self.seqs = seqs
        self.tokenizer = tokenizer
        self.device = device = runner.device
        self.max_position = runner.max_position_embeddings
        vocab_size = runner.vocab_size
        b = len(seqs)
        plen = max(s.num_prompt_tokens for s in seqs)
        mlen = max(s.params.max_tokens for s in seqs)
        self.cache = runner.new_cache(plen + mlen)
        self.stats = BatchStats(
            rows=b, max_prompt_len=plen, max_new_tokens=mlen, reserved_tokens=b * (plen + mlen),
            prompt_tokens=sum(s.num_prompt_tokens for s in seqs), padded_prompt_tokens=b * plen)
        self.started = time.perf_counter()
        self._all = list(seqs)

        def col(values, dtype=torch.int64):
            return torch.tensor(values, dtype=dtype, device=device)

        self.prompt_lens = col([s.num_prompt_tokens for s in seqs])  # (B,)
        self.max_tokens = col([s.params.max_tokens for s in seqs])  # (B,)
        self.min_tokens = col([s.params.min_tokens for s in seqs])  # (B,)
        self.steps = torch.zeros(b, dtype=torch.int64, device=device)  # (B,) tokens generated
        self.alive = torch.ones(b, dtype=torch.bool, device=device)  # (B,)
        self.out = torch.full((b, mlen), tokenizer.pad_token_id, dtype=torch.int64, device=device)  # (B, M)
        self.mask = torch.zeros((b, plen + mlen), dtype=torch.int64, device=device)  # (B, P + M)
        self.stop_ids = self._stop_ids(seqs)  # (B, K), -1 = no id
        self.sampling = SamplingTensors.from_sequences(seqs, device)
        self.length = 0  # cache columns filled
        self.decoded_steps = 0  # decode forward passes run
        self._text_rows = [i for i, s in enumerate(seqs) if s.params.stop]
        self._logprob_rows = [i for i, s in enumerate(seqs) if s.params.logprobs is not None]
        self.banned = self._banned(vocab_size) if bool((self.min_tokens > 0).any()) else None
        self.output_counts = self.seen = None
        if self.sampling.needs_penalties:
            self.output_counts = torch.zeros((b, vocab_size), dtype=torch.float32, device=device)
            self.seen = torch.zeros((b, vocab_size), dtype=torch.bool, device=device)
            for i, s in enumerate(seqs):
                self.seen[i, torch.tensor(s.prompt_token_ids, device=device)] = True

    # -- inputs -------------------------------------------------------------------------------

    def prefill_inputs(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """(input_ids, attention_mask, position_ids), each (B, P): prompts, left-padded."""
        plen = self.stats.max_prompt_len
        ids = torch.full((len(self.seqs), plen), self.tokenizer.pad_token_id, dtype=torch.int64)
        for i, s in enumerate(self.seqs):
            ids[i, plen - s.num_prompt_tokens:] = torch.tensor(s.prompt_token_ids)
        cols = torch.arange(plen, device=self.device)[None, :]
        real = cols >= (plen - self.prompt_lens)[:, None]  # (B, P)
        self.mask[:, :plen] = real.long()
        positions = (cols - (plen - self.prompt_lens)[:, None]).clamp(min=0)
        self.length = plen
        return ids.to(self.device), self.mask[:, :plen], positions

    def decode_inputs(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """(last tokens (B, 1), attention_mask (B, filled + 1), positions (B, 1))."""
        last = self.out.gather(1, (self.steps - 1).clamp(min=0)[:, None])
        self.mask[:, self.length] = 1
        self.length += 1
        self.decoded_steps += 1
        positions = self.prompt_lens + self.decoded_steps - 1
        if self.max_position:  # finished rows kept until compaction may run past the table
            positions = positions.clamp(max=self.max_position - 1)
        return last, self.mask[:, : self.length], positions[:, None]

    # -- progress -----------------------------------------------------------------------------

    def record(self, tokens: torch.Tensor, logprobs: torch.Tensor | None) -> list[Sequence]:
        """Stores each live row's new token; returns the sequences that finished with it."""
        was_alive = self.alive.clone()
        rows = was_alive.nonzero().squeeze(1)
        self.out[rows, self.steps[rows]] = tokens[rows]
        self.steps += self.alive.long()
        self.stats.computed_rows += len(self.seqs) if self.decoded_steps else 0
        if self.output_counts is not None:
            self.output_counts[rows, tokens[rows]] += 1
            self.seen[rows, tokens[rows]] = True
        if logprobs is not None:
            self._record_logprobs(tokens, logprobs, was_alive)
        hit_stop_id = (tokens[:, None] == self.stop_ids).any(dim=1) & self.alive
        hit_length = (self.steps >= self.max_tokens) & self.alive
        done = hit_stop_id | hit_length
        stop_texts = self._check_stop_strings(was_alive)
        finished = []
        for i in (done.nonzero().squeeze(1).tolist() + list(stop_texts)):
            seq = self.seqs[i]
            if seq.is_finished:
                continue
            n = int(self.steps[i])
            seq.output_token_ids = self.out[i, :n].tolist()
            if i in stop_texts:
                at, stop = stop_texts[i]
                text = self.tokenizer.decode(seq.output_token_ids)
                seq.text = text[: at + len(stop)] if seq.params.include_stop_str_in_output else text[:at]
                seq.finish("stop", stop)
            elif bool(hit_stop_id[i]):
                last = seq.output_token_ids[-1]
                kept = seq.output_token_ids if last in self.tokenizer.eos_token_ids else seq.output_token_ids[:-1]
                seq.text = self.tokenizer.decode(kept)
                seq.finish("stop", None if last in self.tokenizer.eos_token_ids else last)
            else:
                seq.text = self.tokenizer.decode(seq.output_token_ids)
                seq.finish("length")
            self.alive[i] = False
            finished.append(seq)
        return finished

    def banned_now(self) -> torch.Tensor | None:
        """(B, V) tokens a row may not pick yet: its stop tokens before min_tokens."""
        if self.banned is None:
            return None
        return self.banned & (self.steps < self.min_tokens)[:, None]

    @property
    def done(self) -> bool:
        return not bool(self.alive.any())

    def maybe_compact(self) -> None:
        """Drops finished rows once they are at least 1/8 of the batch (the copy then pays off)."""
        dead = len(self.seqs) - int(self.alive.sum())
        if dead == 0 or dead * 8 < len(self.seqs) or self.done:
            return
        keep = self.alive.nonzero().squeeze(1)
        self.cache.select_rows(keep)
        for name in ("prompt_lens", "max_tokens", "min_tokens", "steps", "alive", "out", "mask", "stop_ids",
                     "banned", "output_counts", "seen"):
            value = getattr(self, name)
            if value is not None:
                setattr(self, name, value.index_select(0, keep))
        self.sampling = self.sampling.select(keep)
        kept = keep.tolist()
        remap = {old: new for new, old in enumerate(kept)}
        self.seqs = [self.seqs[i] for i in kept]
        self._text_rows = [remap[i] for i in self._text_rows if i in remap]
        self._logprob_rows = [remap[i] for i in self._logprob_rows if i in remap]
        self.stats.compactions += 1

    def finish_stats(self) -> BatchStats:
        self.stats.decode_steps = self.decoded_steps
        self.stats.generated_tokens = sum(s.num_output_tokens for s in self._all)
        self.stats.seconds = time.perf_counter() - self.started
        return self.stats

    # -- helpers ------------------------------------------------------------------------------

    def _stop_ids(self, seqs: list[Sequence]) -> torch.Tensor:
        lists = [sorted(set(s.params.stop_token_ids)
                        | (set() if s.params.ignore_eos else set(self.tokenizer.eos_token_ids))) for s in seqs]
        width = max(1, max(len(ids) for ids in lists))
        table = torch.full((len(seqs), width), -1, dtype=torch.int64)
        for i, ids in enumerate(lists):
            table[i, : len(ids)] = torch.tensor(ids, dtype=torch.int64)
        return table.to(self.device)

    def _banned(self, vocab_size: int) -> torch.Tensor:
        banned = torch.zeros((len(self.seqs), vocab_size + 1), dtype=torch.bool, device=self.device)
        ids = torch.where(self.stop_ids >= 0, self.stop_ids, vocab_size)  # -1 -> the spare column
        banned.scatter_(1, ids.clamp(max=vocab_size), True)
        return banned[:, :vocab_size].contiguous()

    def _check_stop_strings(self, was_alive: torch.Tensor) -> dict[int, tuple[int, str]]:
        """Rows whose text now holds one of their stop strings: {row: (char index, stop)}."""
        hits = {}
        for i in self._text_rows:
            seq = self.seqs[i]
            if not bool(was_alive[i]):
                continue
            text = self.tokenizer.decode(self.out[i, : int(self.steps[i])].tolist())
            hit = find_stop(text, seq.params.stop)
            if hit is not None:
                hits[i] = hit
        return hits

    def _record_logprobs(self, tokens: torch.Tensor, logprobs: torch.Tensor, was_alive: torch.Tensor) -> None:
        for i in self._logprob_rows:
            seq = self.seqs[i]
            if not bool(was_alive[i]):
                continue
            tok = int(tokens[i])
            entry = {tok: float(logprobs[i, tok])}
            n = seq.params.logprobs
            if n:
                top = logprobs[i].topk(n)
                entry.update(zip(top.indices.tolist(), top.values.tolist()))
            seq.logprobs = (seq.logprobs or []) + [entry]
