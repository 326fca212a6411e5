"""Quantized weights: which method a model runs with (configured, or its checkpoint's own), the
linear layers that hold int8, int4 or fp8 weights, and loading a model quantized as it is read."""
from engine.quantization.methods import (METHODS, Fp8Linear, Int8Linear, check_method, checkpoint_method,
                                         quantize_model, resolve_method, weights_nbytes)
from engine.quantization.int4 import Int4Linear
from engine.quantization.streaming import SafetensorsFiles, load_quantized

__all__ = ["METHODS", "Int8Linear", "Int4Linear", "SafetensorsFiles", "load_quantized", "Fp8Linear", "checkpoint_method", "resolve_method", "check_method",
           "quantize_model", "weights_nbytes"]
