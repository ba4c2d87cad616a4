"""import_model on the real bundled GGUF and small safetensors folders; refusals write nothing."""

from __future__ import annotations

import json
import os
from decimal import Decimal

import numpy as np
import pytest
from django.core.management import CommandError, call_command
from safetensors.numpy import save_file

from models_catalog.errors import ModelImportError, WeightsNotFound
from models_catalog.models import CatalogModel
from models_catalog.services import import_model
from models_catalog.weights import resolve_weights_path

from .conftest import bundled_gguf

pytestmark = pytest.mark.django_db


def place(gguf_copy, folder, name="smol.gguf"):
    target = folder / name
    os.link(gguf_copy, target) if gguf_copy.stat().st_dev == folder.stat().st_dev else target.write_bytes(gguf_copy.read_bytes())
    return target


def test_import_fills_the_metadata_from_the_real_gguf(models_root, gguf_copy):
    place(gguf_copy, models_root)
    model = import_model(path="smol.gguf", price_input_per_mtok="0.05")
    assert model.architecture == "llama"
    assert model.parameter_count == 134_515_008  # the sum of every tensor's element count
    assert model.quantization == "Q4_1"
    assert model.context_length == 8192
    assert model.license == "apache-2.0"
    model.refresh_from_db()
    assert model.price_input_per_mtok == Decimal("0.05") and model.price_output_per_mtok == 0
    assert model.weights_path == "smol.gguf"  # stored relative to MODELS_ROOT
    assert resolve_weights_path(model) == models_root.resolve() / "smol.gguf"
    assert model.slug == "smol" and model.is_active


def test_an_absolute_path_under_the_root_and_nested_folders_work(models_root, gguf_copy):
    (models_root / "team" / "a").mkdir(parents=True)
    target = place(gguf_copy, models_root / "team" / "a", "x.gguf")
    model = import_model(path=str(target), slug="team-x")
    assert model.weights_path == "team/a/x.gguf" and model.slug == "team-x"


def test_a_symlink_that_stays_inside_the_root_is_followed(models_root, gguf_copy):
    place(gguf_copy, models_root, "real.gguf")
    (models_root / "alias.gguf").symlink_to(models_root / "real.gguf")
    assert import_model(path="alias.gguf").weights_path == "real.gguf"


def test_importing_the_same_weights_twice_is_refused(models_root, gguf_copy):
    place(gguf_copy, models_root)
    import_model(path="smol.gguf")
    with pytest.raises(ModelImportError, match="already in the catalog"):
        import_model(path="smol.gguf")
    assert CatalogModel.objects.count() == 1


@pytest.mark.parametrize("kind", ["dotdot", "absolute-outside", "symlink-out", "symlinked-dir-out"])
def test_paths_leading_outside_models_root_are_refused(models_root, tmp_path, kind):
    outside = tmp_path / "outside"
    outside.mkdir()
    (outside / "secret.gguf").symlink_to(bundled_gguf())
    path = {
        "dotdot": "../outside/secret.gguf",
        "absolute-outside": str(bundled_gguf()),
        "symlink-out": "link.gguf",
        "symlinked-dir-out": "dir/secret.gguf",
    }[kind]
    if kind == "symlink-out":
        (models_root / "link.gguf").symlink_to(bundled_gguf())
    if kind == "symlinked-dir-out":
        (models_root / "dir").symlink_to(outside)
    with pytest.raises(ModelImportError) as info:
        import_model(path=path)
    assert "MODELS_ROOT" in info.value.message or "'..'" in info.value.message
    assert not CatalogModel.objects.exists()


def test_dotdot_is_refused_even_when_it_comes_back_inside(models_root, gguf_copy):
    place(gguf_copy, models_root)
    with pytest.raises(ModelImportError, match=r"'\.\.'"):
        import_model(path=f"../{models_root.name}/smol.gguf")


@pytest.mark.parametrize(
    ("name", "content", "message"),
    [
        ("junk.gguf", b"this is not a model at all" * 100, "not a readable GGUF"),
        ("empty.gguf", b"", "not a readable GGUF"),
        ("weights.bin", b"\x00" * 64, "unsupported"),
    ],
)
def test_corrupt_or_unsupported_files_give_an_error_and_no_row(models_root, name, content, message):
    (models_root / name).write_bytes(content)
    with pytest.raises(ModelImportError, match=message):
        import_model(path=name)
    assert not CatalogModel.objects.exists()


def test_a_truncated_gguf_gives_an_error_and_no_row(models_root, gguf_copy):
    with open(gguf_copy, "rb") as source:
        (models_root / "cut.gguf").write_bytes(source.read(200_000))
    with pytest.raises(ModelImportError):
        import_model(path="cut.gguf")
    assert not CatalogModel.objects.exists()


def test_a_missing_path_gives_an_error_that_says_where_weights_go(models_root, settings, tmp_path, monkeypatch):
    with pytest.raises(ModelImportError, match=f"no such file or folder under MODELS_ROOT \\({models_root.resolve()}\\)$"):
        import_model(path="nothing-here.gguf")
    monkeypatch.chdir(tmp_path)
    (tmp_path / "here.gguf").write_bytes(b"GGUF")  # a relative path, from the current folder
    with pytest.raises(ModelImportError, match="in the current folder instead; move or copy it into MODELS_ROOT"):
        import_model(path="here.gguf")
    settings.MODELS_ROOT = tmp_path / "not-made-yet"
    with pytest.raises(ModelImportError, match="which does not exist yet: create it and put the weights there"):
        import_model(path="nothing-here.gguf")


def test_a_link_out_of_models_root_is_named_as_one(models_root, gguf_copy, tmp_path):
    (models_root / "link.gguf").symlink_to(gguf_copy)
    with pytest.raises(ModelImportError, match="link.gguf: links to .* outside MODELS_ROOT"):
        import_model(path="link.gguf")
    assert not CatalogModel.objects.exists()


def write_safetensors_folder(folder, *, dtype=np.float16):
    folder.mkdir()
    (folder / "config.json").write_text(json.dumps({"model_type": "qwen2", "max_position_embeddings": 4096}))
    save_file({"embed": np.zeros((10, 4), dtype=dtype), "w": np.zeros((4, 4), dtype=dtype)}, folder / "model-00001.safetensors")
    save_file({"bias": np.zeros((4,), dtype=np.float32)}, folder / "model-00002.safetensors")


def test_a_safetensors_folder_is_read_from_its_headers(models_root):
    write_safetensors_folder(models_root / "tiny-qwen")
    model = import_model(path="tiny-qwen")
    assert (model.architecture, model.parameter_count, model.quantization, model.context_length) == ("qwen2", 60, "F16", 4096)
    assert resolve_weights_path(model) == models_root.resolve() / "tiny-qwen"


def test_a_safetensors_folder_with_a_broken_file_or_no_config_is_refused(models_root):
    write_safetensors_folder(models_root / "broken")
    (models_root / "broken" / "model-00002.safetensors").write_bytes(b"\xff" * 16)
    with pytest.raises(ModelImportError, match="safetensors"):
        import_model(path="broken")
    (models_root / "noconfig").mkdir()
    with pytest.raises(ModelImportError, match="config.json"):
        import_model(path="noconfig")
    assert not CatalogModel.objects.exists()


def test_weights_that_moved_away_are_reported(models_root, gguf_copy):
    target = place(gguf_copy, models_root)
    model = import_model(path="smol.gguf")
    target.unlink()
    with pytest.raises(WeightsNotFound):
        resolve_weights_path(model)


def test_the_management_command_imports_and_reports_errors(models_root, gguf_copy, capsys):
    place(gguf_copy, models_root)
    call_command("import_model", "smol.gguf", "--slug", "smol-q41", "--price-output-per-mtok", "0.2")
    assert "smol-q41: llama, 134,515,008 parameters, Q4_1, context 8192" in capsys.readouterr().out
    assert CatalogModel.objects.get().price_output_per_mtok == Decimal("0.2")
    with pytest.raises(CommandError, match="MODELS_ROOT"):
        call_command("import_model", "/etc/passwd")


@pytest.mark.parametrize("price, said", [("1e400", "too large"), ("12345678901234567.5", "too large"),
                                         ("0.00000001", "more than 6 decimal places"), ("-1", "non-negative"),
                                         ("NaN", "non-negative")])
def test_a_price_the_catalog_cannot_hold_exactly_is_refused_not_rounded(models_root, gguf_copy, price, said):
    """0.00000001 stored as 0 made the model free; 1e400 broke every catalog page afterwards."""
    place(gguf_copy, models_root)
    with pytest.raises(ModelImportError, match=said):
        import_model(path="smol.gguf", price_output_per_mtok=price)
    assert not CatalogModel.objects.exists()
    model = import_model(path="smol.gguf", price_output_per_mtok="9999999999.999999")  # the largest it holds
    assert CatalogModel.objects.get(pk=model.pk).price_output_per_mtok == Decimal("9999999999.999999")
