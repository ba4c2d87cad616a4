from django.apps import AppConfig


class AccountsConfig(AppConfig):
    default_auto_field = "django.db.models.BigAutoField"
    name = "accounts"

    def ready(self):
        from inference_platform.read_cache import invalidate_on_change

        from . import receivers, schema  # noqa: F401  (keys follow memberships; the OpenAPI key scheme)
        from .models import ApiKey, Organization, User

        invalidate_on_change(ApiKey, Organization, User)  # authenticated keys are cached (``selectors``)
