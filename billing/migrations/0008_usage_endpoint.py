
from django.db import migrations, models


class Migration(migrations.Migration):

    dependencies = [
        ('billing', '0007_limits_exact_on_sqlite'),
    ]

    operations = [
        migrations.AddField(
            model_name='usagerecord',
            name='endpoint',
            field=models.CharField(blank=True, default='', db_default='', max_length=40),
        ),
    ]
