"""Errors of the catalog app; ``message`` is fit to show a user."""

from __future__ import annotations


class CatalogError(Exception):
    def __init__(self, message: str):
        self.message = message
        super().__init__(message)


class DeploymentNotFound(CatalogError):
    """No deployment of that name that this organization may call (never says whether one exists)."""

    def __init__(self, name: str):
        self.name = name
        super().__init__(f"The model '{name}' does not exist or you do not have access to it.")


class InvalidDeployment(CatalogError):
    """A deployment setting was refused; ``field`` names it."""

    def __init__(self, field: str, message: str):
        self.field = field
        super().__init__(message)

    def __str__(self) -> str:
        return f"{self.field}: {self.message}"


class ModelImportError(CatalogError):
    """A weights file or folder could not be imported; nothing was written."""


class WeightsNotFound(CatalogError):
    """A catalog model's weights cannot be found where its ``weights_path`` says."""


class InvalidCatalogModel(CatalogError):
    """A catalog model change was refused; ``field`` names it."""

    def __init__(self, field: str, message: str):
        self.field = field
        super().__init__(message)
