"""A key's token total counts the tokens of billed requests only (billing.pricing.is_billed): a
request cancelled or failed before its first output token is free, and its prompt no longer uses
up the key's token limit. Recomputes the stored totals so that they equal the rows again."""

from django.db import migrations
from django.db.models import Q, Sum


def recount_tokens(apps, schema_editor):
    ApiKeyTotals = apps.get_model("billing", "ApiKeyTotals")
    UsageRecord = apps.get_model("billing", "UsageRecord")
    billed = Q(status="completed") | Q(completion_tokens__gt=0)
    counted = dict(
        UsageRecord.objects.filter(billed, api_key__isnull=False).values("api_key")
        .annotate(tokens=Sum("prompt_tokens") + Sum("completion_tokens")).values_list("api_key", "tokens")
    )
    for totals in ApiKeyTotals.objects.all().iterator():
        tokens = int(counted.get(totals.api_key_id) or 0)
        if totals.tokens != tokens:
            ApiKeyTotals.objects.filter(pk=totals.pk).update(tokens=tokens)


class Migration(migrations.Migration):
    dependencies = [("billing", "0004_ledger_kind_index")]
    operations = [migrations.RunPython(recount_tokens, migrations.RunPython.noop)]
