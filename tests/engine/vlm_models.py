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
    import transformers
    from transformers import Idefics3Config, Idefics3ForConditionalGeneration, Idefics3Processor, Idefics3VisionConfig
    from transformers import LlamaConfig

    tok = byte_tokenizer()
    markers = ["<image>", "<fake_token_around_image>", "<global-img>", "<end_of_utterance>"]
    tok.add_special_tokens({"additional_special_tokens": markers + [f"<row_{r}_col_{c}>" for r in range(1, 7)
                                                                     for c in range(1, 7)]})
    image_processor = getattr(transformers, "Idefics3ImageProcessorPil", None) or transformers.Idefics3ImageProcessor
    processor = Idefics3Processor(image_processor=image_processor(size={"longest_edge": 64},
                                                                  max_image_size={"longest_edge": 32}),
                                  tokenizer=tok, image_seq_len=4, chat_template=IDEFICS3_TEMPLATE)
    vision = Idefics3VisionConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=2,
                                  image_size=32, patch_size=8, initializer_range=0.2)
    text = LlamaConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                       num_key_value_heads=2, vocab_size=len(tok), max_position_embeddings=2048, initializer_range=0.2,
                       bos_token_id=tok.bos_token_id, eos_token_id=tok.eos_token_id)
    config = Idefics3Config(vision_config=vision, text_config=text, image_token_id=tok.convert_tokens_to_ids("<image>"),
                            scale_factor=2)
    torch.manual_seed(seed)
    Idefics3ForConditionalGeneration(config).eval().save_pretrained(out)
    processor.save_pretrained(out)
    return out


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
