"""The embedded stand-in's tables belong to the Kubernetes app now (controlplane/kube/): the rows
stay, their tables are renamed, and this app's state forgets the models."""

from django.db import migrations


class Migration(migrations.Migration):
    dependencies = [("extender", "0001_initial")]

    operations = [
        migrations.SeparateDatabaseAndState(
            database_operations=[
                migrations.AlterModelTable("EmbeddedPod", "kube_embeddedpod"),
                migrations.AlterModelTable("EmbeddedPodEvent", "kube_embeddedpodevent"),
            ],
            state_operations=[
                migrations.DeleteModel("EmbeddedPod"),
                migrations.DeleteModel("EmbeddedPodEvent"),
            ],
        )
    ]
