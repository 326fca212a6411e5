"""Random PEFT LoRA adapters of the tiny test models, made with peft itself, and the reference a
user trusts: transformers' greedy generate on the adapter's merge_and_unload() model."""
from __future__ import annotations

import json
from pathlib import Path

import torch

ALL_PROJECTIONS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


def make_adapter(base: Path, out: Path, r: int, targets: list[str], seed: int, rslora: bool = False,
                 std: float = 0.3) -> Path:
    """A PEFT adapter of `base` with random A and B (B is zero at PEFT's init: no change at all)."""
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_pretrained(base)
    peft = get_peft_model(model, LoraConfig(r=r, lora_alpha=2 * r, target_modules=targets, use_rslora=rslora,
                                            init_lora_weights=False))
    with torch.no_grad():
        for name, p in peft.named_parameters():
            if "lora_B" in name:
                p.normal_(std=std)
    peft.save_pretrained(out)
    return out


def merged(base: Path, adapter: Path | None):
    """The base model, or the adapter merged into it (PEFT's merge_and_unload), in eval mode."""
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(base)
    if adapter is not None:
        model = PeftModel.from_pretrained(model, str(adapter)).merge_and_unload()
    return model.eval()


def greedy(model, ids: list[int], max_new: int) -> list[int]:
    x = torch.tensor([ids])
    out = model.generate(x, attention_mask=torch.ones_like(x), max_new_tokens=max_new, do_sample=False,
                         eos_token_id=None, pad_token_id=0)
    return out[0, len(ids):].tolist()


def edit_config(adapter: Path, **changes) -> None:
    path = adapter / "adapter_config.json"
    cfg = json.loads(path.read_text())
    cfg.update(changes)
    path.write_text(json.dumps(cfg))
