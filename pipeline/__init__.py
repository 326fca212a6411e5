"""Ray Data stages of a job, and `build_processor` for Datasets built elsewhere."""


def __getattr__(name: str):
    # `from pipeline import build_processor` without importing the engine for every pipeline module
    if name == "build_processor":
        from pipeline.processor import build_processor

        return build_processor
    raise AttributeError(f"module 'pipeline' has no attribute {name!r}")


__all__ = ["build_processor"]
