"""Model resolution: default, explicit .gguf, HF folder, and clear errors for the rest."""

from __future__ import annotations

import pytest

from cacheblend.models.loader import default_model_gguf, resolve_model_dir


def test_gguf_path_resolves_to_the_default_conversion(default_model_dir):
    assert resolve_model_dir(default_model_gguf()) == default_model_dir
    assert (default_model_dir / "model.safetensors").is_file()
    assert (default_model_dir / "tokenizer.json").is_file()


def test_hf_folder_is_used_as_is(default_model_dir):
    assert resolve_model_dir(str(default_model_dir)) == default_model_dir


def test_missing_model_is_a_clear_error(tmp_path):
    with pytest.raises(FileNotFoundError, match="not found"):
        resolve_model_dir(tmp_path / "nope")
    with pytest.raises(FileNotFoundError, match="no config.json"):
        resolve_model_dir(tmp_path)


def test_default_model_name(default_engine):
    assert default_engine.model_name.startswith("SmolLM2-135M-Instruct")
