from django.apps import AppConfig


class BillingConfig(AppConfig):
    default_auto_field = "django.db.models.BigAutoField"
    name = "billing"

    def ready(self):
        from accounts.signals import email_verified, organization_created
        from models_catalog.signals import reserving_capacity

        from . import receivers

        organization_created.connect(
            receivers.grant_signup_credit, dispatch_uid="billing.grant_signup_credit"
        )
        email_verified.connect(
            receivers.grant_signup_credit_on_verification, dispatch_uid="billing.grant_signup_credit_on_verification"
        )
        reserving_capacity.connect(receivers.refuse_capacity_unpaid, dispatch_uid="billing.refuse_capacity_unpaid")
