"""compressed-tensors and FP8 checkpoints, made from SmolLM2 (and tiny random Qwen2 / Mistral models) by the
real tools in .venv-llmcompressor (tests/quant_checkpoints.py), served by Pagoda and compared with HF
transformers loading the same checkpoint: greedy tokens of 10 prompts x 32, and the first step's logprobs.

The fast tests at the top need no tool: the configurations Pagoda refuses, and the FP8 block arithmetic.
"""

from __future__ import annotations

import json
import logging
import shutil

import pytest
import torch

from pagoda.engine_core.config import EngineConfig
from pagoda.engine_core.engine import EngineCore
from pagoda.engine_core.quantization import resolve_method
from pagoda.engine_core.quantization.compressed_tensors import CompressedTensors, unpack_int32
from pagoda.engine_core.quantization.fp8 import dequantize_fp8
from pagoda.kernels.fp8 import Fp8Weight
from tests.helpers import greedy_with_first_logprobs
from tests.quant_checkpoints import checkpoint, ct_decompressed, hf_reference

NEW_TOKENS = 32
# First step: |our logprob - HF's| over our top 20 tokens. Both run the same dequantized weights in
# float32; only summation order differs (oneDNN / our int kernels against HF's matmuls): 5e-5 measured.
LOGPROB_TOLERANCE = 5e-4

SMOLLM2_SCHEMES = ["w4a16", "w4a16-asym", "w8a16", "w8a8", "fp8-channel", "fp8-tensor", "fp8-ct-block", "fp8-block"]
TINY_CASES = [
    ("tiny-qwen2", "w4a16-asym"),
    ("tiny-qwen2", "fp8-channel"),
    ("tiny-mistral", "w8a16-asym"),
    ("tiny-mistral", "w8a8"),
    ("tiny-mistral", "fp8-block-ue8m0"),
]
TEXTS = [
    "The capital of France is",
    'def fibonacci(n):\n    """Return the n-th Fibonacci number."""\n',
    "Question: Why is the sky blue?\nAnswer:",
    "List three colors: red,",
    "The river town woke slowly. Fishermen checked their nets by lantern light while the bakery on the corner "
    "pulled its first loaves from the oven, and the smell of bread drifted over the water.",
    "In computing, a cache is a small, fast store that keeps copies of data likely to be needed again. Caches "
    "trade memory for time: a hit avoids a slow trip to main memory or disk. In summary,",
    "<|im_start|>user\nWrite a haiku about the sea.<|im_end|>\n<|im_start|>assistant\n",
    "Photosynthesis converts light energy into chemical energy. " * 12 + "The main idea is",
    "1, 2, 3, 4, 5,",
]


def smollm2_prompts(tokenizer) -> list[list[int]]:
    return [tokenizer.encode("Once")[:1]] + [tokenizer.encode(t) for t in TEXTS]  # 1 to ~130 tokens


def tiny_prompts() -> list[list[int]]:
    gen = torch.Generator().manual_seed(1)
    return [torch.randint(3, 512, (n,), generator=gen).tolist() for n in (1, 5, 7, 12, 16, 20, 33, 40, 57, 70)]


def serve(model_dir, prompts, **engine_args) -> tuple[list[list[int]], list[dict[int, float]]]:
    """Pagoda's greedy tokens for each prompt, and the first step's top-20 logprobs by token."""
    return greedy_with_first_logprobs(model_dir, prompts, NEW_TOKENS, 20, num_kv_blocks=64, **engine_args)


def assert_matches_hf(model_dir, prompts) -> None:
    expected, hf_logits = hf_reference(model_dir, prompts, NEW_TOKENS)
    ours, first_logprobs = serve(model_dir, prompts)
    same = sum(a == b for a, b in zip(ours, expected, strict=True))
    assert same >= len(prompts) - 1, f"only {same} of {len(prompts)} prompts give HF's tokens"
    hf_logprobs = torch.log_softmax(hf_logits.double(), dim=-1)
    worst = max(abs(lp - float(hf_logprobs[i, t])) for i, top in enumerate(first_logprobs) for t, lp in top.items())
    assert worst <= LOGPROB_TOLERANCE, f"first-step logprobs differ from HF's by up to {worst:.2e}"


# --- the real tools' checkpoints, against HF transformers -------------------------------------------------


@pytest.mark.slow
@pytest.mark.parametrize("scheme", SMOLLM2_SCHEMES)
def test_smollm2_checkpoint_matches_hf(scheme, tokenizer):
    assert_matches_hf(checkpoint("smollm2", scheme), smollm2_prompts(tokenizer))


@pytest.mark.slow
@pytest.mark.parametrize(("source", "scheme"), TINY_CASES)
def test_tiny_checkpoint_matches_hf(source, scheme):
    """Qwen2's QKV biases next to quantized weights, Mistral's sliding window (24) on quantized layers."""
    assert_matches_hf(checkpoint(source, scheme), tiny_prompts())


@pytest.mark.slow
@pytest.mark.parametrize(
    ("source", "scheme"),
    [("smollm2", s) for s in ("w4a16", "w4a16-asym", "w8a16", "w8a8", "fp8-channel", "fp8-tensor", "fp8-ct-block")]
    + [("tiny-mistral", "w8a16-asym")],
)
def test_our_unpacking_equals_compressed_tensors_decompression(source, scheme):
    """Independent unpacker: compressed-tensors' own decompressor on the checkpoint's tensors of some
    layers (a merged QKV shard, a gate shard, a down projection) gives our dequantized weights."""
    model_dir = checkpoint(source, scheme)
    config = json.loads((model_dir / "config.json").read_text())
    method = resolve_method("auto", config)
    modules = ["model.layers.0.self_attn.k_proj", "model.layers.1.mlp.gate_proj", "model.layers.2.mlp.down_proj"]
    theirs = ct_decompressed(model_dir, modules)
    from safetensors import safe_open

    with safe_open(str(model_dir / "model.safetensors"), framework="pt") as f:
        for module in modules:
            tensors = {k.rpartition(".")[2]: f.get_tensor(k) for k in f.keys() if k.startswith(module + ".")}  # noqa: SIM118
            n, k = theirs[module].shape
            ours = method.from_checkpoint(module, tensors, n, k)
            ours = ours if isinstance(ours, torch.Tensor) else ours.dequantize()
            # q * scale + min against (q - zero) * scale, both in float32: a rounding apart at most
            torch.testing.assert_close(ours, theirs[module].float(), rtol=0, atol=1e-6 * float(ours.abs().max()))


# --- FP8 at load, and the per-tensor `quant_method: fp8` layout ------------------------------------------------


@pytest.mark.slow
def test_fp8_at_load_equals_llmcompressor_fp8_per_channel(default_model_dir, tokenizer, caplog):
    """`--quantization fp8` rounds each linear but the LM head as llmcompressor's FP8 recipe does: its
    weights are those of the tool's FP8 checkpoint, and so are the tokens; the log says what it costs."""
    from safetensors import safe_open

    tool_dir = checkpoint("smollm2", "fp8-channel")
    from_tool = resolve_method("auto", json.loads((tool_dir / "config.json").read_text()))
    at_load = resolve_method("fp8", {})
    with (
        safe_open(str(default_model_dir / "model.safetensors"), framework="pt") as full,
        safe_open(str(tool_dir / "model.safetensors"), framework="pt") as fp8,
    ):
        for module in ("model.layers.0.self_attn.q_proj", "model.layers.7.mlp.down_proj"):
            weight = full.get_tensor(module + ".weight")
            tensors = {kind: fp8.get_tensor(f"{module}.{kind}") for kind in ("weight", "weight_scale")}
            ours = at_load.quantize(module, weight)
            theirs = from_tool.from_checkpoint(module, tensors, *weight.shape)
            assert isinstance(ours, Fp8Weight) and isinstance(theirs, Fp8Weight)
            assert torch.equal(ours.weight.view(torch.uint8), theirs.weight.view(torch.uint8))
            assert torch.equal(ours.scale, theirs.scale)
            assert not torch.equal(ours.dequantize(), weight)
        assert at_load.quantize("lm_head", weight) is weight
    prompts = smollm2_prompts(tokenizer)[:5]
    with caplog.at_level(logging.INFO):
        tokens = serve(default_model_dir, prompts, quantization="fp8")[0]
    assert "fp8 (E4M3 per channel, quantized at load" in caplog.text
    assert "FP8 weights dequantized at load to torch.float32 on cpu, so no memory saving" in caplog.text
    assert tokens == serve(tool_dir, prompts)[0]


@pytest.mark.slow
def test_fp8_weights_kept_in_fp8(tokenizer, caplog):
    """`--fp8-matmul on` keeps every FP8 linear in FP8 (`Fp8Weight`, a quarter of float32's bytes), also
    on the CPU, where each is dequantized per step (pagoda.kernels.fp8.reference_linear): the same weights as
    dequantizing at load, so the same tokens up to summation order."""
    model_dir = checkpoint("smollm2", "fp8-channel")
    prompts = smollm2_prompts(tokenizer)
    engine = EngineCore(EngineConfig(model=str(model_dir), num_kv_blocks=64, fp8_matmul="on"))
    linears = {name: m.quantized for name, m in engine.runner.model.named_modules() if hasattr(m, "quantized")}
    fp8_layers = [name for name, q in linears.items() if isinstance(q, Fp8Weight)]
    assert len(fp8_layers) == len(linears) - 1 and "lm_head" not in fp8_layers  # the recipe's ignore list
    off = EngineCore(EngineConfig(model=str(model_dir), num_kv_blocks=64, fp8_matmul="off"))
    assert not any(isinstance(getattr(m, "quantized", None), Fp8Weight) for m in off.runner.model.modules())
    kept_bytes, float_bytes = engine.runner.weight_bytes, off.runner.weight_bytes
    embedding = engine.runner.model.lm_head.weight_bytes()  # tied LM head, float32 in both
    assert kept_bytes - embedding < 0.26 * (float_bytes - embedding)
    del engine, off
    with caplog.at_level(logging.INFO):
        kept = serve(model_dir, prompts, fp8_matmul="on")
    assert "FP8 weights kept in FP8 on cpu (--fp8-matmul on)" in caplog.text
    dequantized = serve(model_dir, prompts, fp8_matmul="off")
    same = sum(a == b for a, b in zip(kept[0], dequantized[0], strict=True))
    assert same >= len(prompts) - 1
    pairs = [(lp, dequantized[1][i].get(t)) for i, top in enumerate(kept[1]) for t, lp in top.items()]
    assert max(abs(a - b) for a, b in pairs if b is not None) <= LOGPROB_TOLERANCE


@pytest.mark.slow
def test_fp8_per_tensor_weight_scale_layout(tmp_path, tokenizer):
    """A `quant_method: fp8` checkpoint without weight_block_size holds one `weight_scale` per tensor
    (AutoFP8 / vLLM's layout): the same tensors as compressed-tensors' per-tensor FP8, so the same tokens."""
    source = checkpoint("smollm2", "fp8-tensor")
    model_dir = tmp_path / "autofp8-layout"
    model_dir.mkdir()
    for path in source.iterdir():
        if path.name != "config.json":
            (model_dir / path.name).symlink_to(path)
    config = json.loads((source / "config.json").read_text())
    config["quantization_config"] = {
        "quant_method": "fp8",
        "activation_scheme": "dynamic",
        "ignored_layers": ["lm_head"],
    }
    (model_dir / "config.json").write_text(json.dumps(config))
    prompts = smollm2_prompts(tokenizer)[:4]
    assert serve(model_dir, prompts)[0] == serve(source, prompts)[0]


# --- what is refused, and how -----------------------------------------------------------------------------


def _ct_config(fmt="pack-quantized", **weights) -> dict:
    args = dict(num_bits=4, type="int", symmetric=True, strategy="group", group_size=64) | weights
    group = {"targets": ["Linear"], "weights": args, "input_activations": None, "format": fmt}
    return {
        "quantization_config": {
            "quant_method": "compressed-tensors",
            "format": fmt,
            "config_groups": {"group_0": group},
            "ignore": ["lm_head"],
            "quantization_status": "compressed",
        }
    }


@pytest.mark.parametrize(
    ("change", "message"),
    [
        (dict(fmt="marlin-24"), r"format 'marlin-24' is not supported; supported: pack-quantized, int-quantized"),
        (dict(fmt="naive-quantized"), r"format 'naive-quantized' is not supported"),
        (dict(num_bits=2), r"int 2-bit weights is not supported; supported: int 4 or 8-bit"),
        (dict(num_bits=3), r"int 3-bit weights is not supported"),
        (dict(fmt="int-quantized", num_bits=4), r"int-quantized with int 4-bit weights .* supported: int 8-bit"),
        (dict(group_size=16), r"group_size 16 is not supported; supported: multiples of 32"),
        (dict(strategy="block", group_size=None, block_structure=[64, 64]), r"strategy 'block' is not supported"),
        (dict(actorder="group"), r"actorder 'group' .* is not supported"),
        (dict(fmt="float-quantized", type="float", num_bits=4), r"only FP8"),
        (dict(fmt="float-quantized", type="float", num_bits=8, strategy="group"), r"strategy 'group': supported"),
        (dict(fmt="float-quantized", type="float", num_bits=8, symmetric=False), r"zero points .* only symmetric"),
    ],
)
def test_unsupported_compressed_tensors_schemes_are_named(change, message):
    fmt = change.pop("fmt", "pack-quantized")
    with pytest.raises(ValueError, match=message):
        resolve_method("auto", _ct_config(fmt, **change))


@pytest.mark.parametrize(
    ("key", "value", "message"),
    [
        ("kv_cache_scheme", {"num_bits": 8, "type": "float"}, r"KV-cache quantization"),
        ("sparsity_config", {"format": "sparse-24-bitmask"}, r"sparsity"),
        ("transform_config", {"config_groups": {"u": {}}}, r"transforms"),
        ("quantization_status", "frozen", r"only 'compressed' checkpoints"),
    ],
)
def test_unsupported_compressed_tensors_features_are_named(key, value, message):
    config = _ct_config()
    config["quantization_config"][key] = value
    with pytest.raises(ValueError, match=message):
        resolve_method("auto", config)


def test_mixed_schemes_and_flag_mismatches_are_refused():
    config = _ct_config()
    groups = config["quantization_config"]["config_groups"]
    groups["group_1"] = json.loads(json.dumps(groups["group_0"]))
    groups["group_1"]["weights"]["num_bits"] = 8
    with pytest.raises(ValueError, match=r"several weight schemes \(mixed precision\)"):
        resolve_method("auto", config)
    with pytest.raises(ValueError, match=r"already quantized with 'compressed-tensors'; --quantization int4 cannot"):
        resolve_method("int4", _ct_config())
    with pytest.raises(ValueError, match=r"already quantized with 'compressed-tensors'; --quantization fp8 cannot"):
        resolve_method("fp8", _ct_config())
    fp8 = {"quantization_config": {"quant_method": "fp8", "weight_block_size": [128, 128]}}
    with pytest.raises(ValueError, match=r"already quantized with 'fp8'; --quantization int8 cannot"):
        resolve_method("int8", fp8)
    with pytest.raises(ValueError, match=r"fmt 'e5m2': only e4m3"):
        resolve_method("auto", {"quantization_config": {"quant_method": "fp8", "fmt": "e5m2"}})
    with pytest.raises(ValueError, match=r"--quantization compressed-tensors: the checkpoint is not quantized"):
        resolve_method("compressed-tensors", {})


def test_describe_and_log_say_what_is_served(caplog):
    w4 = resolve_method("auto", _ct_config(symmetric=False))
    assert isinstance(w4, CompressedTensors)
    assert w4.describe() == "compressed-tensors pack-quantized (INT4 weights, scales groups of 64, with zero points)"
    w8a8 = _ct_config("int-quantized", num_bits=8, strategy="channel", group_size=None)
    activations = {"num_bits": 8, "type": "int", "strategy": "token", "dynamic": True, "symmetric": True}
    w8a8["quantization_config"]["config_groups"]["group_0"]["input_activations"] = activations
    with caplog.at_level(logging.WARNING):
        described = resolve_method("auto", w8a8).describe()
    assert "W8A8 served weight-only: activations in float, not INT8 dynamic per token" in described
    assert "quantizes activations too (INT8 dynamic per token); Pagoda serves it weight-only" in caplog.text


def test_unpack_int32_takes_values_from_the_low_bits_up():
    words = torch.tensor([[0x76543210, 0x0000FEDC]], dtype=torch.int64).to(torch.int32)
    assert unpack_int32(words, 4, 11).tolist() == [[0, 1, 2, 3, 4, 5, 6, 7, 12, 13, 14]]
    negative = torch.tensor([[-0x7F7F7F80]], dtype=torch.int32)  # bytes 0x80 0x80 0x80 0x80
    assert unpack_int32(negative, 8, 4).tolist() == [[128, 128, 128, 128]]


def test_fp8_block_scales_cover_partial_blocks():
    """[ceil(N/bn), ceil(K/bk)] scales: the last row and column blocks are partial (N=5, K=7, blocks 2x4)."""
    weight = torch.linspace(-2, 2, 35).reshape(5, 7).to(torch.float8_e4m3fn)
    scales = torch.arange(1.0, 7.0).reshape(3, 2)
    expected = torch.stack([weight.float()[i, j] * scales[i // 2, j // 4] for i in range(5) for j in range(7)])
    assert torch.equal(dequantize_fp8("w", weight, scales, (2, 4)), expected.reshape(5, 7))
    with pytest.raises(ValueError, match=r"block scales have shape \(2, 2\), expected \(3, 2\)"):
        dequantize_fp8("w", weight, scales[:2], (2, 4))
    with pytest.raises(ValueError, match=r"only float8_e4m3fn"):
        dequantize_fp8("w", weight.float().to(torch.float8_e5m2), scales, (2, 4))


# --- bad checkpoints, refused before anything is served ---------------------------------------------------------


def _copy_of(source, target):
    target.mkdir()
    for path in source.iterdir():
        (target / path.name).symlink_to(path)
    return target


@pytest.mark.slow
def test_bad_checkpoints_are_refused_at_load(tmp_path):
    source = checkpoint("smollm2", "w4a16")

    truncated = _copy_of(source, tmp_path / "truncated")
    (truncated / "model.safetensors").unlink()
    with open(source / "model.safetensors", "rb") as f:
        (truncated / "model.safetensors").write_bytes(f.read(10_000_000))
    with pytest.raises(ValueError, match=r"model.safetensors is not a complete safetensors file"):
        EngineCore(EngineConfig(model=str(truncated), num_kv_blocks=16))

    with pytest.raises(ValueError, match=r"already quantized with 'compressed-tensors'; --quantization int4 cannot"):
        EngineCore(EngineConfig(model=str(source), quantization="int4", num_kv_blocks=16))

    for name, edit, message in [
        ("bits", lambda w: w.update(num_bits=3), r"int 3-bit weights is not supported; supported: int 4 or 8-bit"),
        ("marlin", None, r"format 'marlin-24' is not supported"),
    ]:
        model_dir = _copy_of(source, tmp_path / name)
        (model_dir / "config.json").unlink()
        config = json.loads((source / "config.json").read_text())
        qcfg = config["quantization_config"]
        if edit is not None:
            edit(qcfg["config_groups"]["group_0"]["weights"])
        else:
            qcfg["format"] = qcfg["config_groups"]["group_0"]["format"] = "marlin-24"
        (model_dir / "config.json").write_text(json.dumps(config))
        with pytest.raises(ValueError, match=message):
            EngineCore(EngineConfig(model=str(model_dir), num_kv_blocks=16))

    # A linear whose scales are missing from the file: named, not served with garbage.
    from safetensors.torch import load_file, save_file

    missing = tmp_path / "missing-scale"
    shutil.copytree(source, missing)
    tensors = load_file(str(missing / "model.safetensors"))
    del tensors["model.layers.3.mlp.up_proj.weight_scale"]
    save_file(tensors, str(missing / "model.safetensors"))
    with pytest.raises(ValueError, match=r"missing \['weight_scale'\] of layers.3.mlp.gate_up_proj \(shard 1\)"):
        EngineCore(EngineConfig(model=str(missing), num_kv_blocks=16))


# --- what the server says about it ----------------------------------------------------------------------------


@pytest.mark.slow
def test_models_endpoint_and_startup_log_name_the_quantization(tmp_path):
    """`/v1/models` (through the OpenAI client) and the start-up log show describe() and the weights' bytes."""
    import openai

    from pagoda.api_proc.bench.local_server import PagodaServer

    model_dir = checkpoint("smollm2", "w4a16")
    server = PagodaServer(tmp_path, "--model", str(model_dir))
    try:
        client = openai.OpenAI(base_url=server.base_url + "/v1", api_key="unused", max_retries=0)
        (model,) = client.models.list().data
        described = "compressed-tensors pack-quantized (INT4 weights, scales groups of 64, symmetric)"
        assert model.model_extra["quantization"] == described
        weight_bytes = model.model_extra["weight_bytes"]
        # The float32 embedding table (the tied LM head the recipe left unquantized), 108 MiB, and 106 M
        # weights of linears at half a byte plus a float32 scale and min per 64: 63 MiB (float32: 513 MiB)
        assert 165 * 2**20 < weight_bytes < 175 * 2**20
        assert f"Weights: {described}, {weight_bytes / 2**20:.1f} MiB in memory" in server.log()
        completion = client.completions.create(model=model.id, prompt="The capital of France is", max_tokens=4)
        assert "Paris" in completion.choices[0].text  # (served, and right)
    finally:
        assert server.stop() == 0, server.log()[-2000:]
