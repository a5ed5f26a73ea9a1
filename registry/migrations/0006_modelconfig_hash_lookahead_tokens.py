import django.core.validators
from django.db import migrations, models


class Migration(migrations.Migration):
    dependencies = [
        ("scoring", "0005_registry_validators"),
    ]

    operations = [
        migrations.AddField(
            model_name="modelconfig",
            name="hash_lookahead_tokens",
            field=models.PositiveSmallIntegerField(
                default=0,
                help_text="Must equal the engines' lookahead hashing (vLLM's num_hash_lookahead_tokens, set by speculative decoding configs): each block's key also covers this many tokens after it. 0 to 64; 0 (the default): none.",
                validators=[django.core.validators.MaxValueValidator(64)],
            ),
        ),
    ]
