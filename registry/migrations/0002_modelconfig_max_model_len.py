import django.core.validators
from django.db import migrations, models


class Migration(migrations.Migration):
    dependencies = [
        ("scoring", "0001_registry"),
    ]

    operations = [
        migrations.AddField(
            model_name="modelconfig",
            name="max_model_len",
            field=models.PositiveIntegerField(
                blank=True,
                help_text="Context length in tokens (vLLM's --max-model-len); longer prompts are refused. Empty: the tokenizer config's model_max_length.",
                null=True,
                validators=[django.core.validators.MinValueValidator(1)],
            ),
        ),
    ]
