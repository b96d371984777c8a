"""Forms of the dashboard pages: validate and translate; the services decide."""

from __future__ import annotations

from django import forms

from controlplane.ledger.models import Card
from controlplane.ledger.services.modes import MAX_REASON
from controlplane.ledger.services.quotas import MAX_QUOTA, QuotaLimitsInput
from controlplane.ledger.validation import NAMESPACE_HELP, is_namespace


def _limit_field(name: str, label: str) -> forms.IntegerField:
    return forms.IntegerField(
        label=label,
        required=False,
        min_value=0,
        max_value=MAX_QUOTA[name],
        help_text="Empty = unlimited.",
        widget=forms.NumberInput(attrs={"placeholder": "unlimited", "min": 0}),
    )


class QuotaForm(forms.Form):
    """A namespace's limits; an empty limit is unlimited."""

    namespace = forms.CharField(max_length=63)
    gpumem_mib = _limit_field("gpumem_mib", "GPU memory (MiB)")
    gpucores = _limit_field("gpucores", "Compute (sum of %)")
    gpus = _limit_field("gpus", "Slices")

    def clean_namespace(self) -> str:
        value: str = self.cleaned_data["namespace"].strip()
        if not is_namespace(value):
            raise forms.ValidationError(
                f"{value!r} is not a valid namespace name: {NAMESPACE_HELP}"
            )
        return value

    def limits(self) -> QuotaLimitsInput:
        data = self.cleaned_data
        return QuotaLimitsInput(data["gpumem_mib"], data["gpucores"], data["gpus"])


class CordonForm(forms.Form):
    """Cordon or uncordon, with an optional reason for the audit log."""

    action = forms.ChoiceField(choices=[("cordon", "cordon"), ("uncordon", "uncordon")])
    reason = forms.CharField(max_length=500, required=False)


class CardModeForm(forms.Form):
    """A card's new mode, with an optional reason for the audit log."""

    mode = forms.ChoiceField(choices=Card.Mode.choices)
    reason = forms.CharField(max_length=MAX_REASON, required=False)


class CardFactorForm(forms.Form):
    """A card's own oversubscription factor ("1.5"; blank: back to the node's default), with an
    optional reason for the audit log. The ledger's service checks the factor."""

    factor = forms.CharField(max_length=5, required=False, strip=True)
    reason = forms.CharField(max_length=MAX_REASON, required=False)


ROLE_CHOICES = [(r, r) for r in ("viewer", "operator", "admin", "node")]


class GrantRoleForm(forms.Form):
    """Give a user (created if new) one Tessera role; optionally issue a token at once."""

    username = forms.CharField(max_length=150)
    role = forms.ChoiceField(choices=ROLE_CHOICES)
    token_label = forms.CharField(
        max_length=100, required=False, help_text="Set to issue a token now (shown once)."
    )
    issue_token = forms.BooleanField(required=False)
