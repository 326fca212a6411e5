"""One forward pass's inputs as host arrays (PassInputs): pool slots, block tables, positions, the
tokens whose logits are kept, LongRoPE flags, LoRA slots, image placeholders and M-RoPE positions.
Rank 0 builds it and sends it to every other rank."""
from __future__ import annotations

from dataclasses import dataclass
from itertools import chain

import numpy as np
import torch

from engine.core.scheduler import ScheduledChunk
from engine.runner.attention import CHUNK_MIN_TOKENS


def build_inputs(chunks: list[ScheduledChunk], block_size: int, keep: list[int] | None = None,
                 all_logits: bool = False, longrope=None) -> PassInputs:
    """The inputs of a pass over `chunks` (logits kept at each sampling chunk's last token, at
    token indices `keep`, or at every token with all_logits)."""
    n = len(chunks)
    counts = np.fromiter((c.count for c in chunks), dtype=np.int64, count=n)
    starts = np.fromiter((c.start for c in chunks), dtype=np.int64, count=n)
    ids = [c.seq.block_ids for c in chunks]
    lens = np.fromiter(map(len, ids), dtype=np.int64, count=n)
    tables = np.zeros((n, int(lens.max())), dtype=np.int32)
    # the ragged block tables in one fill (a row assignment each costs more at hundreds of rows)
    tables[np.arange(tables.shape[1]) < lens[:, None]] = np.fromiter(chain.from_iterable(ids), dtype=np.int32,
                                                                     count=int(lens.sum()))
    tokens = [t for c in chunks for t in c.seq.tokens_at(c.start, c.start + c.count)]
    rows = np.repeat(np.arange(n), counts)
    first = np.cumsum(counts) - counts  # each chunk's first token in the pass
    positions = np.repeat(starts - first, counts) + np.arange(len(rows))
    slots = tables[rows, positions // block_size].astype(np.int64) * block_size + positions % block_size
    long = counts >= CHUNK_MIN_TOKENS
    spans = [(int(first[r]), int(first[r] + counts[r]), r, int(starts[r])) for r in np.flatnonzero(long).tolist()]
    if keep is None and not all_logits:
        ends = np.cumsum(counts) - 1
        keep = [int(e) for e, c in zip(ends, chunks) if c.samples]
    long_tokens = None
    if longrope is not None:
        # a prompt token is long when the whole prompt is, a generated one when its row was
        # then (position + 1 tokens): also when a preempted row recomputes them all at once
        prompt = np.repeat([c.seq.num_prompt_tokens for c in chunks], counts)
        flags = np.maximum(prompt, positions + 1) > longrope.original
        long_tokens = flags if flags.any() else None
    lora_slots = None
    if any(c.seq.lora_slot is not None for c in chunks):
        lora_slots = np.repeat([-1 if c.seq.lora_slot is None else c.seq.lora_slot for c in chunks], counts)
    images = [(int(first[r] + at - c.start), count, offset, span) for r, c in enumerate(chunks)
              for span in c.seq.images for at, count, offset in span.pieces(c.start, c.start + c.count)]
    return PassInputs(slots=slots, tables=tables, rows=rows.astype(np.int32), ctx=(positions + 1).astype(np.int32),
                      max_ctx=int((starts + counts).max()),
                      small=np.flatnonzero(np.repeat(~long, counts)) if spans else None, spans=spans,
                      tokens=tokens, positions=positions, keep=None if all_logits else keep,
                      long_tokens=long_tokens, lora_slots=lora_slots, images=images or None,
                      rope=rope_positions(chunks, positions, first, counts))


def rope_positions(chunks: list[ScheduledChunk], positions: np.ndarray, first, counts) -> np.ndarray | None:
    """(3, T) M-RoPE positions where a row's images have them (engine.multimodal: Qwen2.5-VL):
    an image's placeholders its own, the text after an image its index plus that image's shift;
    None where every position is the token's index."""
    if not any(span.rope is not None for c in chunks for span in c.seq.images):
        return None
    rope = np.repeat(positions[None], 3, axis=0)
    for r, c in enumerate(chunks):
        lo, hi = int(first[r]), int(first[r] + counts[r])
        row, index, shift = rope[:, lo:hi], positions[lo:hi], 0
        for span in c.seq.images:  # in prompt order
            if span.rope is None:
                continue
            row[:, index >= span.end] += span.rope_shift - shift
            shift = span.rope_shift
            for at, count, offset in span.pieces(c.start, c.start + c.count):
                row[:, at - c.start:at - c.start + count] = span.rope[:, offset:offset + count]
    return rope


@dataclass
class PassInputs:
    """One forward pass as host arrays: what rank 0 sends every other rank (pickled)."""

    slots: np.ndarray
    """(T,) int64: pool slot of each token's keys and values."""
    tables: np.ndarray
    """(R, max_blocks) int32: each row's blocks."""
    rows: np.ndarray
    """(T,) int32: the row of each token."""
    ctx: np.ndarray
    """(T,) int32: positions each token attends to."""
    max_ctx: int
    """Largest ctx."""
    small: np.ndarray | None
    """Tokens of the per-token attention path; None = all."""
    spans: list
    """(first token, end, row, start position) of each long chunk."""
    tokens: list[int]
    """(T,) input token ids."""
    positions: np.ndarray
    """(T,) int64: each token's position in its row."""
    keep: list[int] | None
    """Token indices whose logits are returned; None = all of them."""
    long_tokens: np.ndarray | None
    """(T,) bool: tokens past LongRoPE's original length (None: none, or no LongRoPE)."""
    lora_slots: np.ndarray | None = None
    """(T,) int: each token's LoRA adapter slot, -1 for the base model (None: no adapter in the pass)."""
    images: list | None = None
    """(pass token index, count, offset in the image's embeddings, ImageSpan) of each run of image
    placeholder tokens the pass computes (None: none)."""
    rope: np.ndarray | None = None
    """(3, T) int64 M-RoPE positions (rope_positions), or None: `positions` are the model's."""

    def position_ids(self, device) -> torch.Tensor:
        """The model's position_ids: (1, T), or (3, 1, T) with M-RoPE positions."""
        if self.rope is not None:
            return torch.from_numpy(self.rope[:, None]).to(device)
        return torch.from_numpy(self.positions[None]).to(device)
