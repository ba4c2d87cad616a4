"""Signals of the catalog app, for the apps that build on it (it imports none of them)."""

from django.dispatch import Signal

# An organization's deployment is about to hold more replicas billed by the hour (created, started,
# or reserving more): ``deployment``, as it will be. A receiver refuses by raising
# ``InvalidDeployment`` (billing's, when the organization cannot pay for them now).
reserving_capacity = Signal()
