"""Signals other apps may connect to (accounts itself imports none of them)."""

from __future__ import annotations

import django.dispatch

# Sent with ``organization=`` once the organization and its owner's membership exist, inside the
# same database transaction: a receiver's writes (billing's sign-up credit) commit or roll back with
# the organization, and a receiver that raises aborts the creation.
organization_created = django.dispatch.Signal()

# Sent with ``user=`` when a user confirms their email address (the link of the email sent at
# sign-up), inside the transaction that records it: billing grants the sign-up credit then.
email_verified = django.dispatch.Signal()
