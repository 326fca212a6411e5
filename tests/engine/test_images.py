"""Images in prompts (engine.multimodal), held to transformers: a tiny random LLaVA-1.5 built here
(tests/engine/vlm_models.py) gives the greedy tokens of transformers' `generate` on the same
prompt and images, in both scheduling modes, with prefix caching on and off, through a pool small
enough to preempt and a pass budget small enough to split an image's prefill; two images under one
prompt never share a cached block; chat messages with image_url and image_pil parts; and every
bad input fails its row alone, in one line."""
from __future__ import annotations

import pytest
import torch
from transformers import AutoModelForImageTextToText, AutoProcessor

from engine import LLM, EngineConfig, LLMEngine, ModelLoadError, SamplingParams
from engine.multimodal import MediaPolicy, family_of, load_image
from parity import ForgivenRows, assert_same_tokens
from vlm_models import build_idefics3, build_llava, data_url, images, png_bytes

PROMPTS = ["USER: <image>\nWhat is in the picture? ASSISTANT:", "USER: <image>\nDescribe it. ASSISTANT:",
           "USER: Look at this: <image>\nAnd say what colour it is. ASSISTANT:",
           "USER: <image>\nRead the text. ASSISTANT:", "USER: <image>\nHow many shapes? ASSISTANT:"]
TILED = [p.replace("USER: ", "User:").replace("\n", "").replace(" ASSISTANT:", "<end_of_utterance>\nAssistant:")
         for p in PROMPTS]
"""Idefics3's prompts (each <image> becomes its tiles' and the whole image's placeholder runs)."""
MAX_NEW = 12


@pytest.fixture(scope="module")
def vlms(tmp_path_factory):
    return {"llava": str(build_llava(tmp_path_factory.mktemp("llava"))),
            "idefics3": str(build_idefics3(tmp_path_factory.mktemp("idefics3")))}


@pytest.fixture(scope="module")
def llava(vlms):
    return vlms["llava"]


@pytest.fixture(scope="module")
def references(vlms):
    return {family: reference_for(path) for family, path in vlms.items()}


@pytest.fixture(scope="module")
def reference(references):
    return references["llava"]


def reference_for(path: str):
    processor = AutoProcessor.from_pretrained(path)
    model = AutoModelForImageTextToText.from_pretrained(path, dtype=torch.float32).eval()

    def run(prompt: str, pictures: list, add_special_tokens: bool = True):
        images = [pictures] if "idefics3" in type(model).__name__.lower() else pictures  # a list per prompt
        inputs = processor(text=prompt, images=images, return_tensors="pt", add_special_tokens=add_special_tokens)
        out = model.generate(**inputs, max_new_tokens=MAX_NEW, do_sample=False, eos_token_id=None, pad_token_id=0,
                             output_scores=True, return_dict_in_generate=True)
        return out.sequences[0, inputs["input_ids"].shape[1]:].tolist(), [s[0] for s in out.scores]

    return run


@pytest.fixture(scope="module")
def tally():
    forgiven = ForgivenRows()
    yield forgiven
    forgiven.check()


def engine(llava, **kw) -> LLMEngine:
    settings = dict(model=llava, dtype="float32", device="cpu", max_num_seqs=8, block_size=8) | kw
    return LLMEngine(EngineConfig(**settings))


GREEDY = SamplingParams(max_tokens=MAX_NEW, temperature=0.0, ignore_eos=True)


@pytest.mark.parametrize("family", ["llava", "idefics3"])
@pytest.mark.parametrize("case", ["static", "continuous", "no-prefix-cache", "preempting-pool", "split-prefill"])
def test_greedy_tokens_equal_transformers_generate(vlms, references, tally, case, family):
    kw = {"static": {}, "continuous": {"scheduling": "continuous"},
          "no-prefix-cache": {"enable_prefix_caching": False, "scheduling": "continuous"},
          # 5 rows of ~50 prompt + 12 new tokens in 160 slots: rows are preempted and recomputed
          "preempting-pool": {"scheduling": "continuous", "max_batch_tokens": 160},
          # a pass of 16 tokens: each image's 25 placeholder positions are cut across passes
          "split-prefill": {"scheduling": "continuous", "max_num_batched_tokens": 16}}[case]
    if family == "idefics3" and case == "preempting-pool":  # its prompts hold 4-5 tiles of 4 tokens each
        kw["max_batch_tokens"] = 200
    llm = engine(vlms[family], **kw)
    pictures = images()
    prompts = PROMPTS if family == "llava" else TILED
    outs = llm.generate([{"prompt": p, "multi_modal_data": {"image": im}} for p, im in zip(prompts, pictures)],
                        GREEDY)
    for prompt, picture, out in zip(prompts, pictures, outs):
        assert out.error is None, out.error
        want, scores = references[family](prompt, [picture])
        assert_same_tokens(out.token_ids, want, scores, f"{family} {case} {prompt[:20]!r}", tally)
    if case == "preempting-pool":  # rows were preempted and recomputed from their images' embeddings
        assert sum(s.preemptions for s in llm.batch_stats) > 0
    assert llm.runner.vision.images_encoded >= len(PROMPTS)


def test_two_images_under_one_prompt_never_share_a_block_and_one_image_does(llava, reference, tally):
    llm = engine(llava, scheduling="continuous")
    a, b = images()[:2]
    prompt = PROMPTS[0]
    first = llm.generate([{"prompt": prompt, "multi_modal_data": {"image": a}}], GREEDY)[0]
    other = llm.generate([{"prompt": prompt, "multi_modal_data": {"image": b}}], GREEDY)[0]
    again = llm.generate([{"prompt": prompt, "multi_modal_data": {"image": a}}], GREEDY)[0]
    for picture, out in ((a, first), (b, other), (a, again)):
        want, scores = reference(prompt, [picture])
        assert_same_tokens(out.token_ids, want, scores, "cache", tally)
    text_blocks = prompt.index("<image>") // 8  # blocks before the image: the text alone, shared
    assert other.num_cached_tokens <= (text_blocks + 1) * 8  # the image's blocks are its own
    assert again.num_cached_tokens >= 40  # the same image under the same prefix: its blocks reused
    assert llm.runner.vision.images_encoded == 2  # and its embeddings, from the cache


@pytest.mark.parametrize("family", ["llava", "idefics3"])
def test_several_images_in_one_prompt(vlms, references, tally, family):
    llm = engine(vlms[family])
    pictures = images()[:3]
    prompt = ("USER: <image>\n<image>\nCompare: <image>\nASSISTANT:" if family == "llava" else
              "User:<image><image>Compare:<image><end_of_utterance>\nAssistant:")
    out = llm.generate({"prompt": prompt, "multi_modal_data": {"image": pictures}}, GREEDY)[0]
    assert out.error is None, out.error
    want, scores = references[family](prompt, pictures)
    assert_same_tokens(out.token_ids, want, scores, f"{family}: three images", tally)
    spans = llm.images.prepare(prompt, pictures)[1]
    assert [len(s.runs) for s in spans] == ([1, 1, 1] if family == "llava" else [5, 3, 3])  # tiles + whole image


def test_chat_messages_with_image_url_and_image_pil_parts(llava, reference, tally):
    llm = LLM(model=llava, dtype="float32", device="cpu", max_num_seqs=4)
    pictures = images()
    conversations = [
        [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": data_url(pictures[0])}},
                                      {"type": "text", "text": "What is this?"}]}],
        [{"role": "user", "content": [{"type": "text", "text": "Compare "},
                                      {"type": "image_pil", "image_pil": pictures[1]},
                                      {"type": "image_url", "image_url": {"url": data_url(pictures[2], "JPEG")}}]}]]
    outs = llm.chat(conversations, GREEDY)
    processor = AutoProcessor.from_pretrained(llava)
    for conversation, out, pics in zip(conversations, outs, ([pictures[0]], [pictures[1], pictures[2]])):
        rendered = [{**m, "content": [{"type": "image"} if c["type"] != "text" else c for c in m["content"]]}
                    for m in conversation]
        text = processor.apply_chat_template(rendered, add_generation_prompt=True, tokenize=False)
        pics = [load_image(data_url(p, "JPEG"), MediaPolicy()) if i == 1 and len(pics) == 2 else p
                for i, p in enumerate(pics)]
        want, scores = reference(text, pics, add_special_tokens=False)
        assert_same_tokens(list(out.outputs[0].token_ids), want, scores, "chat", tally)


def test_each_bad_input_fails_its_row_alone_in_one_line(llava, tmp_path, monkeypatch):
    from PIL import Image

    allowed = tmp_path / "media"
    allowed.mkdir()
    inside = allowed / "ok.png"
    inside.write_bytes(png_bytes(images()[0]))
    outside = tmp_path / "secret.png"
    outside.write_bytes(png_bytes(images()[0]))
    llm = engine(llava, allowed_local_media_path=str(allowed), limit_mm_per_prompt={"image": 2},
                 max_image_pixels=100_000)
    big = png_bytes(Image.new("RGB", (400, 300)))  # 120,000 pixels
    prompt = PROMPTS[1]
    rows = {
        "good": images()[0],
        "local path": str(inside),
        "undecodable": b"\x89PNG\r\n\x1a\n this is not an image",
        "over max_image_pixels": big,
        "outside the allowed path": str(outside),
        "a host not allowed": "https://example.com/cat.png",
        "an unknown scheme": "ftp://example.com/cat.png",
        "not an image type": 42,
    }
    loads = []
    original = Image.Image.load
    monkeypatch.setattr(Image.Image, "load", lambda self: loads.append(self.size) or original(self))
    outs = llm.generate([{"prompt": prompt, "multi_modal_data": {"image": src}} for src in rows.values()]
                        + [{"prompt": "USER: <image><image><image> ASSISTANT:",
                            "multi_modal_data": {"image": [images()[0]] * 3}}], GREEDY)
    errors = dict(zip([*rows, "too many images"], (o.error for o in outs)))
    assert errors["good"] is None and errors["local path"] is None
    assert outs[0].token_ids == outs[1].token_ids  # the same picture, read from the allowed directory
    expected = {"undecodable": "is not an image PIL can read",
                "over max_image_pixels": "400x300 = 120,000 pixels, over engine.max_image_pixels (100,000)",
                "outside the allowed path": "is outside engine.allowed_local_media_path",
                "a host not allowed": "host 'example.com' is not in engine.allowed_media_domains, which is empty",
                "an unknown scheme": "not ftp://", "not an image type": "not int",
                "too many images": "3 images in one prompt, over engine.limit_mm_per_prompt's 2"}
    for name, fragment in expected.items():
        assert errors[name] is not None and fragment in errors[name] and "\n" not in errors[name], (name, errors[name])
    assert (400, 300) not in loads  # refused from the header: its pixels were never decoded
    assert all(o.finish_reason == "error" for o in outs[2:])


def test_local_paths_are_refused_unless_a_directory_allows_them(tmp_path):
    path = tmp_path / "a.png"
    path.write_bytes(png_bytes(images()[0]))
    with pytest.raises(ValueError, match="local image paths are refused unless engine.allowed_local_media_path"):
        load_image(str(path), MediaPolicy())
    assert load_image(f"file://{path}", MediaPolicy(allowed_local_media_path=str(tmp_path))).size == (64, 48)
    link = tmp_path / "inside" / "link.png"
    link.parent.mkdir()
    link.symlink_to("/etc/hostname")
    with pytest.raises(ValueError, match="outside engine.allowed_local_media_path"):
        load_image(str(link), MediaPolicy(allowed_local_media_path=str(link.parent)))


def test_an_image_sent_to_a_text_only_model_fails_that_row():
    llm = LLMEngine(EngineConfig(model="builtin:tiny", device="cpu", max_num_seqs=4))
    outs = llm.generate(["plain text", {"prompt": "look", "multi_modal_data": {"image": images()[0]}}],
                        SamplingParams(max_tokens=3))
    assert outs[0].error is None
    assert outs[1].finish_reason == "error" and "builtin:tiny is a text-only model: it takes no images" in outs[1].error


def test_families_not_run_and_settings_images_do_not_take_are_refused_in_one_line(llava):
    from transformers import Qwen2_5_VLConfig

    with pytest.raises(ValueError, match=r"qwen2_5_vl vision-language models are not run yet; the engine runs "
                                         r"LLaVA-1.5 \(llava\), Idefics3 \(idefics3\)"):
        family_of(Qwen2_5_VLConfig())
    with pytest.raises(ModelLoadError, match="LLaVA-1.5 models run without quantization for now"):
        engine(llava, quantization="int8")


def test_the_prefix_cache_names_image_positions_by_the_images_digest():
    from engine.core.sequence import Sequence
    from engine.multimodal import ImageSpan

    def row(digest):
        return Sequence(index=0, prompt_token_ids=[5, 6, 9, 9, 9, 7], params=SamplingParams(), seed=0,
                        images=[ImageSpan(((2, 3),), digest, None)])

    a, b = row("aa"), row("bb")
    assert a.named_tokens[:2] == [5, 6] and a.named_tokens[5] == 7
    assert a.named_tokens[2:5] == ["img:aa"] * 3 and b.named_tokens[2:5] == ["img:bb"] * 3


def test_the_embedding_cache_is_bounded_and_never_drops_what_a_pass_needs(monkeypatch):
    from engine.multimodal import ImageSpan, VisionFeatures, vision

    calls = []

    class Family:
        def features(self, model, pixels):
            calls.append(pixels["pixel_values"].shape[0])
            return [torch.zeros(25, 4) for _ in range(pixels["pixel_values"].shape[0])]

    model = torch.nn.Linear(2, 2)
    cache = VisionFeatures(Family(), capacity=2)
    spans = [ImageSpan(((0, 25),), f"d{i}", {"pixel_values": torch.zeros(3, 4, 4)}) for i in range(3)]
    assert set(cache.features(model, spans)) == {"d0", "d1", "d2"} and calls == [3]  # one call for the pass
    assert len(cache.cache) == 3  # all three are this pass's: none dropped
    cache.features(model, spans[:1])
    assert list(cache.cache) == ["d2", "d0"] and calls == [3]  # d0 from the cache; the oldest other dropped
    monkeypatch.setattr(vision, "CACHE_ROWS", 30)
    cache.features(model, spans[1:2])
    assert list(cache.cache) == ["d1"] and calls == [3, 1]


def test_an_images_pieces_follow_its_runs_across_a_chunk():
    from engine.multimodal import ImageSpan

    span = ImageSpan(((3, 4), (10, 4), (20, 2)), "d", None)
    assert span.length == 10 and span.start == 3 and span.end == 22
    assert list(span.pieces(0, 32)) == [(3, 4, 0), (10, 4, 4), (20, 2, 8)]
    assert list(span.pieces(5, 12)) == [(5, 2, 2), (10, 2, 4)]  # a chunk cutting two runs
    assert list(span.pieces(14, 20)) == []


def test_choice_scores_over_an_image_equal_transformers_loglikelihoods(llava):
    llm = engine(llava)
    processor = AutoProcessor.from_pretrained(llava)
    model = AutoModelForImageTextToText.from_pretrained(llava, dtype=torch.float32).eval()
    pictures = images()[:2]
    choices = [" red", " blue", " a cat"]
    rows = [{"prompt": PROMPTS[0], "multi_modal_data": {"image": pictures[i]}} for i in range(2)]  # one text
    scores = llm.score_choices(rows + ["plain text row"], [choices] * 3)
    assert scores[2].error is None
    for i, picture in enumerate(pictures):
        assert scores[i].error is None, scores[i].error
        inputs = processor(text=PROMPTS[0], images=[picture], return_tensors="pt")
        ids = inputs["input_ids"][0].tolist()
        for choice, got in zip(choices, scores[i].logprobs):
            tokens = llm.tokenizer.encode_continuation(choice)
            full = torch.tensor([ids + tokens])
            with torch.no_grad():
                logits = model(input_ids=full, pixel_values=inputs["pixel_values"],
                               attention_mask=torch.ones_like(full)).logits[0]
            logp = torch.log_softmax(logits.float(), dim=-1)
            want = sum(float(logp[len(ids) - 1 + k, t]) for k, t in enumerate(tokens))
            assert abs(got - want) < 1e-3, (choice, got, want)
    assert scores[0].logprobs != scores[1].logprobs  # one text, two images: each image was read
