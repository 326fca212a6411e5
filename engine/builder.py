"""`engine.build(config)`: the engine a config names, behind the engine protocol (engine.api.protocol).

    builtin:echo      EchoEngine (engine.echo): instant answers, no model, no torch
    an encoder model  EncoderEngine (engine.encoder_engine): embed, classify, score
    any other model   LLMEngine (engine.llm_engine): generation, choice scoring, decoder pooling
"""
from __future__ import annotations

from engine.api.config import EngineConfig
from engine.api.protocol import Engine


def build(config: EngineConfig) -> Engine:
    """The engine for `config`. The echo engine's modules import no torch; the others do, on first use."""
    from engine.echo import ECHO_MODEL, EchoEngine

    if config.model == ECHO_MODEL:
        return EchoEngine(config)
    from engine.llm_engine import LLMEngine  # an encoder model's config gives an EncoderEngine

    return LLMEngine(config)
