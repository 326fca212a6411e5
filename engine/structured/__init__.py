"""Structured outputs: constraints routed to xgrammar or llguidance, one token bitmask per step,
and every finished constrained output checked against its constraint."""
from engine.structured.bitmask import apply_bitmask
from engine.structured.check import OutputCheck
from engine.structured.grammar import COMPILE_TIMEOUT_S, GrammarBackend, one_line_cause
from engine.structured.keywords import BACKENDS, LOOSE, Route, route, schema_features

__all__ = ["BACKENDS", "COMPILE_TIMEOUT_S", "GrammarBackend", "LOOSE", "OutputCheck", "Route", "apply_bitmask",
           "one_line_cause", "route", "schema_features"]
