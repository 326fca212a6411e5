"""Images in prompts (engine.multimodal), held to transformers: tiny random LLaVA-1.5, Qwen2.5-VL
(M-RoPE positions) and Idefics3 models built here (tests/engine/vlm_models.py) give the greedy tokens of transformers' `generate` on the same
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
from vlm_models import (build_idefics3, build_llava, build_qwen2_5_vl, build_smolvlm, data_url, images,
                        images_processor, png_bytes)

PROMPTS = ["USER: <image>\nWhat is in the picture? ASSISTANT:", "USER: <image>\nDescribe it. ASSISTANT:",
           "USER: Look at this: <image>\nAnd say what colour it is. ASSISTANT:",
           "USER: <image>\nRead the text. ASSISTANT:", "USER: <image>\nHow many shapes? ASSISTANT:"]
TILED = [p.replace("USER: ", "User:").replace("\n", "").replace(" ASSISTANT:", "<end_of_utterance>\nAssistant:")
         for p in PROMPTS]
"""Idefics3's prompts (each <image> becomes its tiles' and the whole image's placeholder runs)."""
QWEN = [p.replace("USER: ", "<|im_start|>user\n").replace("<image>", "<|vision_start|><|image_pad|><|vision_end|>")
        .replace(" ASSISTANT:", "<|im_end|>\n<|im_start|>assistant\n") for p in PROMPTS]
"""Qwen2.5-VL's prompts (each <|image_pad|> becomes as many as the image's merged patches)."""
FAMILY_PROMPTS = {"llava": PROMPTS, "qwen2_5_vl": QWEN, "idefics3": TILED, "smolvlm": TILED}
MAX_NEW = 12


@pytest.fixture(scope="module")
def vlms(tmp_path_factory):
    return {"llava": str(build_llava(tmp_path_factory.mktemp("llava"))),
            "qwen2_5_vl": str(build_qwen2_5_vl(tmp_path_factory.mktemp("qwen2_5_vl"))),
            "idefics3": str(build_idefics3(tmp_path_factory.mktemp("idefics3"))),
            "smolvlm": str(build_smolvlm(tmp_path_factory.mktemp("smolvlm")))}


@pytest.fixture(scope="module")
def llava(vlms):
    return vlms["llava"]


@pytest.fixture(scope="module")
def references(vlms):
    return {family: reference_for(path) for family, path in vlms.items()}


@pytest.fixture(scope="module")
def reference(references):
    return references["llava"]


def processor_for(path: str):
    """transformers' processor of a test model (Qwen2.5-VL's and SmolVLM's without their video processor)."""
    for family, name in (("qwen2_5_vl", "Qwen2_5_VLProcessor"), ("smolvlm", "SmolVLMProcessor")):
        if family in path:
            return images_processor(name, path)
    return AutoProcessor.from_pretrained(path)


def reference_for(path: str):
    processor = processor_for(path)
    model = AutoModelForImageTextToText.from_pretrained(path, dtype=torch.float32).eval()

    def run(prompt: str, pictures: list, add_special_tokens: bool = True):
        tiled = any(name in type(model).__name__.lower() for name in ("idefics3", "smolvlm"))
        images = [pictures] if tiled else pictures  # a list per prompt
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


@pytest.mark.parametrize("family", ["llava", "qwen2_5_vl", "idefics3", "smolvlm"])
@pytest.mark.parametrize("case", ["static", "continuous", "no-prefix-cache", "preempting-pool", "split-prefill"])
def test_greedy_tokens_equal_transformers_generate(vlms, references, tally, case, family):
    kw = {"static": {}, "continuous": {"scheduling": "continuous"},
          "no-prefix-cache": {"enable_prefix_caching": False, "scheduling": "continuous"},
          # 5 rows of ~50 prompt + 12 new tokens in 160 slots: rows are preempted and recomputed
          "preempting-pool": {"scheduling": "continuous", "max_batch_tokens": 160},
          # a pass of 16 tokens: each image's 25 placeholder positions are cut across passes
          "split-prefill": {"scheduling": "continuous", "max_num_batched_tokens": 16}}[case]
    if case == "preempting-pool" and family != "llava":  # Idefics3: 4-5 tiles of 4 tokens; Qwen: 4-9 tokens
        kw["max_batch_tokens"] = {"idefics3": 200, "smolvlm": 200, "qwen2_5_vl": 100}[family]
    llm = engine(vlms[family], **kw)
    pictures = images()
    prompts = FAMILY_PROMPTS[family]
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


@pytest.mark.parametrize("family", ["llava", "qwen2_5_vl", "idefics3", "smolvlm"])
def test_several_images_in_one_prompt(vlms, references, tally, family):
    llm = engine(vlms[family])
    pictures = images()[:3]
    prompt = {"llava": "USER: <image>\n<image>\nCompare: <image>\nASSISTANT:",
              "qwen2_5_vl": "<|im_start|>user\n" + "<|vision_start|><|image_pad|><|vision_end|>" * 2 + "Compare: "
                            "<|vision_start|><|image_pad|><|vision_end|><|im_end|>\n<|im_start|>assistant\n",
              "idefics3": "User:<image><image>Compare:<image><end_of_utterance>\nAssistant:"}.get(
        family, "User:<image><image>Compare:<image><end_of_utterance>\nAssistant:")
    out = llm.generate({"prompt": prompt, "multi_modal_data": {"image": pictures}}, GREEDY)[0]
    assert out.error is None, out.error
    want, scores = references[family](prompt, pictures)
    assert_same_tokens(out.token_ids, want, scores, f"{family}: three images", tally)
    spans = llm.images.prepare(prompt, pictures)[1]
    assert [len(s.runs) for s in spans] == ([5, 3, 3] if family in ("idefics3", "smolvlm") else [1, 1, 1])  # tiles
    if family == "qwen2_5_vl":  # three sizes (grids 4x4, 6x4, 2x8), one vision-tower call
        assert len({tuple(s.pixels["image_grid_thw"].tolist()) for s in spans}) == 3
        assert llm.runner.vision.tower_calls == 1


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
    expected = {"undecodable": "is not an image in a format images are read in (PNG, JPEG",
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
    from transformers import LlavaNextConfig

    with pytest.raises(ValueError, match=r"llava_next vision-language models are not run yet; the engine runs "
                                         r"LLaVA-1.5 \(llava\), Qwen2.5-VL \(qwen2_5_vl\), Idefics3 \(idefics3\), "
                                         r"SmolVLM \(smolvlm\)"):
        family_of(LlavaNextConfig())
    with pytest.raises(ModelLoadError, match="LLaVA-1.5 models run without quantization for now"):
        engine(llava, quantization="int8")


def test_a_processor_this_transformers_cannot_build_is_refused_in_one_line_naming_the_release(vlms, monkeypatch):
    import transformers

    from engine.multimodal.families import images_only

    # a release whose processor constructor no longer takes the parts this way
    def changed(self, image_processor, tokenizer, video_processor, *, frames):
        raise AssertionError("not reached")

    monkeypatch.setattr(transformers.SmolVLMProcessor, "__init__", changed)
    with pytest.raises(ValueError) as refused:
        images_only("SmolVLMProcessor", vlms["smolvlm"])
    message = str(refused.value)
    assert "\n" not in message and message.startswith(
        f"SmolVLMProcessor cannot be built for images with transformers {transformers.__version__} (")
    assert message.endswith("; setup.cfg names the tested releases")


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
    from engine.multimodal import Family, ImageSpan, VisionFeatures, vision

    calls = []

    class Counted(Family):
        def features(self, model, pixels):
            calls.append(pixels["pixel_values"].shape[0])
            return [torch.zeros(25, 4) for _ in range(pixels["pixel_values"].shape[0])]

    model = torch.nn.Linear(2, 2)
    cache = VisionFeatures(Counted("counted", ()), capacity=2)
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


@pytest.mark.parametrize("family", ["llava", "qwen2_5_vl"])
def test_choice_scores_over_an_image_equal_transformers_loglikelihoods(vlms, family):
    llm = engine(vlms[family])
    processor = processor_for(vlms[family])
    model = AutoModelForImageTextToText.from_pretrained(vlms[family], dtype=torch.float32).eval()
    pictures = images()[:2]
    choices = [" red", " blue", " a cat"]
    prompt = FAMILY_PROMPTS[family][0]
    rows = [{"prompt": prompt, "multi_modal_data": {"image": pictures[i]}} for i in range(2)]  # one text
    scores = llm.score_choices(rows + ["plain text row"], [choices] * 3)
    assert scores[2].error is None
    for i, picture in enumerate(pictures):
        assert scores[i].error is None, scores[i].error
        inputs = processor(text=prompt, images=[picture], return_tensors="pt")
        ids = inputs["input_ids"][0].tolist()
        for choice, got in zip(choices, scores[i].logprobs):
            tokens = llm.tokenizer.encode_continuation(choice)
            full = torch.tensor([ids + tokens])
            extra = {}
            if "image_grid_thw" in inputs:  # Qwen2.5-VL: its M-RoPE positions run on past the prompt
                extra = {"image_grid_thw": inputs["image_grid_thw"],
                         "mm_token_type_ids": torch.nn.functional.pad(inputs["mm_token_type_ids"], (0, len(tokens)))}
            with torch.no_grad():
                logits = model(input_ids=full, pixel_values=inputs["pixel_values"],
                               attention_mask=torch.ones_like(full), **extra).logits[0]
            logp = torch.log_softmax(logits.float(), dim=-1)
            want = sum(float(logp[len(ids) - 1 + k, t]) for k, t in enumerate(tokens))
            assert abs(got - want) < 1e-3, (choice, got, want)
    assert scores[0].logprobs != scores[1].logprobs  # one text, two images: each image was read


def test_qwen2_5_vl_chat_with_image_url_parts_equals_transformers(vlms, references, tally):
    path = vlms["qwen2_5_vl"]
    llm = LLM(model=path, dtype="float32", device="cpu", max_num_seqs=4)
    pictures = images()
    conversation = [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": data_url(pictures[1])}},
                                                 {"type": "text", "text": "Describe "},
                                                 {"type": "image_pil", "image_pil": pictures[2]}]}]
    out = llm.chat([conversation], GREEDY)[0]
    rendered = [{**m, "content": [{"type": "image"} if c["type"] != "text" else c for c in m["content"]]}
                for m in conversation]
    text = processor_for(path).apply_chat_template(rendered, add_generation_prompt=True, tokenize=False)
    assert text.count("<|image_pad|>") == 2
    image_pad = llm.get_tokenizer().convert_tokens_to_ids("<|image_pad|>")
    assert out.prompt_token_ids.count(image_pad) == 6 + 4  # each image's merged patches: grids 6x4 and 2x8
    want, scores = references["qwen2_5_vl"](text, pictures[1:3], add_special_tokens=False)
    assert_same_tokens(list(out.outputs[0].token_ids), want, scores, "qwen chat", tally)


def test_a_finished_rows_pixels_are_dropped_and_the_engine_lets_the_row_go(vlms):
    """A long continuous batch holds its live rows only: a finished row's pixel values are dropped
    (its embeddings stay in the bounded cache) and the batch's figures keep no reference to it."""
    import gc
    import weakref

    llm = engine(vlms["qwen2_5_vl"], scheduling="continuous")
    pictures = images()
    short = llm.add_request({"prompt": QWEN[0], "multi_modal_data": {"image": pictures[0]}},
                            SamplingParams(max_tokens=2, temperature=0.0, ignore_eos=True))
    long = llm.add_request({"prompt": QWEN[1], "multi_modal_data": {"image": pictures[1]}},
                           SamplingParams(max_tokens=20, temperature=0.0, ignore_eos=True))
    while short.finish_reason is None:
        llm.step()
    assert long.finish_reason is None  # still running
    assert short.images[0].pixels is None and long.images[0].pixels is not None
    pixels = weakref.ref(long.images[0].pixels["pixel_values"])
    gone = weakref.ref(short)
    del short
    gc.collect()
    assert gone() is None  # nothing in the engine holds the finished row
    while llm.has_unfinished():
        llm.step()
    assert long.images[0].pixels is None and pixels() is None
    assert llm.batch_stats[-1].generated_tokens == 22  # both rows counted after the first let go
