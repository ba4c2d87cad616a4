from django.core.management.base import BaseCommand, CommandError

from accounts.models import Organization
from billing import totals


class Command(BaseCommand):
    help = (
        "Compare each organization's running totals (balance, monthly spend, spend per API key) with "
        "what its ledger entries and usage records add up to, and correct the totals that differ. "
        "Needed only after rows were changed outside the platform (raw SQL, a restored backup); safe "
        "while requests are being charged."
    )

    def add_arguments(self, parser):
        parser.add_argument("--organization", type=int, action="append", metavar="ID",
                            help="only this organization (repeatable); default: every organization")
        parser.add_argument("--check", action="store_true",
                            help="report differences without correcting them; exit with status 1 if any")

    def handle(self, *args, organization=None, check=False, **options):
        ids = organization or list(Organization.objects.order_by("pk").values_list("pk", flat=True))
        missing = set(ids) - set(Organization.objects.filter(pk__in=ids).values_list("pk", flat=True))
        if missing:
            raise CommandError(f"no organization has id {', '.join(map(str, sorted(missing)))}")
        differing = 0
        for organization_id in ids:
            stored, truth = totals.reconcile(organization_id=organization_id, fix=not check)
            if stored != truth:
                differing += 1
                self.stdout.write(f"organization {organization_id}: {'differs' if check else 'corrected'}: "
                                  f"{_differences(stored, truth)}")
        self.stdout.write(f"{len(ids)} organizations checked, {differing} "
                          f"{'differ' if check else 'corrected'}.")
        if check and differing:
            raise SystemExit(1)


def _differences(stored: totals.Totals, truth: totals.Totals) -> str:
    parts = []
    if stored.balance != truth.balance:
        parts.append(f"balance {totals.usd(stored.balance)} -> {totals.usd(truth.balance)} USD")
    if stored.months != truth.months:
        parts.append("monthly spend")
    if stored.keys != truth.keys:
        parts.append("API key totals")
    return "; ".join(parts)
