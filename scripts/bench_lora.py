"""LoRA throughput: the same requests on the base model alone, spread over 4 adapters in one
engine, and through PEFT's mixed-adapter generate (padded batches, adapter_names=), side by side
in one run; and the adapters' tokens against each adapter's merged model run alone.

    .venv/bin/python scripts/bench_lora.py [--requests 256] [--adapters 4] [--rank 16] [--max-tokens 32]
                                           [--max-num-seqs 64] [--peft-batch 32] [--skip-peft]

Model: builtin:llama-42m (hidden 512, 8 layers, 32k vocabulary), fp32 on CPU (bf16 on CUDA).
Adapters: random PEFT adapters of rank --rank on all 7 projections, made here with peft.
Prompts: 16-64 random token ids. Greedy, ignore_eos, --max-tokens new tokens each."""
from __future__ import annotations

import argparse
import json
import random
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from engine import EngineConfig, LLMEngine, LoRARequest, SamplingParams  # noqa: E402
from engine.models import builtin_path  # noqa: E402

PROJECTIONS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


def make_adapters(base: Path, root: Path, n: int, rank: int) -> list[Path]:
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    out = []
    for k in range(n):
        torch.manual_seed(k + 1)
        peft = get_peft_model(AutoModelForCausalLM.from_pretrained(base),
                              LoraConfig(r=rank, lora_alpha=2 * rank, target_modules=PROJECTIONS, init_lora_weights=False))
        with torch.no_grad():
            for name, p in peft.named_parameters():
                if "lora_B" in name:
                    p.normal_(std=0.05)
        peft.save_pretrained(root / f"a{k}")
        out.append(root / f"a{k}")
    return out


def timed(fn):
    start = time.perf_counter()
    result = fn()
    return result, time.perf_counter() - start


def peft_mixed(base: Path, adapters: list[Path], prompts, names, max_tokens: int, batch: int) -> float:
    """Seconds of PEFT's generate over the requests in padded batches with adapter_names=."""
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    model = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(base), str(adapters[0]), adapter_name="a0")
    for k, path in enumerate(adapters[1:], 1):
        model.load_adapter(str(path), adapter_name=f"a{k}")
    model.eval()
    start = time.perf_counter()
    with torch.inference_mode():
        for i in range(0, len(prompts), batch):
            rows, which = prompts[i:i + batch], names[i:i + batch]
            width = max(map(len, rows))
            ids = torch.tensor([[0] * (width - len(r)) + r for r in rows])  # left padding
            mask = torch.tensor([[0] * (width - len(r)) + [1] * len(r) for r in rows])
            model.generate(input_ids=ids, attention_mask=mask, adapter_names=which, max_new_tokens=max_tokens,
                           min_new_tokens=max_tokens, do_sample=False, pad_token_id=0)
    return time.perf_counter() - start


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--requests", type=int, default=256)
    ap.add_argument("--adapters", type=int, default=4)
    ap.add_argument("--rank", type=int, default=16)
    ap.add_argument("--max-tokens", type=int, default=32)
    ap.add_argument("--peft-batch", type=int, default=32)
    ap.add_argument("--max-num-seqs", type=int, default=64, help="the engine's rows per batch (EngineConfig)")
    ap.add_argument("--skip-peft", action="store_true")
    args = ap.parse_args()
    torch.manual_seed(0)
    base = builtin_path("builtin:llama-42m")
    rng = random.Random(0)
    prompts = [[rng.randrange(3, 32000) for _ in range(rng.randint(16, 64))] for _ in range(args.requests)]
    sp = SamplingParams(max_tokens=args.max_tokens, temperature=0, ignore_eos=True)
    tokens = args.requests * args.max_tokens
    with tempfile.TemporaryDirectory() as tmp:
        adapters = make_adapters(base, Path(tmp), args.adapters, args.rank)
        requests = [LoRARequest(f"a{k}", k + 1, str(p)) for k, p in enumerate(adapters)]
        loras = [requests[i % args.adapters] for i in range(args.requests)]
        llm = LLMEngine(EngineConfig(model=str(base), enable_lora=True, max_loras=args.adapters,
                                     max_num_seqs=args.max_num_seqs))
        llm.generate(prompts[:8], sp)  # warm up
        llm.generate(prompts[:8], sp, lora_request=loras[:8])
        base_out, base_s = timed(lambda: llm.generate(prompts, sp))
        lora_out, lora_s = timed(lambda: llm.generate(prompts, sp, lora_request=loras))
        # each adapter's rows against its merged model, run alone on the engine
        from peft import PeftModel
        from transformers import AutoModelForCausalLM

        same = True
        for k, path in enumerate(adapters):
            merged = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(base), str(path)).merge_and_unload()
            merged.save_pretrained(Path(tmp) / f"m{k}")
            for f in ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json"):
                if (base / f).exists():
                    (Path(tmp) / f"m{k}" / f).write_bytes((base / f).read_bytes())
            rows = [i for i in range(args.requests) if i % args.adapters == k]
            alone = LLMEngine(EngineConfig(model=str(Path(tmp) / f"m{k}"))).generate([prompts[i] for i in rows], sp)
            same &= all(a.token_ids == lora_out[i].token_ids for a, i in zip(alone, rows))
        peft_s = None if args.skip_peft else peft_mixed(base, adapters, prompts, [f"a{i % args.adapters}"
                                                                                  for i in range(args.requests)],
                                                        args.max_tokens, args.peft_batch)
    result = {"requests": args.requests, "adapters": args.adapters, "rank": args.rank, "max_num_seqs": args.max_num_seqs,
              "base_tok_s": round(tokens / base_s, 1), "lora_tok_s": round(tokens / lora_s, 1),
              "lora_vs_base": round(base_s / lora_s, 3), "tokens_match_merged": same,
              "changed_vs_base": sum(a.token_ids != b.token_ids for a, b in zip(lora_out, base_out))}
    if peft_s is not None:
        result |= {"peft_tok_s": round(tokens / peft_s, 1), "lora_vs_peft": round(peft_s / lora_s, 2)}
    print(json.dumps(result))


if __name__ == "__main__":
    main()
