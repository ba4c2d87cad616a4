from decimal import Decimal, InvalidOperation

from django.core.management.base import BaseCommand, CommandError
from django.db.models import Q

from accounts.models import Organization
from billing import selectors, services
from billing.errors import InvalidParameter


class Command(BaseCommand):
    help = (
        "Credit (a positive amount) or debit (a negative one) an organization's balance by hand: a "
        "goodwill credit, an invoice paid outside Stripe, a correction. Each is a new ledger entry of "
        "kind 'adjustment' that the organization sees on its billing page, never an edit of an old one."
    )

    def add_arguments(self, parser):
        parser.add_argument("organization", help="the organization's id, its exact name, or its slug (the API's owned_by)")
        parser.add_argument("amount", help="USD, e.g. 25 or -3.50 (at most 6 decimals)")
        parser.add_argument("--reason", required=True,
                            help="what the organization reads on its ledger, e.g. 'Credit for the outage of 3 May'")
        parser.add_argument("--reference", default="",
                            help="makes it happen once: run again with the same reference, nothing more is added "
                                 "(e.g. an invoice number)")

    def handle(self, *args, organization, amount, reason, reference, **options):
        org = _organization(organization)
        try:
            value = Decimal(amount)
        except InvalidOperation:
            raise CommandError(f"amount must be a number of USD such as 25 or -3.50, not {amount!r}") from None
        if not value.is_finite() or value != value.quantize(Decimal("0.000001"), rounding="ROUND_DOWN"):
            raise CommandError(f"amount must be finite, with at most 6 decimals, not {amount!r}")
        if not reason.strip():
            raise CommandError("--reason must say why, in words the organization will read")
        try:
            entry, created = services.add_adjustment(organization=org, amount=value, description=reason.strip(),
                                                     reference=reference)
        except InvalidParameter as exc:
            raise CommandError(str(exc)) from None
        note = "" if created else " (done before under this reference: nothing added now)"
        self.stdout.write(f"{org.name} (id {org.pk}): {entry.amount:+} USD, ledger entry {entry.pk}{note}; "
                          f"balance now {selectors.balance(organization=org)} USD")


def _organization(given: str) -> Organization:
    if given.isdigit():
        found = Organization.objects.filter(pk=int(given)).first()
        if found:
            return found
    named = list(Organization.objects.filter(Q(name=given) | Q(slug=given))[:2])
    if len(named) == 1:
        return named[0]
    if named:
        raise CommandError(f"several organizations are named {given!r}: give its id instead")
    raise CommandError(f"no organization has the id, name or slug {given!r}")
