from django.apps import AppConfig


class BillingConfig(AppConfig):
    default_auto_field = "django.db.models.BigAutoField"
    name = "billing"

    def ready(self):
        from accounts.signals import organization_created

        from . import receivers

        organization_created.connect(
            receivers.grant_signup_credit, dispatch_uid="billing.grant_signup_credit"
        )
