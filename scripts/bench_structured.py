#!/usr/bin/env python
"""Cost of constraints (issue 22): time per generated token of rows under a JSON Schema against
the same rows unconstrained, on a random Llama with the real 32k SentencePiece vocabulary that
mistral-common ships (tests/engine/real_vocab.py).

64 rows under a 3-field schema (an enum, a bounded integer, a bounded string) decode greedily;
then the same prompts run unconstrained, each row held to exactly the length its constrained
twin generated (ignore_eos), so both runs do the same forward passes on the same batch shapes and
differ only by the grammar work (bitmask fill per row on the host, mask applied to the logits).
The grammar is compiled before the timed runs (once per engine; its time is printed apart), and
each figure is the fastest of `--repeats` interleaved runs. The constrained runs include the check
of every finished output against its schema (issue 33); its own cost is timed apart too (the
check of all the rows' outputs, per generated token). Each backend runs the same rows.
Target: ratio <= 1.25, check included.

`--corpus` instead runs the tests' corpus (51 public schemas of tests/engine/data/schemas and the
schemas of issue 33's findings) under each backend, greedy and seeded, one row per schema, and
counts what runs, what is refused, what stops, what the check flags, and what fails its schema
without an error (target: 0, and >= 95% of schemas run).

    PYTHONPATH=$PWD .venv/bin/python scripts/bench_structured.py [--rows 64] [--repeats 3]
        [--modes static,continuous] [--backends xgrammar,guidance] [--hidden 64] [--layers 2] [--threads 2]
    PYTHONPATH=$PWD .venv/bin/python scripts/bench_structured.py --corpus [--backends auto,xgrammar,guidance]
"""
from __future__ import annotations

import argparse
import sys
import tempfile
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tests" / "engine"))

from engine import EngineConfig, LLMEngine, SamplingParams, StructuredOutputsParams  # noqa: E402
from real_vocab import build_real_vocab_model  # noqa: E402

SCHEMA = {"type": "object", "properties": {"sentiment": {"enum": ["positive", "negative", "neutral"]},
                                           "score": {"type": "integer", "minimum": 1, "maximum": 5},
                                           "summary": {"type": "string", "maxLength": 24}},
          "required": ["sentiment", "score", "summary"], "additionalProperties": False}


def one_mode(model: Path, mode: str, rows: int, repeats: int, backend: str) -> dict:
    llm = LLMEngine(EngineConfig(model=str(model), max_num_seqs=rows, scheduling=mode,
                                 structured_outputs_backend=backend))
    prompts = [f"Review {i}: {'the parcel came late, but the product ' * (1 + i % 3)}works. Label it as JSON:"
               for i in range(rows)]
    start = time.perf_counter()
    compiled = llm.grammar.compile(StructuredOutputsParams(json=SCHEMA))
    compile_s = time.perf_counter() - start
    llm.generate(prompts[:4], SamplingParams(max_tokens=8, temperature=0))  # warm-up: kernels, allocation
    constrained = [SamplingParams(max_tokens=256, temperature=0, structured_outputs={"json": SCHEMA})] * rows
    outs = llm.generate(prompts, constrained)
    lengths = [len(o.token_ids) for o in outs]
    plain = [SamplingParams(max_tokens=n, temperature=0, ignore_eos=True) for n in lengths]
    timed = {"constrained": [], "plain": []}
    for _ in range(repeats):
        for name, params in (("constrained", constrained), ("plain", plain)):
            start = time.perf_counter()
            got = llm.generate(prompts, params)
            seconds = time.perf_counter() - start
            assert [len(o.token_ids) for o in got] == lengths, "the runs must generate the same tokens per row"
            timed[name].append(seconds / sum(lengths))
    # the fastest of the interleaved repeats: on a shared machine, other load only ever adds time
    per_token = {k: min(v) for k, v in timed.items()}
    stopped = sum(o.finish_reason == "stop" for o in outs)
    start = time.perf_counter()
    for _ in range(repeats):
        violations = [compiled.check.violation(o.text, True) for o in outs]
    check_s = (time.perf_counter() - start) / repeats
    return {"mode": mode, "backend": compiled.route.backend, "rows": rows, "tokens": sum(lengths), "stopped": stopped,
            "compile_s": compile_s, "constrained_ms": 1e3 * per_token["constrained"], "plain_ms": 1e3 * per_token["plain"],
            "ratio": per_token["constrained"] / per_token["plain"], "check_ms": 1e3 * check_s / sum(lengths),
            "flagged": sum(v is not None for v in violations)}


def corpus(model: Path, backends: list[str]) -> None:
    """The corpus under each backend (see the module's docstring)."""
    import json

    import jsonschema
    from schemas import FINDINGS, real_world_schemas

    schemas = real_world_schemas() | {f"finding: {k}": v for k, v in FINDINGS.items()}
    names = list(schemas)
    print(f"{len(names)} schemas, one row each, max_tokens 192")
    print("| backend | sampling | run | refused | stopped | flagged by the check | invalid without an error |")
    print("|---|---|---|---|---|---|---|")
    for backend in backends:
        llm = LLMEngine(EngineConfig(model=str(model), max_num_seqs=64, structured_outputs_backend=backend))
        for label, temperature in (("greedy", 0.0), ("seeded", 1.0)):
            outs = llm.generate([f"Fill in record {i} as JSON." for i in range(len(names))],
                                [SamplingParams(max_tokens=192, temperature=temperature, seed=i,
                                                structured_outputs={"json": schemas[n]}) for i, n in enumerate(names)])
            refused = sum(o.finish_reason == "error" for o in outs)
            stopped = [(n, o) for n, o in zip(names, outs) if o.finish_reason == "stop"]
            silent = 0
            for n, o in stopped:
                if o.error is None:
                    cls = jsonschema.validators.validator_for(schemas[n], default=jsonschema.Draft202012Validator)
                    silent += any(True for _ in cls(schemas[n], format_checker=cls.FORMAT_CHECKER).iter_errors(
                        json.loads(o.text)))
            print(f"| {backend} | {label} | {len(names) - refused} | {refused} | {len(stopped)} | "
                  f"{sum(o.error is not None for _, o in stopped)} | {silent} |", flush=True)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rows", type=int, default=64)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--modes", default="static,continuous")
    ap.add_argument("--backends", default="xgrammar,guidance")
    ap.add_argument("--hidden", type=int, default=64)
    ap.add_argument("--layers", type=int, default=2)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--corpus", action="store_true", help="count outcomes over the tests' schema corpus instead")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    with tempfile.TemporaryDirectory() as tmp:
        model = build_real_vocab_model(Path(tmp), hidden=args.hidden, layers=args.layers)
        if args.corpus:
            return corpus(model, args.backends.split(","))
        print(f"random Llama, hidden {args.hidden}, {args.layers} layers, 32,000-token SentencePiece vocabulary; "
              f"{args.rows} rows, 3-field schema, greedy, fastest of {args.repeats} interleaved runs")
        print("| backend | mode | tokens | stopped | ms/token constrained | ms/token plain | ratio | "
              "check ms/token | flagged | compile |")
        print("|---|---|---|---|---|---|---|---|---|---|")
        for backend in args.backends.split(","):
            for mode in args.modes.split(","):
                r = one_mode(model, mode, args.rows, args.repeats, backend)
                print(f"| {r['backend']} | {r['mode']} | {r['tokens']} | {r['stopped']}/{r['rows']} | "
                      f"{r['constrained_ms']:.3f} | {r['plain_ms']:.3f} | {r['ratio']:.2f}x | {r['check_ms']:.4f} | "
                      f"{r['flagged']} | {r['compile_s']:.2f} s |", flush=True)


if __name__ == "__main__":
    main()
