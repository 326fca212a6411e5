"""When a row is done and what it says: stop strings, finish reasons, the final text."""
from __future__ import annotations

from engine.core.sequence import Sequence
from engine.models.tokenizer import Tokenizer, find_stop


def stop_string_hits(tokenizer: Tokenizer, rows: list[tuple[int, Sequence]]) -> set[int]:
    """Keys of the rows whose latest tokens complete one of their stop strings (one decode
    call for all). `rows`: (key, sequence) of rows with stop strings that may stop now. A row
    whose window still reaches into its first min_tokens tokens is checked on its whole output
    instead: a stop string held back there is no hit now."""
    if not rows:
        return set()
    near = [(key, s) for key, s in rows
            if s.params.min_tokens and s.num_output_tokens <= s.params.min_tokens + s.stop_checker.window]
    near_keys = {key for key, _ in near}
    far = [(key, s) for key, s in rows if key not in near_keys]
    texts = tokenizer.decode_windows([s.output_token_ids[-s.stop_checker.window:] for _, s in far])
    hits = {key for (key, s), text in zip(far, texts) if s.stop_checker.found(text)}
    if near:
        whole = tokenizer.decode_batch([s.output_token_ids for _, s in near])
        hits |= {key for (key, s), text in zip(near, whole)
                 if find_stop(text, s.params.stop, _held_back(tokenizer, s)) is not None}
    return hits


def is_stop_id(tokenizer: Tokenizer, seq: Sequence, token: int) -> bool:
    return token in seq.params.stop_token_ids or (token in tokenizer.eos_token_ids and not seq.params.ignore_eos)


def finish_rows(tokenizer: Tokenizer, seqs: list[Sequence], now: float) -> None:
    """Finish reason and text of each finished row; their texts decoded in one call."""
    outs = [s.output_token_ids for s in seqs]
    # a stop token that is not EOS stays in token_ids but not in the text
    keep_last = [not is_stop_id(tokenizer, s, out[-1]) or (out[-1] in tokenizer.eos_token_ids
                                                           and not s.params.ignore_eos)
                 for s, out in zip(seqs, outs)]
    texts = tokenizer.decode_batch([out if keep else out[:-1] for out, keep in zip(outs, keep_last)])
    for i, seq in enumerate(seqs):  # rows that keep special tokens in their text
        if not seq.params.skip_special_tokens:
            texts[i] = _decode(tokenizer, seq, outs[i] if keep_last[i] else outs[i][:-1])
    for seq, out, keep, text in zip(seqs, outs, keep_last, texts):
        held = _held_back(tokenizer, seq)
        hit = find_stop(text, seq.params.stop, held) if seq.params.stop else None
        if hit is not None:
            if not keep:  # the stop string counts from the whole output
                text = _decode(tokenizer, seq, out)
                hit = find_stop(text, seq.params.stop, held) or hit
            at, stop = hit
            seq.text = text[: at + len(stop)] if seq.params.include_stop_str_in_output else text[:at]
            seq.finish("stop", stop)
        elif is_stop_id(tokenizer, seq, out[-1]):
            seq.text = text
            seq.finish("stop", None if keep else out[-1])
        else:
            seq.text = text
            seq.finish("length")
        seq.stop_checker = None
        seq.finish_time = now


def _held_back(tokenizer: Tokenizer, seq: Sequence) -> int:
    """Characters of the text that the first min_tokens tokens make: a stop string that ends
    within them does not count (min_tokens holds back stop strings as it holds back EOS)."""
    if not seq.params.min_tokens or not seq.params.stop:
        return 0
    return len(tokenizer.decode(seq.output_token_ids[: seq.params.min_tokens]))


def _decode(tokenizer: Tokenizer, seq: Sequence, token_ids: list[int]) -> str:
    p = seq.params
    return tokenizer.decode_as(token_ids, p.skip_special_tokens, p.spaces_between_special_tokens)
