"""A hook for fault injection in tests: the job calls `point(name)` at named points.

Points: driver `listed` (files listed, shards not yet planned), `generated` (every shard
committed, manifest not written), `manifest` (manifest written, _SUCCESS not); worker `init`
(actor constructor), `shard` (a shard generated, its part not yet committed).

Unset, every point is a no-op. With `BATCHINFER_CHAOS_HOOK` naming a module (importable from
the process's PYTHONPATH), each point calls that module's `point(name)`. The faults themselves
live with the tests (tests/chaos/faults.py), not in the product.
"""
from __future__ import annotations

import importlib
import os

HOOK = "BATCHINFER_CHAOS_HOOK"
PREFIX = "BATCHINFER_CHAOS"
"""Variables forwarded to Ray workers: the hook and the settings of the module it names."""


def point(name: str) -> None:
    """Calls the hook module's `point(name)`, if a hook is set."""
    module = os.environ.get(HOOK)
    if module:
        importlib.import_module(module).point(name)


def forwarded_env() -> dict:
    """Environment for Ray workers, so that the hook reaches actors of an already running
    cluster: the BATCHINFER_CHAOS* variables and the PYTHONPATH the hook module is found on."""
    if not os.environ.get(HOOK):
        return {}
    return {k: v for k, v in os.environ.items() if k.startswith(PREFIX) or k == "PYTHONPATH"}
