"""Quantized models over two ranks (CPU, gloo): GPTQ, AWQ, compressed-tensors W4A16 and W8A8
checkpoints, and int4 quantized while loading, each rank reading its slices tensor by tensor
(packed values, scales and zero points cut on group boundaries) into the kernels. The tokens are
one process's on the same checkpoint; a split that cuts a group fails at load in one line."""
from __future__ import annotations

import pytest
import torch

from engine import EngineConfig, LLMEngine, SamplingParams
from engine.api.errors import ModelLoadError
from engine.quantization import Int4Linear
from engine.quantization.methods import Int8Linear
from test_packed_checkpoints import write
from test_parity import PROMPTS
from test_quantization import calibrated_input_scales, compressed_checkpoint
from test_quantize_on_load import build

PARAMS = SamplingParams(max_tokens=10, temperature=0, ignore_eos=True, logprobs=1)


@pytest.fixture(scope="module")
def source(tmp_path_factory):
    """Hidden 256: every row-parallel shard (o_proj 128 inputs, down_proj 256) holds whole groups."""
    return build(tmp_path_factory.mktemp("tp-quant") / "fp32", hidden=256)


def checkpoint(kind: str, source, out):
    if kind in ("gptq", "awq", "compressed-tensors"):
        return write(kind, source, out)[0]
    if kind.startswith("w8a8"):
        static = calibrated_input_scales(source, 127.0) if kind == "w8a8 static" else None
        compressed_checkpoint(source, out, "int8", input_scales=static)
        return out
    return source  # quantized while loading


SLOW = pytest.mark.slow  # (two ranks start per case: the fast part keeps one 4-bit and one 8-bit format)


@pytest.mark.parametrize("kind, method", [("gptq", None), pytest.param("awq", None, marks=SLOW),
                                          pytest.param("compressed-tensors", None, marks=SLOW),
                                          pytest.param("w8a8", None, marks=SLOW), ("w8a8 static", None),
                                          pytest.param("int4 on load", "int4", marks=SLOW)])
def test_a_quantized_model_runs_over_two_ranks_as_in_one_process(kind, method, source, tmp_path):
    path = checkpoint(kind, source, tmp_path / "ckpt")
    one = LLMEngine(EngineConfig(model=str(path), quantization=method, max_batch_tokens=1024))
    want = one.generate(PROMPTS, PARAMS)
    layer = Int8Linear if kind.startswith("w8a8") else Int4Linear
    with LLMEngine(EngineConfig(model=str(path), quantization=method, max_batch_tokens=1024,
                                tensor_parallel_size=2)) as two:
        assert two.runner.streamed and two.memory["quantization"] == one.memory["quantization"]
        shard = two.runner.model.model.layers[0]
        assert isinstance(shard.self_attn.o_proj, layer) and isinstance(shard.mlp.down_proj, layer)
        assert two.memory["weights_bytes"] < 0.7 * two.memory["unquantized_weights_bytes"]
        ranks = two.memory["rank_weights_bytes"]  # each rank's own, as the manifest records them
        assert len(ranks) == 2 and ranks[0] == two.memory["weights_bytes"] and ranks[1] < ranks[0]  # (no head)
        peaks = two.memory["rank_load_peak_bytes"]  # (rank 0 may reuse memory this process freed: 0 then)
        assert len(peaks) == 2 and peaks[0] == two.memory["load_peak_bytes"] and peaks[1] > 0
        facts = two.facts().record()
        assert facts["rank_weights_bytes"] == ranks and "rank_load_peak_bytes" not in one.facts().record()
        outs = two.generate(PROMPTS, PARAMS)
    agree = sum(a.token_ids == b.token_ids for a, b in zip(want, outs))
    # int4 shards hold one process's groups exactly (only the all-reduce's order of sums differs);
    # W8A8 quantizes each rank's activations over its own inputs: scales of its own
    assert agree >= (len(PROMPTS) if kind != "w8a8" else len(PROMPTS) - 1), f"{kind}: {agree} of {len(PROMPTS)}"
    if kind != "w8a8":  # (static scales: every rank quantizes with the same one, as one process does)
        for a, b in zip(want, outs):
            assert abs(a.logprobs[0][a.token_ids[0]] - b.logprobs[0][b.token_ids[0]]) < 1e-2, kind


def test_a_split_that_cuts_a_group_is_refused_in_one_line(tmp_path):
    """Hidden 128: two ranks would hold 64 of o_proj's 128 inputs, half of a group of 128."""
    path = write("gptq", build(tmp_path / "fp32", hidden=128), tmp_path / "gptq")[0]
    with pytest.raises(ModelLoadError) as err:
        LLMEngine(EngineConfig(model=str(path), tensor_parallel_size=2, max_batch_tokens=1024))
    message = str(err.value)
    assert "\n" not in message
    assert message.endswith("model.layers.0.self_attn.o_proj: group size 128 does not divide its 64 input features "
                            "(each of 2 tensor-parallel ranks holds 64 of its 128)"), message


def test_shard_slices_follow_each_formats_packing(tmp_path, monkeypatch):
    """ShardedFiles cuts GPTQ's tensors (packed along K, zeros packed along N) to the rank's rows of
    K for a row-parallel layer and columns of N for a column-parallel one. It reads from the file
    only the rows it keeps, and a column cut a block of rows at a time: never the whole tensor."""
    from safetensors.torch import save_file

    import engine.quantization.streaming as streaming
    from engine.distributed.tensor_parallel import ShardedFiles
    from engine.quantization.checkpoints import packed_format

    fmt = packed_format({"quant_method": "gptq", "bits": 4, "group_size": 128})
    k, n = 512, 256
    tensors = {"m.o_proj.qweight": torch.arange(k // 8 * n, dtype=torch.int32).view(k // 8, n),
               "m.o_proj.qzeros": torch.arange(k // 128 * n // 8, dtype=torch.int32).view(k // 128, n // 8),
               "m.o_proj.scales": torch.arange(k // 128 * n).view(k // 128, n).half(),
               "m.q_proj.qweight": torch.arange(k // 8 * n, dtype=torch.int32).view(k // 8, n),
               "m.q_proj.qzeros": torch.arange(k // 128 * n // 8, dtype=torch.int32).view(k // 128, n // 8),
               "m.q_proj.g_idx": torch.arange(k, dtype=torch.int32)}
    save_file(tensors, tmp_path / "model.safetensors")
    reads, read = [], streaming._read
    monkeypatch.setattr(streaming, "_read", lambda *a: reads.append(a[2]) or read(*a))
    monkeypatch.setattr(streaming, "SLICE_BLOCK", 4096)  # the column cut reads 4 rows of 1 KiB at a time

    styles = {"o_proj": "row", "q_proj": "column"}
    files = ShardedFiles(streaming.SafetensorsFiles(tmp_path), styles, {}, 1, 2, fmt.layout)
    assert torch.equal(files.get("m.o_proj.qweight"), tensors["m.o_proj.qweight"][32:])
    assert torch.equal(files.get("m.o_proj.qzeros"), tensors["m.o_proj.qzeros"][2:])
    assert torch.equal(files.get("m.o_proj.scales"), tensors["m.o_proj.scales"][2:])
    assert reads == [32 * n * 4, 2 * n // 8 * 4, 2 * n * 2]  # the second half of the rows, and only it
    reads.clear()
    assert torch.equal(files.get("m.q_proj.qweight"), tensors["m.q_proj.qweight"][:, 128:])
    assert reads == [4 * n * 4] * (k // 8 // 4)
    assert torch.equal(files.get("m.q_proj.qzeros"), tensors["m.q_proj.qzeros"][:, 16:])
    assert torch.equal(files.get("m.q_proj.g_idx"), tensors["m.q_proj.g_idx"])  # (a column layer's K: whole)
