"""Tiny random vision-language models, built locally from transformers configs with their processor
and tokenizer made here (no hub), and test images drawn with PIL."""
from __future__ import annotations

import base64
import io
from pathlib import Path

import torch
from PIL import Image, ImageDraw

from engine.models.builtin import byte_tokenizer

LLAVA_TEMPLATE = ("{% for m in messages %}{{ m['role'] }}: {% if m['content'] is string %}{{ m['content'] }}"
                  "{% else %}{% for c in m['content'] %}{% if c['type'] == 'image' %}<image>\n{% else %}"
                  "{{ c['text'] }}{% endif %}{% endfor %}{% endif %}\n{% endfor %}"
                  "{% if add_generation_prompt %}assistant:{% endif %}")


def build_llava(out: Path, seed: int = 0, image_size: int = 30, patch: int = 6, vision_hidden: int = 32,
                vision_layers: int = 2, hidden: int = 64, layers: int = 2, heads: int = 4) -> Path:
    """LLaVA-1.5's shape in miniature: a CLIP vision tower (by default 30x30 images, 6x6 patches:
    25 image tokens after its CLS is dropped), a two-layer MLP projector and a Llama decoder, with
    a LlavaProcessor (CLIP's resize and center crop) over the byte tokenizer plus <image>."""
    from transformers import (CLIPImageProcessorPil, CLIPVisionConfig, LlamaConfig, LlavaConfig,
                              LlavaForConditionalGeneration, LlavaProcessor)

    tok = byte_tokenizer()
    tok.add_special_tokens({"additional_special_tokens": ["<image>"]})
    image_id = tok.convert_tokens_to_ids("<image>")
    vision = CLIPVisionConfig(hidden_size=vision_hidden, intermediate_size=2 * vision_hidden,
                              num_hidden_layers=vision_layers, num_attention_heads=2, image_size=image_size,
                              patch_size=patch, projection_dim=vision_hidden, initializer_range=0.2)
    text = LlamaConfig(hidden_size=hidden, intermediate_size=2 * hidden, num_hidden_layers=layers,
                       num_attention_heads=heads, num_key_value_heads=2, vocab_size=len(tok),
                       max_position_embeddings=2048,
                       initializer_range=0.2, bos_token_id=tok.bos_token_id, eos_token_id=tok.eos_token_id)
    config = LlavaConfig(vision_config=vision, text_config=text, image_token_id=image_id, vision_feature_layer=-2,
                         vision_feature_select_strategy="default", projector_hidden_act="gelu")
    torch.manual_seed(seed)
    LlavaForConditionalGeneration(config).eval().save_pretrained(out)
    processor = LlavaProcessor(image_processor=CLIPImageProcessorPil(
                                   size={"shortest_edge": image_size},
                                   crop_size={"height": image_size, "width": image_size}),
                               tokenizer=tok, patch_size=patch, vision_feature_select_strategy="default",
                               num_additional_image_tokens=1, image_token="<image>", chat_template=LLAVA_TEMPLATE)
    processor.save_pretrained(out)
    return out


IDEFICS3_TEMPLATE = ("<|im_start|>{% for m in messages %}{{ m['role'] | capitalize }}:{% if m['content'] is string %}"
                     "{{ m['content'] }}{% else %}{% for c in m['content'] %}{% if c['type'] == 'image' %}<image>"
                     "{% else %}{{ c['text'] }}{% endif %}{% endfor %}{% endif %}<end_of_utterance>\n{% endfor %}"
                     "{% if add_generation_prompt %}Assistant:{% endif %}")


def build_idefics3(out: Path, seed: int = 0) -> Path:
    """Idefics3 in miniature: images resized to a longest edge of 64 and cut into 32x32 tiles (a 2x2
    grid, or fewer for a narrow image) plus the whole image at 32x32, each tile 4 placeholder tokens
    (8x8 patches, pixel-shuffled by 2) after its <row_r_col_c> marker, the whole image's after
    <global-img>; a Llama decoder; the byte tokenizer plus Idefics3's marker tokens."""
    return _build_tiled(out, seed, "Idefics3")


def _build_tiled(out: Path, seed: int, family: str) -> Path:
    """Idefics3's or SmolVLM's miniature (the same tiling and sizes), with the family's own
    config, model and processor; SmolVLM's processor_config.json names SmolVLMProcessor, as the
    hub's checkpoints do (its class here is the reference's, without a video processor)."""
    import json

    import transformers
    from transformers import LlamaConfig

    tok = byte_tokenizer()
    markers = ["<image>", "<fake_token_around_image>", "<global-img>", "<end_of_utterance>"]
    tok.add_special_tokens({"additional_special_tokens": markers + [f"<row_{r}_col_{c}>" for r in range(1, 7)
                                                                     for c in range(1, 7)]})
    image_processor = (getattr(transformers, f"{family}ImageProcessorPil", None)
                       or getattr(transformers, f"{family}ImageProcessor"))
    image_processor = image_processor(size={"longest_edge": 64}, max_image_size={"longest_edge": 32})
    vision = getattr(transformers, f"{family}VisionConfig")(
        hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=2, image_size=32, patch_size=8,
        initializer_range=0.2)
    text = LlamaConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                       num_key_value_heads=2, vocab_size=len(tok), max_position_embeddings=2048, initializer_range=0.2,
                       bos_token_id=tok.bos_token_id, eos_token_id=tok.eos_token_id)
    config = getattr(transformers, f"{family}Config")(vision_config=vision, text_config=text, scale_factor=2,
                                                      image_token_id=tok.convert_tokens_to_ids("<image>"))
    torch.manual_seed(seed)
    getattr(transformers, f"{family}ForConditionalGeneration")(config).eval().save_pretrained(out)
    if family == "Idefics3":
        transformers.Idefics3Processor(image_processor=image_processor, tokenizer=tok, image_seq_len=4,
                                       chat_template=IDEFICS3_TEMPLATE).save_pretrained(out)
        return out
    without_video(f"{family}Processor")(image_processor=image_processor, tokenizer=tok, image_seq_len=4,
                                        chat_template=IDEFICS3_TEMPLATE).save_pretrained(out)
    # the hub's layout: the processor's class and its image_seq_len (which a constructor without it
    # leaves out of what it saves)
    path = out / "processor_config.json"
    path.write_text(json.dumps({**json.loads(path.read_text()), "processor_class": f"{family}Processor",
                                "image_seq_len": 4}))
    return out


QWEN_TEMPLATE = ("{% for m in messages %}<|im_start|>{{ m['role'] }}\n{% if m['content'] is string %}{{ m['content'] }}"
                 "{% else %}{% for c in m['content'] %}{% if c['type'] == 'image' %}"
                 "<|vision_start|><|image_pad|><|vision_end|>{% else %}{{ c['text'] }}{% endif %}{% endfor %}"
                 "{% endif %}<|im_end|>\n{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")


def without_video(name: str):
    """transformers' processor class `name` (Qwen2_5_VLProcessor, SmolVLMProcessor) whose constructor
    takes the image processor and the tokenizer alone (a processor's parts are those its constructor
    names), the base's video processor None: a video processor needs torchvision. The reference's
    own, made apart from the engine's."""
    import transformers

    class ImagesOnly(getattr(transformers, name)):
        def __init__(self, image_processor, tokenizer, **kwargs):
            super().__init__(image_processor, tokenizer, None, **kwargs)

    return ImagesOnly


def images_processor(name: str, path) -> object:
    """The reference's processor of a saved model whose processor is `name`, without its video processor."""
    import transformers
    from transformers import AutoImageProcessor, AutoTokenizer

    settings, _ = getattr(transformers, name).get_processor_dict(str(path))
    return without_video(name)(AutoImageProcessor.from_pretrained(path), AutoTokenizer.from_pretrained(path),
                               **{key: settings[key] for key in ("image_seq_len", "chat_template") if key in settings})


def build_qwen2_5_vl(out: Path, seed: int = 0, hidden: int = 64, layers: int = 2, heads: int = 4,
                     vision_hidden: int = 32, vision_layers: int = 2, vision_heads: int = 2,
                     max_image_tokens: int = 36) -> Path:
    """Qwen2.5-VL in miniature: images resized to multiples of 28 pixels, between 4 and
    `max_image_tokens` placeholder tokens (14-pixel patches, merged 2x2), a windowed vision tower
    whose last block attends fully, a Qwen2 decoder with M-RoPE (the head's rotary pairs split
    1:1.5:1.5 over time, height and width, as Qwen's 16:24:24); the byte tokenizer plus Qwen's
    vision tokens; its processor_config.json names Qwen2_5_VLProcessor, as the hub's checkpoints do."""
    import json

    from transformers import Qwen2_5_VLConfig, Qwen2_5_VLForConditionalGeneration
    from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil

    tok = byte_tokenizer()
    tok.add_special_tokens({"additional_special_tokens": ["<|image_pad|>", "<|video_pad|>", "<|vision_start|>",
                                                          "<|vision_end|>", "<|im_start|>", "<|im_end|>"]})
    ids = {name: tok.convert_tokens_to_ids(f"<|{name}|>") for name in ("image_pad", "video_pad", "vision_start",
                                                                        "vision_end")}
    pairs = hidden // heads // 2
    section = [pairs // 4, 3 * pairs // 8, pairs - pairs // 4 - 3 * pairs // 8]
    text = dict(hidden_size=hidden, intermediate_size=2 * hidden, num_hidden_layers=layers, num_attention_heads=heads,
                num_key_value_heads=2, vocab_size=len(tok), max_position_embeddings=4096, initializer_range=0.2,
                rope_scaling={"type": "mrope", "mrope_section": section}, bos_token_id=tok.bos_token_id,
                eos_token_id=tok.eos_token_id)
    vision = dict(depth=vision_layers, hidden_size=vision_hidden, intermediate_size=2 * vision_hidden,
                  num_heads=vision_heads, out_hidden_size=hidden, patch_size=14, spatial_merge_size=2,
                  temporal_patch_size=2, window_size=56, fullatt_block_indexes=[vision_layers - 1],
                  initializer_range=0.2)
    config = Qwen2_5_VLConfig(text_config=text, vision_config=vision, image_token_id=ids["image_pad"],
                              video_token_id=ids["video_pad"], vision_start_token_id=ids["vision_start"],
                              vision_end_token_id=ids["vision_end"])
    torch.manual_seed(seed)
    Qwen2_5_VLForConditionalGeneration(config).eval().save_pretrained(out)
    image_processor = Qwen2VLImageProcessorPil(min_pixels=28 * 28 * 4, max_pixels=28 * 28 * max_image_tokens,
                                               patch_size=14, merge_size=2, temporal_patch_size=2)
    without_video("Qwen2_5_VLProcessor")(image_processor=image_processor, tokenizer=tok,
                                         chat_template=QWEN_TEMPLATE).save_pretrained(out)
    path = out / "processor_config.json"
    saved = json.loads(path.read_text())
    path.write_text(json.dumps({**saved, "processor_class": "Qwen2_5_VLProcessor"}))
    return out


def build_smolvlm(out: Path, seed: int = 0) -> Path:
    """SmolVLM in miniature: Idefics3's tiling and sizes (build_idefics3) with SmolVLM's own
    config, model and processor (which imports num2words)."""
    return _build_tiled(out, seed, "SmolVLM")


def images() -> list[Image.Image]:
    """Test images of several sizes and aspect ratios: a gradient, shapes, text, flat colours."""
    gradient = Image.linear_gradient("L").convert("RGB").resize((64, 48))
    shapes = Image.new("RGB", (40, 90), (250, 250, 240))
    draw = ImageDraw.Draw(shapes)
    draw.ellipse((5, 10, 35, 40), fill=(200, 20, 20))
    draw.rectangle((8, 50, 30, 85), fill=(20, 40, 200))
    text = Image.new("RGB", (120, 36), (255, 255, 255))
    ImageDraw.Draw(text).text((4, 10), "batch 42", fill=(0, 0, 0))
    return [gradient, shapes, text, Image.new("RGB", (31, 31), (10, 180, 60)),
            Image.radial_gradient("L").convert("RGB").resize((50, 70))]


def data_url(image: Image.Image, fmt: str = "PNG") -> str:
    return f"data:image/{fmt.lower()};base64,{base64.b64encode(png_bytes(image, fmt)).decode()}"


def png_bytes(image: Image.Image, fmt: str = "PNG") -> bytes:
    buf = io.BytesIO()
    image.save(buf, format=fmt)
    return buf.getvalue()
