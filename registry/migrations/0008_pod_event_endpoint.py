from django.db import migrations, models

import registry.models


class Migration(migrations.Migration):
    dependencies = [
        ("scoring", "0007_modelconfig_kv_cache_groups"),
    ]

    operations = [
        migrations.AddField(
            model_name="pod",
            name="event_endpoint",
            field=models.CharField(
                blank=True,
                help_text="Where the engine's KV-event PUB binds (e.g. tcp://10.0.0.7:5557): the ingest "
                "replica that owns the pod connects to it. Empty: the engine connects to ingest (its --bind).",
                max_length=255,
                validators=[registry.models.validate_event_endpoint],
            ),
        ),
    ]
