"""Semantic: a local LLM inference server with persistent per-agent KV caches."""

from importlib.metadata import PackageNotFoundError, version

try:
    __version__ = version("semantic")
except PackageNotFoundError:  # run from a source tree that was never installed
    __version__ = "0+unknown"
