from django.apps import AppConfig


class ModelsCatalogConfig(AppConfig):
    default_auto_field = "django.db.models.BigAutoField"
    name = "models_catalog"

    def ready(self):
        from inference_platform.read_cache import invalidate_on_change

        from .models import CatalogModel, Deployment

        invalidate_on_change(CatalogModel, Deployment)  # the gateway caches each request's deployment
