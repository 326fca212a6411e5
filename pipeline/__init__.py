"""Ray Data stages of a job, and `build_processor` for Datasets built elsewhere.

Packages, by the question each answers; imports run one way, spec <- {io, tasks} <- run <-
processor, and io and tasks never import each other:
    spec/       what a job is (schema, Job, output columns, metric names)
    io/         where rows live (storage, inputs, the output directory's layout, index, lock)
    tasks/      what a row becomes (prompts, generate / label / eval, OpenAI Batch lines)
    run/        how a job runs (driver, planning, dataflow, engine actors, reports); Ray
    processor   the job's engine stage over any ray.data.Dataset
    errors      every job-level exception
"""


def __getattr__(name: str):
    # `from pipeline import build_processor` without importing the engine for every pipeline module
    if name == "build_processor":
        from pipeline.processor import build_processor

        return build_processor
    raise AttributeError(f"module 'pipeline' has no attribute {name!r}")


__all__ = ["build_processor"]
