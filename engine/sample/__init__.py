"""Turning logits into tokens and rows into outputs: the running rows' sampling table, the sampler,
logprobs, and the rules that finish a row (stop tokens and strings, length)."""
from engine.sample.running_rows import RunningRows
from engine.sample.finish import finish_rows, stop_string_hits
from engine.sample.sampler import Sampler, SamplingFlags, SamplingTensors

__all__ = ["RunningRows", "Sampler", "SamplingTensors", "SamplingFlags", "finish_rows",
           "stop_string_hits"]
