"""A model enters the catalog only if the engine can run it: what a deployment's load would refuse
(an unsupported architecture, no tokenizer, a weights file cut short, an impossible context) is
refused at import, with the reason, and nothing is written. The context length stored is the one
the engine runs."""

from __future__ import annotations

import json
import shutil
import struct

import numpy as np
import pytest
from django.core.management import CommandError, call_command
from safetensors.numpy import save_file

from models_catalog.errors import ModelImportError
from models_catalog.models import CatalogModel
from tests.engine.conftest import tiny_tokenizer_json  # noqa: F401 (a fixture)
from tests.models_catalog.conftest import gguf_copy, models_root  # noqa: F401 (fixtures)
from workers.engine.loader import MAX_CONTEXT
from workers.model_import import import_model

pytestmark = pytest.mark.django_db

LLAMA = {"model_type": "llama", "vocab_size": 64, "hidden_size": 16, "intermediate_size": 32,
         "num_hidden_layers": 1, "num_attention_heads": 2, "max_position_embeddings": 512}


@pytest.fixture
def folder(models_root, tiny_tokenizer_json):  # noqa: F811
    """A Hugging Face folder the engine can read: config, tokenizer, weights (their names and
    values are not what an import checks)."""
    path = models_root / "tiny-llama"
    path.mkdir()
    (path / "config.json").write_text(json.dumps(LLAMA))
    shutil.copy(tiny_tokenizer_json, path / "tokenizer.json")
    save_file({"model.embed_tokens.weight": np.zeros((64, 16), dtype=np.float16)}, path / "model.safetensors")
    return path


def config(folder, **changes):
    (folder / "config.json").write_text(json.dumps({k: v for k, v in {**LLAMA, **changes}.items() if v is not None}))


def test_a_folder_the_engine_can_run_is_imported_with_its_context(folder):
    model = import_model(path="tiny-llama")
    assert (model.architecture, model.context_length) == ("llama", 512)


def test_a_missing_context_is_stored_as_the_one_the_engine_runs(folder):
    config(folder, max_position_embeddings=None)
    assert import_model(path="tiny-llama").context_length == 2048  # not 0, which says nothing


def _framed(header: dict) -> bytes:
    raw = json.dumps(header).encode()
    return struct.pack("<Q", len(raw)) + raw


def _header(folder, content: bytes) -> None:
    (folder / "model.safetensors").write_bytes(content + b"\0" * 64)


@pytest.mark.parametrize("breaks, said", [
    (lambda folder: (folder / "tokenizer.json").unlink(), "no tokenizer.json"),
    (lambda folder: config(folder, model_type="phi3"), "phi3"),
    (lambda folder: config(folder, num_attention_heads=None), "num_attention_heads"),
    (lambda folder: config(folder, max_position_embeddings=MAX_CONTEXT * 2), "context"),
    (lambda folder: (folder / "model.safetensors").write_bytes((folder / "model.safetensors").read_bytes()[:-100]),
     "cut short"),
    (lambda folder: _header(folder, _framed({"w": {"dtype": "F16", "shape": [1], "data_offsets": [0, -5]}})),
     "malformed data_offsets"),
], ids=["no-tokenizer", "architecture", "config-field", "context", "truncated", "offsets"])
def test_what_a_load_would_refuse_is_refused_at_import_with_the_reason(folder, breaks, said):
    breaks(folder)
    with pytest.raises(ModelImportError, match=said) as refused:
        import_model(path="tiny-llama")
    assert "the engine cannot run it" in refused.value.message
    assert not CatalogModel.objects.exists()


def test_a_gguf_of_any_case_imports_and_the_command_uses_the_check(models_root, gguf_copy, folder, capsys):  # noqa: F811
    (models_root / "SMOL.GGUF").write_bytes(gguf_copy.read_bytes())
    assert import_model(path="SMOL.GGUF").context_length == 8192  # the engine loads it too
    (folder / "tokenizer.json").unlink()
    with pytest.raises(CommandError, match="no tokenizer.json"):
        call_command("import_model", "tiny-llama")


@pytest.mark.parametrize("content, said", [
    (b"\xff" * 8, "header size"),  # 2^64 - 1 bytes: never read
    (struct.pack("<Q", 2**40), "header size"),  # more than the file holds
    (struct.pack("<Q", 2) + b"[]", "not an object"),
    (struct.pack("<Q", 3) + b"\xff{}", "not JSON"),
    (b"abc", "header size"),
], ids=["size-2^64", "size-past-the-file", "list", "not-json", "too-short"])
def test_a_safetensors_file_with_a_bogus_header_is_refused_without_reading_it(tmp_path, content, said):
    """The engine's own check, which the catalog's header reading may not have run into."""
    from workers.engine.config import WeightsError
    from workers.engine.weights import check_safetensors_file

    path = tmp_path / "model.safetensors"
    path.write_bytes(content + b"\0" * 64)
    with pytest.raises(WeightsError, match=said):
        check_safetensors_file(path)
