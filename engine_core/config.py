"""The engine's configuration: one typed object, built once from CLI flags or keyword arguments, and
the command-line flags that build it (every command that runs an engine adds them)."""

from __future__ import annotations

import argparse
import re
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from pagoda.engine_core.cpu_binding import check_spec as check_cpu_spec
from pagoda.engine_core.quantization import CHOICES as QUANTIZATION_CHOICES
from pagoda.engine_core.structured_limits import (
    COMPILE_TIMEOUT_FLAG,
    MAX_BYTES_FLAG,
    MAX_CHOICES_FLAG,
    MAX_PROPERTIES_FLAG,
    StructuredOutputLimits,
)

if TYPE_CHECKING:  # torch is imported lazily: the server's parent and frontends never load it
    import torch


_SIZE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([KMGT]?)(i?)B?\s*$", re.IGNORECASE)


def parse_size(text: str | int) -> int:
    """'2GiB', '512MiB', '1.5G', '1000000' -> bytes (K/M/G/T with or without 'i' are powers of 1024)."""
    if isinstance(text, int):
        return text
    match = _SIZE.match(text)
    if not match:
        raise ValueError(f"cannot read {text!r} as a size (e.g. 2GiB, 512MiB)")
    number, unit = float(match.group(1)), match.group(2).upper()
    return int(number * 1024 ** " KMGT".index(unit or " "))


RUNNERS = ("auto", "generate", "pooling")
POOLING_TYPES = ("mean", "cls", "last")
_DTYPES = {"float32": "float32", "float": "float32", "bfloat16": "bfloat16", "float16": "float16", "half": "float16"}


def resolve_dtype(name: str, device: torch.device) -> torch.dtype:
    """'auto' = float32 on the CPU (the fast dtype there), bfloat16 on CUDA."""
    import torch

    if name == "auto":
        return torch.bfloat16 if device.type == "cuda" else torch.float32
    try:
        return getattr(torch, _DTYPES[name])
    except KeyError:
        raise ValueError(f"unknown dtype {name!r}; choose auto, float32, bfloat16 or float16") from None


KV_CACHE_DTYPES = ("auto", "float16")


def resolve_kv_cache_dtype(name: str, model_dtype: torch.dtype, device: torch.device) -> torch.dtype:
    """The KV cache's dtype: the model's (auto), or float16. A float16 cache under a float32 model is a
    CPU option (half the memory and the bytes attention reads, each K/V value rounded to float16); on
    CUDA the cache holds the model's dtype, 16-bit already unless the model runs in float32."""
    import torch

    if name == "auto" or getattr(torch, name) == model_dtype:
        return model_dtype
    if name == "float16" and device.type == "cpu" and model_dtype == torch.float32:
        return torch.float16
    if device.type == "cpu":  # (a 16-bit model's cache is 16-bit already: float16 would only lose range)
        raise ValueError(f"--kv-cache-dtype {name} needs a float32 model on the CPU (--dtype float32)")
    raise ValueError(
        f"--kv-cache-dtype {name} is for the CPU; on {device.type} the KV cache holds the model's dtype "
        f"({str(model_dtype).removeprefix('torch.')}): choose it with --dtype"
    )


@dataclass(frozen=True)
class EngineConfig:
    model: str | None = None  # None = the default model
    dtype: str = "auto"
    device: str = "auto"  # auto = cuda when available, else cpu
    block_size: int = 16
    kv_cache_memory: int | None = None  # bytes for the KV pool; None = 2 GiB on CPU, profiled on CUDA
    kv_cache_dtype: str = "auto"  # auto = the model's dtype; float16 (CPU): half the cache's bytes
    gpu_memory_utilization: float = 0.9  # CUDA: share of the card this process may use, KV pool included
    enforce_eager: bool = False  # CUDA: no graph capture for decode steps
    load_format: str = "auto"  # auto = the checkpoint's safetensors; dummy = random weights (benchmarks)
    int8_activations: bool = True  # CPU with VNNI: quantized linears round decode-sized inputs to int8
    quantization: str = "auto"  # auto = what the checkpoint says; none; a format; int8/int4/fp8 = at load
    fp8_matmul: str = "auto"  # FP8 weights: auto = kept in FP8 where the GPU multiplies in FP8; on; off
    num_kv_blocks: int | None = None  # overrides kv_cache_memory when set (tests)
    max_num_batched_tokens: int = 2048
    # See Scheduler: how many prefill tokens several requests may share a step with. 384 rather than 256: a
    # burst of 128-token prompts then joins the running decodes three at a time instead of two, in fewer
    # steps, each of which pays its fixed costs once (served here, 64 streams: 428-430 -> 447-465 tok/s,
    # median TTFT 0.59 -> 0.68-0.76 s; 16 streams: 303-311 -> 324-328 tok/s, TPOT 49 -> 45 ms, TTFT 0.43
    # -> 0.54-0.56 s). 512 was level on throughput with a longer TTFT, 768 and 1024 slower served.
    max_joint_prefill_tokens: int = 384
    max_num_seqs: int = 128
    enable_prefix_caching: bool = True
    # Models with recurrent layers: states kept at block boundaries of prompts, which a cached prefix resumes
    # from (engine_core/state_snapshots.py); 0 turns prefix caching off for them.
    recurrent_state_snapshots: int = 16
    max_model_len: int | None = None  # default: the model's max_position_embeddings
    seed: int = 0
    num_threads: int | None = None  # torch intra-op threads on CPU (per rank); default = torch's choice
    tensor_parallel_size: int = 1  # ranks each layer is split over (docs/parallel.md)
    pipeline_parallel_size: int = 1  # stages the layers are split into, each with its tensor-parallel ranks
    # Mixtures of experts under tensor parallel: whole experts per rank instead of each expert split over
    # the ranks (vLLM's flag; a no-op at tensor_parallel_size 1 and for dense models, as there)
    enable_expert_parallel: bool = False
    # Which replica this engine is: on CUDA its GPUs start at this x its ranks (tensor x pipeline parallel).
    data_parallel_rank: int = 0
    # CPU cores per engine process (engine_core/cpu_binding.py): "auto", "none" or "0-3|4-7"; one
    # process (no data or tensor parallelism) is pinned only by an explicit group.
    cpu_threads_bind: str = "auto"
    # Speculative decoding (engine_core/speculative): vLLM's JSON, e.g. '{"method": "ngram"}'
    speculative_config: str | None = None
    speculative_disable_batch_size: int | None = None  # overrides the JSON's disable_batch_size
    # What the engine does with the model (docs/embeddings.md): "generate"; "pooling" (embeddings; no KV
    # cache); "auto" = pooling for an encoder (BertModel), else generate. How a pooling model pools and
    # whether it normalizes come from its sentence-transformers files unless set here.
    runner: str = "auto"
    pooling_type: str | None = None  # "mean", "cls" or "last"
    normalize: bool | None = None
    # Structured output (docs/structured-output.md#limits): the largest constraint accepted (None = no
    # limit), seconds one grammar compile may run (None = no limit), and compiles at once.
    structured_output_max_bytes: int | None = StructuredOutputLimits.max_bytes
    structured_output_max_properties: int | None = StructuredOutputLimits.max_properties
    structured_output_max_choices: int | None = StructuredOutputLimits.max_choices
    structured_output_compile_timeout: float | None = 10.0
    structured_output_compile_workers: int = 2

    def __post_init__(self):
        if self.runner not in RUNNERS:
            raise ValueError(f"runner must be one of {', '.join(RUNNERS)}")
        if self.pooling_type is not None and self.pooling_type not in POOLING_TYPES:
            raise ValueError(f"pooling_type must be one of {', '.join(POOLING_TYPES)}")
        if self.block_size not in (8, 16, 32, 64, 128):
            raise ValueError("block_size must be one of 8, 16, 32, 64, 128")
        if self.max_num_batched_tokens < 1 or self.max_num_seqs < 1 or self.max_joint_prefill_tokens < 1:
            raise ValueError("max_num_batched_tokens, max_joint_prefill_tokens and max_num_seqs must be positive")
        if self.recurrent_state_snapshots < 0:
            raise ValueError("recurrent_state_snapshots must be 0 or more")
        if self.kv_cache_dtype not in KV_CACHE_DTYPES:
            raise ValueError(f"kv_cache_dtype must be one of {', '.join(KV_CACHE_DTYPES)}")
        if self.load_format not in ("auto", "dummy"):
            raise ValueError("load_format must be auto or dummy")
        if self.quantization not in QUANTIZATION_CHOICES:
            raise ValueError(f"quantization must be one of {', '.join(QUANTIZATION_CHOICES)}")
        if self.fp8_matmul not in ("auto", "on", "off"):
            raise ValueError("fp8_matmul must be auto, on or off")
        if not 0.0 < self.gpu_memory_utilization <= 1.0:
            raise ValueError("gpu_memory_utilization must be in (0, 1]")
        if self.tensor_parallel_size < 1 or self.pipeline_parallel_size < 1:
            raise ValueError("tensor_parallel_size and pipeline_parallel_size must be at least 1")
        check_cpu_spec(self.cpu_threads_bind)
        if self.structured_output_compile_workers < 1:
            raise ValueError("structured_output_compile_workers must be at least 1")
        from pagoda.engine_core.speculative.config import SpeculativeConfig

        speculative = SpeculativeConfig.parse(self.speculative_config, self.speculative_disable_batch_size)
        if speculative is not None and self.pipeline_parallel_size > 1:
            raise ValueError("speculative decoding and pipeline parallel do not combine yet")
        if (
            speculative is not None
            and speculative.model is not None
            and not Path(speculative.model).expanduser().exists()
        ):
            raise ValueError(
                f"--speculative-config: the draft model {speculative.model!r} does not exist "
                "(a Hugging Face model directory or a .gguf file)"
            )

    def structured_limits(self) -> StructuredOutputLimits:
        return StructuredOutputLimits(
            self.structured_output_max_bytes, self.structured_output_max_properties, self.structured_output_max_choices
        )

    @property
    def num_ranks(self) -> int:
        """Processes one engine runs on: tensor-parallel ranks times pipeline stages."""
        return self.tensor_parallel_size * self.pipeline_parallel_size

    def torch_device(self) -> torch.device:
        import torch

        device = torch.device(
            ("cuda" if torch.cuda.is_available() else "cpu") if self.device == "auto" else self.device
        )
        if device.type == "cuda" and self.data_parallel_rank:  # each replica on GPUs of its own
            device = torch.device("cuda", (device.index or 0) + self.data_parallel_rank * self.num_ranks)
        return device


def add_engine_args(parser: argparse.ArgumentParser) -> None:
    """Flags that build an EngineConfig; shared by every command that runs an engine."""
    g = parser.add_argument_group("engine")
    g.add_argument(
        "--model",
        default=None,
        help="Hugging Face model directory, .gguf file or hub id (default: SmolLM2-135M-Instruct, made on first use)",
    )
    g.add_argument(
        "--dtype",
        default="auto",
        choices=["auto", "float32", "bfloat16", "float16"],
        help="weights and activations dtype; auto = float32 on CPU, bfloat16 on CUDA",
    )
    g.add_argument("--device", default="auto", help="auto, cpu or cuda[:N]")
    g.add_argument("--block-size", type=int, default=16, help="tokens per KV cache block")
    g.add_argument(
        "--kv-cache-memory",
        default=None,
        help="memory for the KV cache pool, e.g. 2GiB, 512MiB (default: 2GiB on CPU; on CUDA what "
        "--gpu-memory-utilization leaves after weights, the profiled activation peak and graphs)",
    )
    g.add_argument(
        "--kv-cache-dtype",
        default="auto",
        choices=KV_CACHE_DTYPES,
        help="auto = the model's dtype; float16 (CPU, float32 models): the cache holds each K/V value rounded "
        "to float16, twice the tokens in the same memory and attention reading half the bytes",
    )
    g.add_argument(
        "--gpu-memory-utilization",
        type=float,
        default=0.9,
        help="CUDA: share of the GPU's memory this server may use in all, KV cache included",
    )
    g.add_argument(
        "--load-format",
        default="auto",
        choices=["auto", "dummy"],
        help="dummy = random weights of the model's shape, no checkpoint needed (benchmarks)",
    )
    g.add_argument(
        "--quantization",
        "-q",
        default="auto",
        choices=QUANTIZATION_CHOICES,
        help="auto = what the checkpoint says (GPTQ, AWQ, compressed-tensors, FP8, GGUF); none = refuse a "
        "quantized checkpoint; int8 / int4 / fp8 = quantize a full-precision checkpoint at load (docs/quantization.md)",
    )
    g.add_argument(
        "--fp8-matmul",
        default="auto",
        choices=["auto", "on", "off"],
        help="FP8 weights (FP8 checkpoints, -q fp8): auto = kept in FP8 and multiplied on FP8 tensor cores "
        "where the GPU has them (compute capability >= 8.9, bfloat16), dequantized at load elsewhere; off = "
        "always dequantized at load; on = always kept in FP8 (on the CPU: a quarter of float32's weight "
        "memory, but each layer is dequantized per step, which is slow)",
    )
    g.add_argument(
        "--int8-activations",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="CPU with AVX-512 VNNI or AVX-VNNI, quantized models: below prefill sizes, round each input row "
        "of a quantized linear (and every row of quantized MoE experts) to int8, one scale per 32 columns, and "
        "use integer dot products (W8A8 / W4A8): "
        "faster decode (on by default; elsewhere it changes nothing). --no-int8-activations keeps float "
        "activations, whose tokens are those of the dequantized weights",
    )
    g.add_argument(
        "--enforce-eager",
        action="store_true",
        help="CUDA: run decode steps eagerly instead of replaying captured CUDA graphs",
    )
    g.add_argument(
        "--max-num-batched-tokens",
        type=int,
        default=2048,
        help="token budget of one engine step (longer prompts are prefilled in chunks)",
    )
    g.add_argument(
        "--max-joint-prefill-tokens",
        type=int,
        default=EngineConfig.max_joint_prefill_tokens,
        help="a lone prompt may use the whole step budget; several prompts share a step only up to "
        "this many prefill tokens (lower = first tokens sooner when many requests arrive at once)",
    )
    g.add_argument("--max-num-seqs", type=int, default=128, help="most requests running at once")
    g.add_argument(
        "--no-prefix-caching",
        dest="enable_prefix_caching",
        action="store_false",
        help="turn automatic prefix caching off (on by default)",
    )
    g.add_argument(
        "--recurrent-state-snapshots",
        type=int,
        default=EngineConfig.recurrent_state_snapshots,
        help="models with recurrent layers (Qwen3.5): how many states to keep at prompt block boundaries for "
        "prefix caching, each a copy of every recurrent layer's state (0: no prefix caching for them)",
    )
    g.add_argument(
        "--max-model-len",
        type=int,
        default=None,
        help="context length limit (default: the model's max_position_embeddings)",
    )
    g.add_argument("--seed", type=int, default=0, help="seed for requests that do not set their own")
    g.add_argument(
        "--num-threads",
        type=int,
        default=None,
        help="CPU threads for torch (default: all cores; under tensor or pipeline parallel, per rank: its share of "
        "the cores)",
    )
    g.add_argument(
        "--tensor-parallel-size",
        "-tp",
        type=int,
        default=1,
        help="split the model over this many processes (ranks), each holding a share of every layer's heads "
        "and rows and of the KV cache: one GPU each on CUDA (NCCL), an equal share of the cores on the CPU "
        "(gloo); docs/parallel.md",
    )
    g.add_argument(
        "--pipeline-parallel-size",
        "-pp",
        type=int,
        default=1,
        help="split the model's layers into this many contiguous stages, each run by its own "
        "--tensor-parallel-size ranks, with up to this many steps in flight (one per stage); docs/parallel.md",
    )
    g.add_argument(
        "--enable-expert-parallel",
        action="store_true",
        help="mixture-of-experts models under tensor parallel: place whole experts on the ranks (a contiguous "
        "range each) instead of splitting every expert over them; attention stays split by heads. No effect at "
        "--tensor-parallel-size 1 or on a dense model; docs/parallel.md",
    )
    g.add_argument(
        "--speculative-config",
        default=None,
        metavar="JSON",
        help='speculative decoding, vLLM\'s spelling: \'{"method": "ngram", "num_speculative_tokens": 4, '
        '"prompt_lookup_min": 2, "prompt_lookup_max": 5}\' (docs/speculative-decoding.md)',
    )
    g.add_argument(
        "--speculative-disable-batch-size",
        type=int,
        default=None,
        metavar="N",
        help="no speculation in a step with more running requests than this (default 4, measured here)",
    )
    g.add_argument(
        "--cpu-threads-bind",
        default="auto",
        metavar="SPEC",
        help="CPU cores of each engine process: auto = the machine's cores divided evenly among them (no "
        "pinning with one process); none = no pinning; '0-3|4-7' = one group per process "
        "(e.g. per --data-parallel-size replica), which then uses one torch thread per core",
    )

    add_structured_output_args(parser)
    p = parser.add_argument_group("pooling (embedding models)")
    p.add_argument(
        "--runner",
        default="auto",
        choices=RUNNERS,
        help="generate text, or pool prompts into embeddings (no KV cache; /v1/embeddings and /pooling); auto = "
        "pooling for an encoder (BertModel), generate otherwise: a decoder embedder (Qwen3-Embedding) needs "
        "--runner pooling (docs/embeddings.md)",
    )
    p.add_argument(
        "--pooling-type",
        default=None,
        choices=POOLING_TYPES,
        help="how a pooling model turns its hidden states into one embedding: mean of all tokens, the first "
        "(CLS) token, or the last token (default: the model's sentence-transformers 1_Pooling/config.json; else "
        "cls for encoders, last for decoders)",
    )
    p.add_argument(
        "--normalize",
        default=None,
        action=argparse.BooleanOptionalAction,
        help="L2-normalize embeddings (default: yes if the model's sentence-transformers modules.json lists a "
        "Normalize module, or if it has no modules.json)",
    )


def _size_or_off(text: str) -> int | None:
    try:
        return parse_size(text) or None
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def _count_or_off(text: str) -> int | None:
    count = int(text)
    if count < 0:
        raise argparse.ArgumentTypeError(f"expected 0 (no limit) or a positive number, not {text!r}")
    return count or None


def _seconds_or_off(text: str) -> float | None:
    seconds = float(text)
    if not seconds >= 0 or seconds == float("inf"):
        raise argparse.ArgumentTypeError(f"expected a number of seconds (0 = no limit), not {text!r}")
    return seconds or None


def add_structured_output_args(parser: argparse.ArgumentParser) -> None:
    """Limits on structured-output constraints (engine_core/structured_limits.py): each refusal is a
    400 that names its flag."""
    limits = StructuredOutputLimits()
    g = parser.add_argument_group("structured output")
    g.add_argument(
        MAX_BYTES_FLAG,
        type=_size_or_off,
        default=limits.max_bytes,
        metavar="SIZE",
        help="largest constraint: a JSON schema, regex, grammar or list of choices, as text (e.g. 128KiB; "
        "400 above; 0 = no limit)",
    )
    g.add_argument(
        MAX_PROPERTIES_FLAG,
        type=_count_or_off,
        default=limits.max_properties,
        metavar="N",
        help="most object properties in a JSON schema, all levels counted (400 above; 0 = no limit)",
    )
    g.add_argument(
        MAX_CHOICES_FLAG,
        type=_count_or_off,
        default=limits.max_choices,
        metavar="N",
        help="most strings in a choice constraint (400 above; 0 = no limit)",
    )
    g.add_argument(
        COMPILE_TIMEOUT_FLAG,
        type=_seconds_or_off,
        default=EngineConfig.structured_output_compile_timeout,
        metavar="SECONDS",
        help="seconds one grammar compile may run; then it is stopped and its requests get a 400 (0 = no limit)",
    )
    g.add_argument(
        "--structured-output-compile-workers",
        type=int,
        default=EngineConfig.structured_output_compile_workers,
        metavar="N",
        help="grammar compiles at once, each in a worker process of the engine (smallest spec first when all are busy)",
    )


def engine_config_from_args(args: argparse.Namespace) -> EngineConfig:
    return EngineConfig(
        model=args.model,
        dtype=args.dtype,
        device=args.device,
        block_size=args.block_size,
        kv_cache_memory=parse_size(args.kv_cache_memory) if args.kv_cache_memory else None,
        kv_cache_dtype=args.kv_cache_dtype,
        gpu_memory_utilization=args.gpu_memory_utilization,
        enforce_eager=args.enforce_eager,
        load_format=args.load_format,
        quantization=args.quantization,
        int8_activations=args.int8_activations,
        fp8_matmul=args.fp8_matmul,
        max_num_batched_tokens=args.max_num_batched_tokens,
        max_joint_prefill_tokens=args.max_joint_prefill_tokens,
        max_num_seqs=args.max_num_seqs,
        max_model_len=args.max_model_len,
        enable_prefix_caching=args.enable_prefix_caching,
        recurrent_state_snapshots=args.recurrent_state_snapshots,
        seed=args.seed,
        num_threads=args.num_threads,
        tensor_parallel_size=args.tensor_parallel_size,
        pipeline_parallel_size=args.pipeline_parallel_size,
        enable_expert_parallel=args.enable_expert_parallel,
        speculative_config=args.speculative_config,
        speculative_disable_batch_size=args.speculative_disable_batch_size,
        cpu_threads_bind=args.cpu_threads_bind,
        runner=args.runner,
        pooling_type=args.pooling_type,
        normalize=args.normalize,
        structured_output_max_bytes=args.structured_output_max_bytes,
        structured_output_max_properties=args.structured_output_max_properties,
        structured_output_max_choices=args.structured_output_max_choices,
        structured_output_compile_timeout=args.structured_output_compile_timeout,
        structured_output_compile_workers=args.structured_output_compile_workers,
    )
