"""A row's own sampling parameters (Ray Data LLM's per-row `sampling_params`, a job's
`input.sampling_column`): checked as the spec's sampling section checks them, over the job's
sampling, and applied to that row only. A bad one is that row's error."""
from __future__ import annotations

from pydantic import ValidationError

from engine.api import check_sizes
from pipeline.spec.schema import SamplingSpec, _describe

SAMPLING_PARAMS = "sampling_params"
"""The column a processor row's preprocess sets (Ray Data LLM's name)."""


def row_sampling(value, job_sampling: SamplingSpec) -> dict:
    """The SamplingParams keyword arguments a row's `value` (a mapping of sampling fields; null
    ones count as absent, as Arrow fills a struct's missing keys) overrides, after the whole
    section, the job's sampling with them, passes the spec's checks. ValueError naming the key."""
    if value is None:
        return {}
    if not isinstance(value, dict):
        raise ValueError(f"{SAMPLING_PARAMS} must be a mapping of sampling fields, got {type(value).__name__}")
    try:
        check_sizes(value)  # before anything converts a million keys
    except ValueError as exc:
        raise ValueError(f"{SAMPLING_PARAMS}.{exc}") from None
    given = {k: _present(v) for k, v in value.items() if v is not None}
    if "prompt_logprobs" in given and job_sampling.prompt_logprobs is None:
        # the output's columns are the job's: a row may change the number, not add the column
        raise ValueError(f"{SAMPLING_PARAMS}.prompt_logprobs: the job's sampling sets no prompt_logprobs, so its "
                         "output has no prompt_logprobs column; set sampling.prompt_logprobs for the job")
    so = given.get("structured_outputs")
    if isinstance(so, dict) and isinstance(so.get("json"), str):
        raise ValueError(f"{SAMPLING_PARAMS}.structured_outputs.json: a row gives the schema itself, not a file")
    try:
        checked = SamplingSpec.model_validate({**job_sampling.model_dump(exclude_none=True), **given})
    except ValidationError as exc:
        raise ValueError("; ".join(f"{SAMPLING_PARAMS}{'.' if e['loc'] else ': '}{_describe(e)}"
                                   for e in exc.errors())) from None
    out = {k: getattr(checked, k) for k in given}
    if "structured_outputs" in out:
        out["structured_outputs"] = checked.structured_outputs.params() if checked.structured_outputs else None
    return out


def _present(value):
    """`value` without the null entries of its mappings, at every depth. Arrow gives every row of a
    batch the union of the keys its rows' structs have, null where a row has none: two rows'
    logit_bias {"5": 1} and {"7": 2} arrive as {"5": 1, "7": None} and {"5": None, "7": 2}."""
    if isinstance(value, dict):
        return {k: _present(v) for k, v in value.items() if v is not None}
    if isinstance(value, list):
        return [_present(v) for v in value]
    return value
