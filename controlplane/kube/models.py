"""The embedded Kubernetes stand-in's storage (DESIGN §7): pods and their bindings.

Only `controlplane.kube.embedded.EmbeddedKube` writes these rows. They exist so `make run` on a bare
machine (and the tests) can drive the real extender and bind code paths without a cluster;
they are never used when a kubeconfig or in-cluster config is present.
"""

from __future__ import annotations

from django.db import models


class EmbeddedPod(models.Model):
    """One pod of the stand-in API server: the whole v1.Pod object as JSON, plus indexed keys.

    `obj` is what a real API server would serve (metadata, spec, status); `node_name` mirrors
    `obj.spec.nodeName` so "unbound pods" is a query, not a scan.
    """

    namespace = models.CharField(max_length=63)
    name = models.CharField(max_length=253)
    uid = models.CharField(max_length=64, unique=True)
    node_name = models.CharField(max_length=253, blank=True)
    obj = models.JSONField(help_text="The v1.Pod as the API server would serve it.")
    resource_version = models.PositiveBigIntegerField(default=1)
    created_at = models.DateTimeField(auto_now_add=True)
    updated_at = models.DateTimeField(auto_now=True)

    class Meta:
        ordering = ["namespace", "name"]
        constraints = [
            models.UniqueConstraint(fields=["namespace", "name"], name="embedded_pod_ns_name")
        ]

    def __str__(self) -> str:
        return f"{self.namespace}/{self.name}"


class EmbeddedPodEvent(models.Model):
    """The stand-in's watch stream: one row per change; watchers poll for ids past theirs."""

    class Type(models.TextChoices):
        ADDED = "ADDED", "added"
        MODIFIED = "MODIFIED", "modified"
        DELETED = "DELETED", "deleted"

    type = models.CharField(max_length=8, choices=Type.choices)
    obj = models.JSONField()
    at = models.DateTimeField(auto_now_add=True)

    class Meta:
        ordering = ["id"]

    def __str__(self) -> str:
        meta = self.obj.get("metadata", {}) if isinstance(self.obj, dict) else {}
        return f"{self.type} {meta.get('namespace')}/{meta.get('name')}"


class EmbeddedObject(models.Model):
    """A DRA object of the stand-in: a ResourceClaim (namespaced) or a ResourceSlice (cluster
    wide, namespace blank), as the API server would serve it. Only ResourceClaims are watched
    (`EmbeddedObjectEvent`): the reconciler mirrors them (docs/dra.md, *One ledger for
    claims*)."""

    class Kind(models.TextChoices):
        CLAIM = "ResourceClaim", "ResourceClaim"
        SLICE = "ResourceSlice", "ResourceSlice"

    kind = models.CharField(max_length=16, choices=Kind.choices)
    namespace = models.CharField(max_length=63, blank=True)
    name = models.CharField(max_length=253)
    uid = models.CharField(max_length=64, unique=True)
    obj = models.JSONField(help_text="The object as the API server would serve it.")

    class Meta:
        ordering = ["kind", "namespace", "name"]
        constraints = [
            models.UniqueConstraint(
                fields=["kind", "namespace", "name"], name="embedded_object_kind_ns_name"
            )
        ]

    def __str__(self) -> str:
        return f"{self.kind} {self.namespace}/{self.name}"


class EmbeddedObjectEvent(models.Model):
    """The stand-in's ResourceClaim watch stream: one row per change."""

    type = models.CharField(max_length=8, choices=EmbeddedPodEvent.Type.choices)
    obj = models.JSONField()

    class Meta:
        ordering = ["id"]

    def __str__(self) -> str:
        meta = self.obj.get("metadata", {}) if isinstance(self.obj, dict) else {}
        return f"{self.type} {meta.get('namespace')}/{meta.get('name')}"
