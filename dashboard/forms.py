"""The dashboard's forms: they parse and bound the input; the services decide."""

from __future__ import annotations

from datetime import date, timedelta
from decimal import Decimal

from django import forms
from django.contrib.auth.forms import AuthenticationForm, PasswordResetForm
from django.utils import timezone

from accounts import login_throttle
from accounts.models import SCOPES, Membership
from billing.models import LIMIT_MAX, MONEY
from billing.selectors import REPORT_DATES
from models_catalog.models import CatalogModel, Deployment
from models_catalog.selectors import deployment_name_taken
from models_catalog.services import ENGINE_SETTINGS, INT_SETTINGS, taken_message

from . import links, mail_quota

MAX_USAGE_DAYS = 366


class ThrottledPasswordResetForm(PasswordResetForm):
    """Django's, with its link under SITE_URL (``links``), and at most one email a minute and a few
    a day to one address (``mail_quota``): past that, none goes, and the page says what it always
    says, so that it tells nobody whether the address has an account."""

    def save(self, **kwargs):
        return super().save(**{**kwargs, **links.site_override()})

    def send_mail(self, subject_template_name, email_template_name, context, from_email, to_email,
                  html_email_template_name=None):
        if mail_quota.take("password-reset", mail_quota.of_user(context["user"])) is not None:
            return
        super().send_mail(subject_template_name, email_template_name, context, from_email, to_email,
                          html_email_template_name)


SCOPE_CHOICES = [
    ("inference", "Inference — call the chat and completions API"),
    ("read_usage", "Read usage — usage reports and the CSV export"),
    ("manage", "Manage — deployments and top-ups through the API"),
]
assert {value for value, _ in SCOPE_CHOICES} == set(SCOPES)

# The largest limit billing accepts (its service checks it again, for the API too).
SPEND_LIMIT_MAX = LIMIT_MAX

QUANTIZATION_CHOICES = [
    (Deployment.Quantization.NONE, "Compute precision"),
    (Deployment.Quantization.FP8, "FP8, per channel"),
    (Deployment.Quantization.FP8_PER_TENSOR, "FP8, per tensor"),
]
assert {value for value, _ in QUANTIZATION_CHOICES} == set(Deployment.Quantization.values)

EXPIRY_CHOICES = [("", "Never"), ("30", "In 30 days"), ("90", "In 90 days"), ("365", "In one year")]


class EmailLoginForm(login_throttle.ThrottledLogin, AuthenticationForm):
    """Django's login form, labelled for an email address."""

    username = forms.EmailField(label="Email", widget=forms.EmailInput(attrs={"autofocus": True, "autocomplete": "email"}))
    password = forms.CharField(label="Password", strip=False,
                               widget=forms.PasswordInput(attrs={"autocomplete": "current-password"}))

    error_messages = {
        **AuthenticationForm.error_messages,
        "invalid_login": "That email and password don't match an account. Check them and try again.",
    }


class SignUpForm(forms.Form):
    name = forms.CharField(label="Your name", max_length=150, required=False,
                           widget=forms.TextInput(attrs={"autocomplete": "name", "placeholder": "Ada Lovelace"}))
    email = forms.EmailField(label="Work email", max_length=254,
                             widget=forms.EmailInput(attrs={"autocomplete": "email", "placeholder": "you@company.com"}))
    password = forms.CharField(label="Password", strip=False, min_length=8,
                               widget=forms.PasswordInput(attrs={"autocomplete": "new-password"}),
                               help_text="At least 8 characters; not a common password.")
    organization_name = forms.CharField(label="Organization", max_length=150, required=False,
                                        widget=forms.TextInput(attrs={"placeholder": "Acme Research"}),
                                        help_text="Your team's workspace. You can invite others later.")
    invitation = forms.CharField(required=False, widget=forms.HiddenInput)


class OrganizationForm(forms.Form):
    name = forms.CharField(label="Organization name", max_length=150,
                           widget=forms.TextInput(attrs={"placeholder": "Acme Research", "autofocus": True}))


class InviteForm(forms.Form):
    email = forms.EmailField(label="Email address", widget=forms.EmailInput(attrs={"placeholder": "teammate@company.com"}))
    role = forms.ChoiceField(label="Role", choices=[("member", "Member"), ("admin", "Admin"), ("owner", "Owner")],
                             initial="member")

    def __init__(self, *args, actor_role: str | None = None, **kwargs):
        super().__init__(*args, **kwargs)
        if actor_role != Membership.Role.OWNER:
            self.fields["role"].choices = [("member", "Member"), ("admin", "Admin")]


class RoleForm(forms.Form):
    role = forms.ChoiceField(choices=Membership.Role.choices)


def _int_field(name: str, label: str, help_text: str = "", **attrs) -> forms.IntegerField:
    low, high = INT_SETTINGS[name]
    return forms.IntegerField(label=label, min_value=low, max_value=high, help_text=help_text,
                              widget=forms.NumberInput(attrs=attrs))


class DeploymentSettingsForm(forms.Form):
    """The settings of a deployment that can change over its life."""

    kind = forms.ChoiceField(choices=Deployment.Kind.choices, initial=Deployment.Kind.SERVERLESS,
                             widget=forms.RadioSelect)
    batch_window_ms = _int_field("batch_window_ms", "Batch window (ms)",
                                 "How long an idle engine waits for more requests before it starts a batch.")
    max_batch_size = _int_field("max_batch_size", "Max batch size", "Requests decoded together at most.")
    min_replicas = _int_field("min_replicas", "Min replicas", "Workers kept loaded even when idle (billed by the hour "
                                                              "where the model has a price per replica-hour).")
    max_replicas = _int_field("max_replicas", "Max replicas", "Workers it may scale out to under load.")
    scale_to_zero = forms.BooleanField(label="Scale to zero when idle", required=False, initial=True)
    scale_to_zero_seconds = _int_field("scale_to_zero_seconds", "Idle time before scaling to zero (s)")
    queue_limit = _int_field("queue_limit", "Queue limit", "Requests waiting at most; more are answered 429.")
    dtype = forms.ChoiceField(label="Precision", choices=Deployment.Dtype.choices, initial=Deployment.Dtype.AUTO,
                              help_text="auto: the best the worker's device supports.")
    # Short labels, which fit a half-width select on a laptop; the help says what they mean.
    quantization = forms.ChoiceField(label="Weights", choices=QUANTIZATION_CHOICES,
                                     initial=Deployment.Quantization.NONE, required=False,
                                     help_text="FP8 halves the weights' memory and speeds decode on Hopper and "
                                               "newer GPUs, at a small cost in accuracy (smaller per channel than "
                                               "per tensor).")

    INITIAL = {"kind": "serverless", "batch_window_ms": 20, "max_batch_size": 32, "min_replicas": 0,
               "max_replicas": 1, "scale_to_zero": True, "scale_to_zero_seconds": 300, "queue_limit": 256,
               "dtype": "auto", "quantization": "none"}

    def clean(self):
        # Each check runs when the fields it reads are valid, whatever other field is not: every
        # error shows on the first submit, not one more after each fix.
        data = super().clean()
        low, high = data.get("min_replicas"), data.get("max_replicas")
        if data.get("kind") == Deployment.Kind.DEDICATED:
            # It never goes to zero (min_replicas >= 1); the idle time (its fields hidden, as they
            # were left) still takes the replicas a burst added back down to its minimum, as the
            # API's default does: 0 would keep them all, and reserve, and bill, its maximum.
            if data.get("scale_to_zero") and not data.get("scale_to_zero_seconds"):
                data["scale_to_zero_seconds"] = self.INITIAL["scale_to_zero_seconds"]
            if low is not None and low < 1:
                self.add_error("min_replicas", "A dedicated deployment keeps at least one replica.")
        if low is not None and high is not None and high < low:
            self.add_error("max_replicas", "Max replicas must be at least min replicas.")
        seconds = data.get("scale_to_zero_seconds")
        if data.get("scale_to_zero") and seconds is not None and seconds < 1:
            self.add_error("scale_to_zero_seconds", "Give the idle time in seconds (at least 1).")
        return data

    def settings(self) -> dict:
        """The cleaned values as models_catalog's deployment settings."""
        data = self.cleaned_data
        return {
            "kind": data["kind"],
            "batch_window_ms": data["batch_window_ms"],
            "max_batch_size": data["max_batch_size"],
            "min_replicas": data["min_replicas"],
            "max_replicas": data["max_replicas"],
            "scale_to_zero_seconds": data["scale_to_zero_seconds"] if data.get("scale_to_zero") else 0,
            "queue_limit": data["queue_limit"],
            "dtype": data["dtype"],
            "quantization": data.get("quantization") or Deployment.Quantization.NONE,
        }

    def reloading_fields(self) -> str:
        """The labels of the fields whose change reloads the model (ENGINE_SETTINGS), for the hint."""
        labels = [field.label for field in self if field.name in ENGINE_SETTINGS]
        return f"{', '.join(labels[:-1])} or {labels[-1]}"

    @classmethod
    def initial_for(cls, deployment: Deployment) -> dict:
        return {
            "kind": deployment.kind, "batch_window_ms": deployment.batch_window_ms,
            "max_batch_size": deployment.max_batch_size, "min_replicas": deployment.min_replicas,
            "max_replicas": deployment.max_replicas, "scale_to_zero": deployment.scale_to_zero_seconds > 0,
            "scale_to_zero_seconds": deployment.scale_to_zero_seconds or 300, "queue_limit": deployment.queue_limit,
            "dtype": deployment.dtype, "quantization": deployment.quantization,
        }


class DeploymentForm(DeploymentSettingsForm):
    """A new deployment: the model and the name, then the settings."""

    model = forms.ModelChoiceField(queryset=CatalogModel.objects.filter(is_active=True), to_field_name="slug",
                                   empty_label="Choose a model", label="Model")
    name = forms.RegexField(
        label="Deployment name", max_length=100, regex=r"^[a-z0-9][a-z0-9._-]{0,99}$",
        error_messages={"invalid": "Use lowercase letters, digits, '.', '_' or '-', starting with a letter or digit."},
        help_text="What your code passes as model. Lowercase letters, digits, '.', '_' and '-'.",
    )

    field_order = ["model", "name", "kind"]

    def clean_name(self):
        # Checked here too (the service checks again when it saves), so a taken name shows beside
        # the other fields' errors, not on the next submit.
        name = self.cleaned_data["name"]
        if deployment_name_taken(name=name):
            raise forms.ValidationError(taken_message(name))
        return name


class ApiKeyForm(forms.Form):
    name = forms.CharField(label="Name", max_length=100,
                           widget=forms.TextInput(attrs={"placeholder": "e.g. production backend"}))
    scopes = forms.MultipleChoiceField(label="Permissions", choices=SCOPE_CHOICES, initial=["inference"],
                                       widget=forms.CheckboxSelectMultiple)
    expires_in_days = forms.ChoiceField(label="Expires", choices=EXPIRY_CHOICES, required=False)
    # What billing stores and accepts for a limit (billing.models): >= 0, at most LIMIT_MAX USD,
    # to the micro-dollar; the step follows decimal_places (0.000001).
    spend_limit = forms.DecimalField(
        label="Spend limit (USD)", required=False, min_value=Decimal("0"), max_value=SPEND_LIMIT_MAX,
        decimal_places=MONEY["decimal_places"], widget=forms.NumberInput(attrs={"placeholder": "No limit"}),
        error_messages={
            "max_decimal_places": "Enter the limit to the micro-dollar at most: up to %(max)s decimal places.",
            "max_value": f"Enter a limit of at most ${SPEND_LIMIT_MAX:,f}.",
        },
        help_text="Requests are refused once the key has spent this much.",
    )

    def expires_at(self):
        days = self.cleaned_data.get("expires_in_days")
        return timezone.now() + timedelta(days=int(days)) if days else None


class UsageRangeForm(forms.Form):
    # The page shows the errors together, above both dates: each message names its date.
    start = forms.DateField(required=False, widget=forms.DateInput(attrs={"type": "date"}),
                            error_messages={"invalid": "Enter the start date as YYYY-MM-DD."})
    end = forms.DateField(required=False, widget=forms.DateInput(attrs={"type": "date"}),
                          error_messages={"invalid": "Enter the end date as YYYY-MM-DD."})

    def period(self, today: date) -> tuple[date, date]:
        """The chosen period (inclusive); defaults to the last 30 days. Call after is_valid()."""
        data = self.cleaned_data if self.is_bound and self.is_valid() else {}
        return self._period(data.get("start"), data.get("end"), today)

    @staticmethod
    def _period(start: date | None, end: date | None, today: date) -> tuple[date, date]:
        """A missing end is today; a missing start 30 days before the end."""
        end = end or today
        return start or end - timedelta(days=29), end

    def clean(self):
        data = super().clean()
        for name in ("start", "end"):  # the period's day after must exist, and 30 days before
            if data.get(name) and not REPORT_DATES[0] <= data[name] <= REPORT_DATES[1]:
                self.add_error(name, f"Choose a {name} date between {REPORT_DATES[0]} and {REPORT_DATES[1]}.")
        if self.errors:
            return data
        today = timezone.now().date()
        start, end = self._period(data.get("start"), data.get("end"), today)  # as the view
        if start > today:  # no usage yet; and with no end given, the period would end before it starts
            self.add_error("start", f"The start date ({start}) is after today ({today}, UTC): choose today or earlier.")
        elif end < start:
            self.add_error("end", "The end date is before the start date.")
        elif (end - start).days + 1 > MAX_USAGE_DAYS:  # also a start alone, which runs to today
            self.add_error("end" if data.get("end") else "start", f"Choose a period of {MAX_USAGE_DAYS} days at most.")
        return data


def _price_field(label: str) -> forms.DecimalField:
    return forms.DecimalField(label=label, required=False, min_value=Decimal("0"), max_digits=16, decimal_places=6,
                              widget=forms.NumberInput(attrs={"step": "0.000001", "placeholder": "0.00"}))


class ImportModelForm(forms.Form):
    path = forms.CharField(label="Weights path", max_length=1000,
                           help_text="A GGUF file or a Hugging Face safetensors folder, relative to MODELS_ROOT.")
    slug = forms.SlugField(label="Slug", max_length=100, required=False, help_text="Defaults to the file name.")
    display_name = forms.CharField(label="Display name", max_length=200, required=False,
                                   help_text="Defaults to the name in the model's metadata.")
    description = forms.CharField(label="Description", required=False, widget=forms.Textarea(attrs={"rows": 3}))
    price_input_per_mtok = _price_field("Input, per 1M tokens")
    price_cached_input_per_mtok = _price_field("Cached input, per 1M tokens")
    price_output_per_mtok = _price_field("Output, per 1M tokens")
    price_per_request = _price_field("Per request")
    price_per_replica_hour = _price_field("Per replica-hour reserved")

    PRICES = ("price_input_per_mtok", "price_cached_input_per_mtok", "price_output_per_mtok", "price_per_request",
              "price_per_replica_hour")

    def import_arguments(self) -> dict:
        data = self.cleaned_data
        arguments = {"path": data["path"].strip(), "description": data.get("description", "")}
        if data.get("slug"):
            arguments["slug"] = data["slug"]
        if data.get("display_name"):
            arguments["display_name"] = data["display_name"]
        for name in self.PRICES:
            if data.get(name) is not None:
                arguments[name] = data[name]
        return arguments
