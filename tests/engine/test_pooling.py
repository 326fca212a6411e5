"""embed / classify / score against the references users trust: sentence-transformers'
encode and CrossEncoder.predict, and transformers' sequence classifiers plus softmax (fp32, rows
of 1 to 512 tokens, in passes of different compositions)."""
from __future__ import annotations

import numpy as np
import pytest
import torch
from transformers import AutoModelForSequenceClassification, AutoTokenizer

from engine import ClassificationOutput, EngineConfig, LLMEngine, ModelLoadError, PoolingParams
from pooling_models import (build_classifier, build_decoder_embedder, build_encoder, build_sentence_transformer,
                            set_config, texts)

st = pytest.importorskip("sentence_transformers")
TEXTS = texts(44, seed=1, lo=1, hi=500) + ["a", "the", "a b", "x y z"]
BUDGETS = (600, 8192)
"""Tokens per pass: long rows one or two to a pass, or many rows in one."""


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    root = tmp_path_factory.mktemp("pooling")
    bert = build_encoder(root / "bert", "bert")
    qwen3 = build_decoder_embedder(root / "qwen3")
    return {
        "mean": build_sentence_transformer(root / "st_mean", bert, "mean", normalize=True),
        "cls": build_sentence_transformer(root / "st_cls", bert, "cls", normalize=False),
        "qwen3": build_sentence_transformer(root / "st_qwen3", qwen3, "lasttoken", normalize=True),
        "bert_cls": build_classifier(root / "bert_cls", "bert"),
        "qwen2_cls": build_classifier(root / "qwen2_cls", "qwen2"),
        "cross": build_classifier(root / "cross", "bert", num_labels=1),
        "bert": bert,
    }


def cosines(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    return (a * b).sum(1) / np.linalg.norm(a, axis=1) / np.linalg.norm(b, axis=1)


@pytest.mark.parametrize("name", ["mean", "cls", "qwen3"])
def test_embeddings_match_sentence_transformers(models, name):
    ref = st.SentenceTransformer(str(models[name]), device="cpu").encode(TEXTS, batch_size=8)
    for budget in BUDGETS:
        llm = LLMEngine(EngineConfig(model=str(models[name]), max_num_batched_tokens=budget))
        out = llm.embed(TEXTS)
        assert [o.error for o in out] == [None] * len(TEXTS)
        got = np.array([o.embedding for o in out])
        assert got.shape == ref.shape
        assert cosines(got, ref).min() >= 0.99999, (name, budget)
        stats = llm.batch_stats[-1]
        assert stats.rows == len(TEXTS) and stats.padded_prompt_tokens == stats.prompt_tokens
        assert max(o.num_prompt_tokens for o in out) > 400 and min(o.num_prompt_tokens for o in out) <= 5
    if name != "cls":
        assert np.allclose(np.linalg.norm(got, axis=1), 1.0, atol=1e-5)  # the Normalize module


def test_one_token_rows_and_token_id_prompts(models):
    llm = LLMEngine(EngineConfig(model=str(models["mean"])))
    model = st.SentenceTransformer(str(models["mean"]), device="cpu")
    ids = model.tokenizer("a b c")["input_ids"]
    out = llm.embed([[ids[1]], ids, "a b c"])
    assert out[0].num_prompt_tokens == 1 and out[0].error is None
    assert np.allclose(out[1].embedding, out[2].embedding, atol=1e-6)
    assert cosines(np.array([out[2].embedding]), model.encode(["a b c"])).min() >= 0.99999


@pytest.mark.parametrize("name", ["bert_cls", "qwen2_cls"])
def test_classify_matches_transformers_softmax(models, name):
    path = models[name]
    ref_model = AutoModelForSequenceClassification.from_pretrained(path).eval()
    tok = AutoTokenizer.from_pretrained(path)
    rows = TEXTS[:24]
    for budget in BUDGETS:
        out = LLMEngine(EngineConfig(model=str(path), max_num_batched_tokens=budget)).classify(rows)
        for text, o in zip(rows, out):
            assert isinstance(o, ClassificationOutput) and o.error is None
            with torch.no_grad():
                probs = torch.softmax(ref_model(**tok(text, return_tensors="pt")).logits[0], -1)
            assert np.abs(np.array(o.probs) - probs.numpy()).max() <= 1e-5
            assert o.label == ref_model.config.id2label[int(probs.argmax())]


def test_score_matches_cross_encoder(models):
    queries, docs = texts(20, seed=2, lo=1, hi=60), texts(20, seed=3, lo=1, hi=400)
    ref = st.CrossEncoder(str(models["cross"]), device="cpu").predict(list(zip(queries, docs)))
    for budget in BUDGETS:
        llm = LLMEngine(EngineConfig(model=str(models["cross"]), max_num_batched_tokens=budget))
        out = llm.score(queries, docs)
        assert np.abs(np.array([o.score for o in out]) - ref).max() <= 1e-5
    one = llm.score(queries[0], docs[:3])  # one text_1 against several
    assert np.allclose([o.score for o in one], ref[:1].tolist() + [o.score for o in llm.score([queries[0]] * 2,
                                                                                            docs[1:3])], atol=1e-6)


def test_score_with_an_embedding_model_is_the_cosine(models):
    llm = LLMEngine(EngineConfig(model=str(models["mean"])))
    a, b = llm.embed(["the cat", "a dog"])
    (s,) = llm.score("the cat", ["a dog"])
    assert s.score == pytest.approx(float(np.dot(a.embedding, b.embedding)), abs=1e-5)


def test_bad_rows_fail_alone(models):
    llm = LLMEngine(EngineConfig(model=str(models["mean"])))
    long = " ".join(["a"] * 600)
    out = llm.embed(["fine", "", long, [10 ** 6], "also fine"])
    assert [o.error is None for o in out] == [True, False, False, False, True]
    assert "empty" in out[1].error and "limit of 512" in out[2].error and "vocabulary" in out[3].error
    kept = llm.embed([long], PoolingParams(truncate_prompt_tokens=100))[0]
    assert kept.error is None and kept.num_prompt_tokens == 100
    with pytest.raises(ValueError, match="same length"):
        llm.score(["a", "b"], ["c"])
    assert "not a Matryoshka model" in llm.embed(["x"], PoolingParams(dimensions=8))[0].error
    assert "exceeds the model's embedding width" in llm.embed(["x"], PoolingParams(dimensions=999))[0].error


def test_matryoshka_dimensions_cut_then_normalise(tmp_path, models):
    import shutil

    path = tmp_path / "m"
    shutil.copytree(models["mean"], path)
    set_config(path, matryoshka_dimensions=[8, 16])
    llm = LLMEngine(EngineConfig(model=str(path)))
    full = np.array(llm.embed(["the cat sat"], PoolingParams(normalize=False))[0].embedding)
    cut = np.array(llm.embed(["the cat sat"], PoolingParams(dimensions=8))[0].embedding)
    assert cut.shape == (8,) and np.allclose(cut, full[:8] / np.linalg.norm(full[:8]), atol=1e-6)
    assert "matryoshka_dimensions" in llm.embed(["x"], PoolingParams(dimensions=12))[0].error


def test_pooling_config_overrides_the_model(models):
    mean = LLMEngine(EngineConfig(model=str(models["bert"]), pooling={"pooling_type": "MEAN", "normalize": True}))
    ref = st.SentenceTransformer(str(models["mean"]), device="cpu").encode(TEXTS[:8])
    got = np.array([o.embedding for o in mean.embed(TEXTS[:8])])
    assert cosines(got, ref).min() >= 0.99999


def test_a_model_that_cannot_do_the_task_is_refused_in_one_line(models):
    with pytest.raises(ModelLoadError, match="^classify: .* has no classification head"):
        LLMEngine(EngineConfig(model=str(models["mean"]))).classify(["x"])
    with pytest.raises(ModelLoadError, match="^embed: .* is a classifier with 3 labels"):
        LLMEngine(EngineConfig(model=str(models["bert_cls"]))).embed(["x"])
    with pytest.raises(ModelLoadError, match="^generate: .* has no language-model head"):
        LLMEngine(EngineConfig(model=str(models["mean"]))).generate(["x"])
    with pytest.raises(ModelLoadError, match="^score: .* has 3 labels"):
        LLMEngine(EngineConfig(model=str(models["qwen2_cls"]))).score("a", ["b"])


@pytest.mark.parametrize("name", ["bert_cls", "qwen2_cls"])
def test_a_classifier_whose_checkpoint_lacks_its_head_is_refused_at_load(models, tmp_path, name):
    import shutil

    from safetensors.torch import load_file, save_file

    headless = tmp_path / "headless"
    shutil.copytree(models[name], headless)
    tensors = load_file(headless / "model.safetensors")
    head = [k for k in tensors if k.startswith(("classifier.", "score."))]
    assert head
    save_file({k: v for k, v in tensors.items() if k not in head}, headless / "model.safetensors",
              metadata={"format": "pt"})
    with pytest.raises(ModelLoadError) as refused:  # it loaded before, and classify gave random probabilities
        LLMEngine(EngineConfig(model=str(headless))).classify(["x"])
    assert f"the checkpoint misses {head[0]}" in str(refused.value) and "they would be random" in str(refused.value)


def test_a_pooling_decoder_keeps_no_kv(models):
    llm = LLMEngine(EngineConfig(model=str(models["qwen3"]), max_num_batched_tokens=256))
    llm.embed(TEXTS[:6])
    assert llm.pool.num_used == 0  # every block given back, nothing named
    assert llm.pool_tokens <= (1024 + 64 * 16)  # one pass's rows, not a generation pool


def test_pooling_params_are_checked():
    with pytest.raises(ValueError, match="dimensions"):
        PoolingParams(dimensions=0)
    with pytest.raises(ValueError, match="normalize"):
        PoolingParams(normalize="yes")
    with pytest.raises(ValueError, match="pooling_type"):
        EngineConfig(pooling={"pooling_type": "median"})


def test_a_dense_module_after_pooling(tmp_path, models):
    from sentence_transformers import SentenceTransformer
    from sentence_transformers import models as st_models

    from pooling_models import write_tokenizer

    transformer = st_models.Transformer(str(models["bert"]))
    model = SentenceTransformer(modules=[transformer, st_models.Pooling(32, pooling_mode="mean"),
                                         st_models.Dense(32, 16, activation_function=torch.nn.Tanh()),
                                         st_models.Normalize()], device="cpu")
    model.save(str(tmp_path / "dense"))
    write_tokenizer(tmp_path / "dense")
    ref = SentenceTransformer(str(tmp_path / "dense"), device="cpu").encode(TEXTS[:12])
    got = np.array([o.embedding for o in LLMEngine(EngineConfig(model=str(tmp_path / "dense"))).embed(TEXTS[:12])])
    assert got.shape == (12, 16) and cosines(got, ref).min() >= 0.99999


@pytest.mark.parametrize("kind,pooling", [("roberta", "mean"), ("xlm-roberta", "cls"), ("modernbert", "mean")])
def test_other_encoders_match_sentence_transformers(tmp_path, kind, pooling):
    """RoBERTa's positions after its padding index; ModernBERT's local layers attend within their window."""
    path = build_sentence_transformer(tmp_path / "st", build_encoder(tmp_path / "base", kind), pooling)
    ref = st.SentenceTransformer(str(path), device="cpu").encode(TEXTS, batch_size=8)
    got = np.array([o.embedding for o in LLMEngine(EngineConfig(model=str(path), max_num_batched_tokens=1500))
                    .embed(TEXTS)])
    assert cosines(got, ref).min() >= 0.99999


@pytest.mark.parametrize("kind,extra", [("modernbert", {}), ("modernbert", {"classifier_pooling": "mean"}),
                                        ("xlm-roberta", {}), ("qwen3", {})])
def test_other_classifiers_match_transformers(tmp_path, kind, extra):
    """Each family's own head: ModernBERT's CLS or mean pooling, RoBERTa's head on token 0, a decoder's last token."""
    path = build_classifier(tmp_path / "c", kind)
    if extra:
        set_config(path, **extra)
    ref_model = AutoModelForSequenceClassification.from_pretrained(path).eval()
    tok = AutoTokenizer.from_pretrained(path)
    rows = TEXTS[:8] + TEXTS[-4:]
    for text, o in zip(rows, LLMEngine(EngineConfig(model=str(path))).classify(rows)):
        with torch.no_grad():
            probs = torch.softmax(ref_model(**tok(text, return_tensors="pt")).logits[0], -1)
        assert np.abs(np.array(o.probs) - probs.numpy()).max() <= 1e-5


def test_the_vllm_face_embeds_classifies_and_scores_as_the_engine_does(models):
    """engine.LLM's embed, classify and score take texts, token-id lists and vLLM's prompt dicts,
    and give the engine's results with each row's prompt_token_ids."""
    from engine import LLM

    pair = ["the cat", "a dog"]
    llm = LLM(str(models["mean"]))
    want = llm.llm_engine.embed(pair)
    outs = llm.embed([pair[0], {"prompt": pair[1]}])
    assert [o.outputs.embedding for o in outs] == [w.embedding for w in want]
    assert outs[0].prompt_token_ids == llm.get_tokenizer()(pair[0])["input_ids"]
    (by_ids,) = llm.embed({"prompt_token_ids": outs[1].prompt_token_ids})
    assert np.allclose(by_ids.outputs.embedding, want[1].embedding, atol=1e-6)
    (s,) = llm.score({"prompt": pair[0]}, [{"prompt": pair[1]}])
    assert s.outputs.score == pytest.approx(float(np.dot(want[0].embedding, want[1].embedding)), abs=1e-5)
    classifier = LLM(str(models["bert_cls"]))
    got = classifier.classify([pair[0], {"prompt": pair[1]}])
    assert [g.outputs.probs for g in got] == [w.probs for w in classifier.llm_engine.classify(pair)]
    assert all(g.prompt_token_ids for g in got)
    cross = LLM(str(models["cross"]))
    scores = cross.score({"prompt": pair[0]}, pair)  # one text_1 against every text_2
    assert [x.outputs.score for x in scores] == [o.score for o in cross.llm_engine.score(pair[0], pair)]


@pytest.mark.parametrize("setting,said", [({"quantization": "int8"}, "quantization int8 is not run on encoders"),
                                          ({"tensor_parallel_size": 2}, "tensor_parallel_size 2 is not run on encoders")])
def test_an_encoder_refuses_quantization_and_tensor_parallelism_in_one_line(models, setting, said):
    """Both ran silently before: int8 left the layers in float, TP=2 ran in one process while a
    job reserved a GPU per rank. The engine and the job's preflight refuse them."""
    check_model = pytest.importorskip("pipeline.run.checks.preflight",  # the job side: pydantic, not on a GPU box
                                      reason="the job runner's spec needs pydantic").check_model
    from pipeline.errors import JobError

    config = EngineConfig(model=str(models["mean"]), **setting)
    with pytest.raises(ModelLoadError, match=said) as err:
        LLMEngine(config)
    assert "\n" not in str(err.value)
    with pytest.raises(JobError, match=said):
        check_model(config, "embed")
