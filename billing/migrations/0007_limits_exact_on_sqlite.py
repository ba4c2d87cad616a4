"""Spend limits above billing.models.LIMIT_MAX (999,999,999.999999 USD) come down to it.

The API and the forms accepted limits up to 10^12, which SQLite stores as floats: one that rounded
up (999999999999.999999 became 1e12) could not be read back, and every billing page of its
organization was a 500 (others read back rounded). Nothing above the new maximum can be set any
more; one already stored becomes the maximum, still far above any month's spend, on every database
so that a limit reads back as one that may be set again."""

from decimal import Decimal

from django.db import migrations

LIMIT_MAX = Decimal("999999999.999999")  # billing.models.LIMIT_MAX when this was written


def cap_limits(apps, schema_editor):
    apps.get_model("billing", "SpendLimit").objects.filter(monthly_limit__gt=LIMIT_MAX).update(monthly_limit=LIMIT_MAX)
    apps.get_model("billing", "ApiKeySpendLimit").objects.filter(amount_limit__gt=LIMIT_MAX).update(amount_limit=LIMIT_MAX)


class Migration(migrations.Migration):

    dependencies = [
        ("billing", "0006_refused_usage_events"),
    ]

    operations = [
        migrations.RunPython(cap_limits, migrations.RunPython.noop),
    ]
