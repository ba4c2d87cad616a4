"""Keys follow their holder's access, whichever way it is lost: a membership deleted (the service,
the admin site, a bulk delete) or a user deleted. ``pre_delete``: after it, a deleted user's keys
would already have lost ``created_by`` (SET_NULL) and nobody could tell whose they were."""

from __future__ import annotations

from django.db.models.signals import pre_delete
from django.dispatch import receiver

from .models import Membership, User
from .services import revoke_keys_of


@receiver(pre_delete, sender=Membership, dispatch_uid="accounts-revoke-keys-of-membership")
def revoke_keys_of_membership(sender, instance: Membership, **kwargs) -> None:
    revoke_keys_of(user_id=instance.user_id, organization_id=instance.organization_id)


@receiver(pre_delete, sender=User, dispatch_uid="accounts-revoke-keys-of-user")
def revoke_keys_of_user(sender, instance: User, **kwargs) -> None:
    revoke_keys_of(user_id=instance.pk)
