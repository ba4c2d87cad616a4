"""Adding a model to the catalog only if the engine can run it: the catalog reads the weights'
metadata, the engine checks what a load would refuse (an unsupported architecture, a missing
tokenizer, a file cut short, an impossible context) without reading the weights, and gives the
context length it runs them with. A model that passes is one a deployment can load."""

from __future__ import annotations

from pathlib import Path

from models_catalog import services as catalog_services
from models_catalog.errors import ModelImportError
from models_catalog.models import CatalogModel


def import_model(**arguments) -> CatalogModel:
    """``models_catalog.services.import_model`` with the engine's check."""
    return catalog_services.import_model(**arguments, check=engine_context_length)


def engine_context_length(path: Path) -> int:
    from .engine.config import UnsupportedModelError, WeightsError
    from .engine.loader import check_model

    try:
        return check_model(path).max_position_embeddings
    except (UnsupportedModelError, WeightsError) as exc:
        raise ModelImportError(f"{path.name}: the engine cannot run it: {exc}") from None
