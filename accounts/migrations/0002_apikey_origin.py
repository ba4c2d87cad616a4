"""How a key was made (``ApiKey.origin``). A key without a creator acted as the whole organization,
which a deleted member's key became. Every existing key is recorded as a member's: the command line
(``up``, ``createkey``) always gave its keys a creator (the admin, ``--email`` or the organization's
owner), so a creator-less key today is, but for a ``createkey`` into an organization left without
an owner, one whose creator was deleted. Those are revoked: their holder has lost all access (the
operator can make a new one with ``createkey``, which now records its origin)."""

from django.db import migrations, models
from django.utils import timezone


def revoke_orphaned_keys(apps, schema_editor):
    ApiKey = apps.get_model("accounts", "ApiKey")
    ApiKey.objects.filter(created_by__isnull=True, revoked_at__isnull=True).update(revoked_at=timezone.now())


class Migration(migrations.Migration):

    dependencies = [
        ("accounts", "0001_initial"),
    ]

    operations = [
        migrations.AddField(
            model_name="apikey",
            name="origin",
            field=models.CharField(choices=[("member", "A member (dashboard or code)"),
                                            ("command_line", "The operator's command line")],
                                   default="member", db_default="member", editable=False, max_length=16),
        ),
        migrations.AddConstraint(
            model_name="apikey",
            constraint=models.CheckConstraint(condition=models.Q(("origin__in", ["member", "command_line"])),
                                              name="accounts_apikey_origin_valid"),
        ),
        migrations.RunPython(revoke_orphaned_keys, migrations.RunPython.noop),
    ]
