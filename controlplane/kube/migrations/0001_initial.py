"""The embedded stand-in's models, whose tables the extender app's migration 0002 renamed into
this app: state only, the database already has them."""

from django.db import migrations, models


class Migration(migrations.Migration):
    initial = True

    dependencies = [("extender", "0002_embedded_pods_move_to_kube")]

    operations = [
        migrations.SeparateDatabaseAndState(
            database_operations=[],
            state_operations=[
                migrations.CreateModel(
                    name="EmbeddedPodEvent",
                    fields=[
                        (
                            "id",
                            models.BigAutoField(
                                auto_created=True,
                                primary_key=True,
                                serialize=False,
                                verbose_name="ID",
                            ),
                        ),
                        (
                            "type",
                            models.CharField(
                                choices=[
                                    ("ADDED", "added"),
                                    ("MODIFIED", "modified"),
                                    ("DELETED", "deleted"),
                                ],
                                max_length=8,
                            ),
                        ),
                        ("obj", models.JSONField()),
                        ("at", models.DateTimeField(auto_now_add=True)),
                    ],
                    options={
                        "ordering": ["id"],
                    },
                ),
                migrations.CreateModel(
                    name="EmbeddedPod",
                    fields=[
                        (
                            "id",
                            models.BigAutoField(
                                auto_created=True,
                                primary_key=True,
                                serialize=False,
                                verbose_name="ID",
                            ),
                        ),
                        ("namespace", models.CharField(max_length=63)),
                        ("name", models.CharField(max_length=253)),
                        ("uid", models.CharField(max_length=64, unique=True)),
                        ("node_name", models.CharField(blank=True, max_length=253)),
                        (
                            "obj",
                            models.JSONField(
                                help_text="The v1.Pod as the API server would serve it."
                            ),
                        ),
                        ("resource_version", models.PositiveBigIntegerField(default=1)),
                        ("created_at", models.DateTimeField(auto_now_add=True)),
                        ("updated_at", models.DateTimeField(auto_now=True)),
                    ],
                    options={
                        "ordering": ["namespace", "name"],
                        "constraints": [
                            models.UniqueConstraint(
                                fields=("namespace", "name"), name="embedded_pod_ns_name"
                            )
                        ],
                    },
                ),
            ],
        )
    ]
