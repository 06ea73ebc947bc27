"""What clients are told Pagoda and its default model are called: the version (GET /version) and the
name the default model is served under (GET /v1/models, the `model` field of every response).

No imports beyond the standard library: any process may use this.
"""

from __future__ import annotations

from importlib import metadata

DISTRIBUTION = "pagoda-llm"  # [project] name in pyproject.toml
# The default model (engine_core/default_model.py) is served under its Hugging Face id, so clients
# written for the hub's model name work unchanged.
DEFAULT_SERVED_MODEL_NAME = "HuggingFaceTB/SmolLM2-135M-Instruct"
UNKNOWN_VERSION = "0+unknown"  # run from a source tree that was never installed (PEP 440: a local version)


def installed_version() -> str:
    """The version in the installed distribution's metadata (pyproject.toml's, as `pip install` wrote
    it), so there is one place to change it; UNKNOWN_VERSION when the package is not installed."""
    try:
        return metadata.version(DISTRIBUTION)
    except metadata.PackageNotFoundError:
        return UNKNOWN_VERSION


PAGODA_VERSION = installed_version()
