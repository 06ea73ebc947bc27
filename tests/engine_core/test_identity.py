"""The version comes from the installed distribution, with a fallback for an uninstalled tree."""

from __future__ import annotations

from importlib import metadata

from pagoda.engine_core import identity


def test_version_is_the_installed_distributions():
    assert identity.installed_version() == metadata.version("pagoda-llm") == identity.PAGODA_VERSION


def test_version_of_a_source_tree_that_was_never_installed(monkeypatch):
    def not_installed(name: str) -> str:
        raise metadata.PackageNotFoundError(name)

    monkeypatch.setattr(metadata, "version", not_installed)
    assert identity.installed_version() == identity.UNKNOWN_VERSION == "0+unknown"
