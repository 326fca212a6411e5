"""The engines behind the protocol (engine.api.Engine), as engine.build gives them: the generation,
encoder and echo engines each answer every protocol call, state their facts, and refuse what they
cannot run in one line (refusal) before anything runs."""
from __future__ import annotations

import pytest

import engine
from engine.api import TASKS, EngineFacts, ModelLoadError


def _engines(tmp_path):
    from pooling_models import build_encoder

    return {"generation": engine.build(engine.EngineConfig(model="builtin:tiny", max_batch_tokens=512)),
            "encoder": engine.build(engine.EngineConfig(model=str(build_encoder(tmp_path / "bert")))),
            "echo": engine.build(engine.EngineConfig(model="builtin:echo"))}


def test_the_builder_gives_each_kind_and_each_answers_the_protocol(tmp_path):
    built = _engines(tmp_path)
    assert {k: type(e).__name__ for k, e in built.items()} == {
        "generation": "LLMEngine", "encoder": "EncoderEngine", "echo": "EchoEngine"}
    # a decoder LM pools too (last token), and scores by cosine; no classification head on either
    can = {"generation": {"generate", "score_choices", "step", "embed", "score"}, "encoder": {"embed", "score"},
           "echo": {"generate", "score_choices"}}
    for kind, eng in built.items():
        facts = eng.facts()
        assert isinstance(facts, EngineFacts) and facts.kind == kind and facts.max_model_len > 0
        assert (facts.record() is None) == (kind == "echo")
        assert {t for t in TASKS if eng.refusal(t) is None} == can[kind], kind
        for task in ("embed", "classify", "score", "generate"):
            reason = eng.refusal(task)
            if reason is None:
                continue
            assert "\n" not in reason and len(reason) < 300
            with pytest.raises(ModelLoadError):
                if task == "score":
                    eng.score(["a"], ["b"])
                else:
                    getattr(eng, task)(["a"])
        assert eng.model_identity()["kind"]
        ids = eng.encode_chat([{"role": "user", "content": "hi"}]) if kind != "encoder" else None
        assert ids is None or (isinstance(ids, list) and all(isinstance(t, int) for t in ids))
        eng.close()
        eng.close()  # idempotent


def test_an_encoder_config_through_llm_engine_still_gives_the_encoder_engine(tmp_path):
    """LLMEngine(config) stays the public face for every model, as before the split."""
    from pooling_models import build_encoder

    llm = engine.LLMEngine(engine.EngineConfig(model=str(build_encoder(tmp_path / "bert"))))
    assert type(llm).__name__ == "EncoderEngine"
    (out,) = llm.embed(["hello world"])
    assert out.error is None and len(out.embedding) == llm.facts().embedding_width
