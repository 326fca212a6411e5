"""Images through the engine against transformers' batched `generate`, side by side in one run, on a
tiny Qwen2.5-VL-shaped model (or LLaVA-1.5-shaped: --family llava) built here (random weights, no
download), float32 on CPU.

    .venv/bin/python scripts/bench_vlm.py [--family qwen2_5_vl] [--prompts 256] [--max-tokens 32]
        [--batch 16] [--rss-rows 0] [--device cpu --dtype float32]

On a GPU: --device cuda --dtype bfloat16 (scripts/gpu_check.py --only bench_vlm); greedy tokens
in bf16 may part at near-ties, so the identical count is reported, not required.

Workload: `--prompts` prompts of one or two images each, every image new (random shapes, colours
and a word, at several sizes and aspect ratios; Qwen2.5-VL's processor keeps each near its own
size, 4 to 64 image tokens, LLaVA's resizes each to 64x64, 64 tokens; so neither the embedding
cache nor the prefix cache serves an image), greedy, EOS ignored. transformers runs padded batches of `--batch` (left padding), the engine all
prompts at once (continuous batching). Prints images/s and generated tok/s of each, their ratio,
how many prompts gave identical tokens, and the share of the engine's time spent in the vision
tower. `--rss-rows N` also runs N more prompts through the engine in chunks and prints the
process's resident memory after each (host memory must stay flat over a long job)."""
from __future__ import annotations

import argparse
import json
import random
import resource
import sys
import tempfile
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path[:0] = [str(ROOT), str(ROOT / "tests" / "engine")]

QUESTIONS = ["What is in the picture?", "Describe the image in detail.", "What colour dominates?",
             "Read any text you see.", "How many shapes are there?", "Is this a photograph?"]


def picture(rng: random.Random):
    """A new image: a background, a few shapes and a word, each of random colour, place and size,
    at one of several sizes and aspect ratios (no two prompts share an image: no cache serves one)."""
    from PIL import Image, ImageDraw

    def colour():
        return tuple(rng.randrange(256) for _ in range(3))

    w, h = rng.choice(((64, 64), (96, 48), (40, 90), (120, 80), (50, 50), (200, 60)))
    image = Image.new("RGB", (w, h), colour())
    draw = ImageDraw.Draw(image)
    for _ in range(rng.randint(1, 4)):
        x, y = rng.randrange(w), rng.randrange(h)
        box = (x, y, x + rng.randint(4, w // 2), y + rng.randint(4, h // 2))
        (draw.ellipse if rng.random() < 0.5 else draw.rectangle)(box, fill=colour())
    draw.text((rng.randrange(w // 2), rng.randrange(h // 2)), rng.choice(("cat", "42", "sale", "ok")), fill=colour())
    return image


def workload(n: int, family: str, seed: int = 0) -> list[tuple[str, list]]:
    rng = random.Random(seed)
    out = []
    for _ in range(n):
        k = rng.choice((1, 1, 2))
        if family == "llava":
            text = "USER: " + "<image>\n" * k + rng.choice(QUESTIONS) + " ASSISTANT:"
        else:
            text = ("<|im_start|>user\n" + "<|vision_start|><|image_pad|><|vision_end|>" * k + rng.choice(QUESTIONS)
                    + "<|im_end|>\n<|im_start|>assistant\n")
        out.append((text, [picture(rng) for _ in range(k)]))
    return out


def rss_mib() -> float:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def run_transformers(path: str, prompts, max_tokens: int, batch: int, device: str = "cpu",
                     dtype: str = "float32") -> tuple[list[list[int]], float]:
    from transformers import AutoModelForImageTextToText, AutoProcessor
    from vlm_models import images_processor

    processor = (images_processor("Qwen2_5_VLProcessor", path) if "qwen" in path
                 else AutoProcessor.from_pretrained(path))
    processor.tokenizer.padding_side = "left"
    model = AutoModelForImageTextToText.from_pretrained(path, dtype=getattr(torch, dtype)).eval().to(device)
    out = []
    started = time.perf_counter()
    with torch.inference_mode():
        for i in range(0, len(prompts), batch):
            chunk = prompts[i:i + batch]
            inputs = processor(text=[p for p, _ in chunk], images=[im for _, ims in chunk for im in ims],
                               return_tensors="pt", padding=True).to(device)
            ids = model.generate(**inputs, max_new_tokens=max_tokens, min_new_tokens=max_tokens, do_sample=False,
                                 eos_token_id=None, pad_token_id=processor.tokenizer.pad_token_id or 0)
            out += ids[:, inputs["input_ids"].shape[1]:].tolist()
    return out, time.perf_counter() - started


def run_engine(llm, prompts, max_tokens: int) -> tuple[list[list[int]], float]:
    from engine import SamplingParams

    started = time.perf_counter()
    outs = llm.generate([{"prompt": p, "multi_modal_data": {"image": ims}} for p, ims in prompts],
                        SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True))
    seconds = time.perf_counter() - started
    errors = [o.error for o in outs if o.error]
    if errors:
        raise SystemExit(f"{len(errors)} prompts failed: {errors[0]}")
    return [o.token_ids for o in outs], seconds


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--family", choices=("qwen2_5_vl", "llava"), default="qwen2_5_vl")
    parser.add_argument("--prompts", type=int, default=256)
    parser.add_argument("--max-tokens", type=int, default=32)
    parser.add_argument("--batch", type=int, default=16)
    parser.add_argument("--rss-rows", type=int, default=0)
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--dtype", default="float32", choices=("float32", "bfloat16", "float16"))
    parser.add_argument("--json", type=Path)
    args = parser.parse_args()
    from engine import EngineConfig, LLMEngine
    from vlm_models import build_llava, build_qwen2_5_vl

    prompts = workload(args.prompts, args.family)
    n_images = sum(len(ims) for _, ims in prompts)
    with tempfile.TemporaryDirectory() as tmp:
        if args.family == "llava":
            path = str(build_llava(Path(tmp) / "llava", image_size=64, patch=8, vision_hidden=192, vision_layers=4,
                                   hidden=384, layers=6, heads=6))
        else:
            path = str(build_qwen2_5_vl(Path(tmp) / "qwen2_5_vl", hidden=384, layers=6, heads=6, vision_hidden=192,
                                        vision_layers=4, vision_heads=4, max_image_tokens=64))
        llm = LLMEngine(EngineConfig(model=path, dtype=args.dtype, device=args.device, max_num_seqs=64,
                                     scheduling="continuous", max_batch_tokens=65536))
        run_engine(llm, prompts[:4], 2)  # warm-up: the kernels' first use, the allocator
        llm.runner.vision.seconds = 0.0
        engine_tokens, engine_s = run_engine(llm, prompts, args.max_tokens)
        vision_s = llm.runner.vision.seconds
        hf_tokens, hf_s = run_transformers(path, prompts, args.max_tokens, args.batch, args.device, args.dtype)
        same = sum(a == b for a, b in zip(engine_tokens, hf_tokens))
        generated = len(prompts) * args.max_tokens
        report = {"family": args.family, "device": args.device, "dtype": args.dtype, "prompts": len(prompts), "images": n_images, "max_tokens": args.max_tokens,
                  "engine_seconds": round(engine_s, 2), "transformers_seconds": round(hf_s, 2),
                  "engine_images_per_s": round(n_images / engine_s, 1),
                  "transformers_images_per_s": round(n_images / hf_s, 1),
                  "engine_tok_per_s": round(generated / engine_s, 1), "transformers_tok_per_s": round(generated / hf_s, 1),
                  "speedup": round(hf_s / engine_s, 2), "identical_prompts": f"{same}/{len(prompts)}",
                  "vision_tower_share_of_engine_time": round(vision_s / engine_s, 3)}
        if args.rss_rows:
            rss = []
            more = workload(args.rss_rows, args.family, seed=1)
            for i in range(0, len(more), 250):
                run_engine(llm, more[i:i + 250], 4)
                rss.append(round(rss_mib(), 1))
            report["rss_mib_every_250_rows"] = rss
        print(json.dumps(report, indent=2))
        if args.json:
            args.json.write_text(json.dumps(report, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
