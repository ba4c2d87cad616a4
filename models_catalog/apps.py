from django.apps import AppConfig


class ModelsCatalogConfig(AppConfig):
    default_auto_field = "django.db.models.BigAutoField"
    name = "models_catalog"
