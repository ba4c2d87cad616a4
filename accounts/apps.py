from django.apps import AppConfig


class AccountsConfig(AppConfig):
    default_auto_field = "django.db.models.BigAutoField"
    name = "accounts"

    def ready(self):
        from inference_platform.read_cache import invalidate_on_change

        # Keys follow memberships; the OpenAPI key scheme; failed sign-ins counted.
        from . import login_throttle, receivers, schema  # noqa: F401
        from .models import ApiKey, Organization, User

        invalidate_on_change(ApiKey, Organization, User)  # authenticated keys are cached (``selectors``)
