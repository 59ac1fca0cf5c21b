"""Hugging Face safetensors on every backend: :class:`SafetensorsWriter` and
:class:`SafetensorsReader` plug into ``dcp.save`` / ``dcp.load`` and write or read the Hub
layout (``model.safetensors``, or shards plus ``model.safetensors.index.json``) that
transformers, vLLM, SGLang and the Hub read. See ``docs/safetensors.md``."""

from storage.checkpoint.safetensors.api import load_safetensors, save_safetensors
from storage.checkpoint.safetensors.reader import SafetensorsReader
from storage.checkpoint.safetensors.writer import SafetensorsWriter

__all__ = ["SafetensorsReader", "SafetensorsWriter", "load_safetensors", "save_safetensors"]
