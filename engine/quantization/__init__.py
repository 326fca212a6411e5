"""Quantized weights: which method a model runs with (configured, or its checkpoint's own), and the
linear layers that hold int8 or fp8 weights with their scales."""
from engine.quantization.methods import (METHODS, Fp8Linear, Int8Linear, check_method, checkpoint_method,
                                         quantize_model, resolve_method, weights_nbytes)

__all__ = ["METHODS", "Int8Linear", "Fp8Linear", "checkpoint_method", "resolve_method", "check_method",
           "quantize_model", "weights_nbytes"]
