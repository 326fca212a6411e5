"""Pooling: rows to embeddings, class probabilities and scores, with no token generated: encoders
packed without padding (encoder.py), decoders through the paged prefill (decoder.py), run.py on top."""
from engine.pooling.encoder import EncoderRunner
from engine.pooling.run import Pooler, score_pairs

__all__ = ["Pooler", "EncoderRunner", "score_pairs"]
