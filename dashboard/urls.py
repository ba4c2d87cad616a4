"""The dashboard's pages. Sign-in pages use Django's auth views with the dashboard's templates."""

import re

from django.conf import settings
from django.contrib.auth import views as auth_views
from django.urls import path, re_path

from . import static_files
from .forms import EmailLoginForm, ThrottledPasswordResetForm
from .views import account, billing, catalog, deployments, keys, logout, logs, operator, playground, usage

urlpatterns = [
    # The dashboard's own assets (CSS, JS, the vendored htmx and Chart.js) from the app's static
    # folders, whatever DEBUG says: `inference-platform up` serves everything from one ASGI process,
    # offline. A deployment behind a proxy can serve `collectstatic`'s folder itself instead.
    re_path(rf"^{re.escape(settings.STATIC_URL.strip('/'))}/(?P<path>.+)$", static_files.serve_whole, name="static"),
    # Accounts
    path("login/", auth_views.LoginView.as_view(authentication_form=EmailLoginForm, redirect_authenticated_user=True),
         name="login"),
    path("logout/", logout.logout, name="logout"),
    path("signup/", account.signup, name="signup"),
    path("password-reset/", auth_views.PasswordResetView.as_view(form_class=ThrottledPasswordResetForm),
         name="password_reset"),
    path("password-reset/sent/", auth_views.PasswordResetDoneView.as_view(), name="password_reset_done"),
    path("reset/<uidb64>/<token>/", auth_views.PasswordResetConfirmView.as_view(), name="password_reset_confirm"),
    path("reset/done/", auth_views.PasswordResetCompleteView.as_view(), name="password_reset_complete"),
    path("invitations/<str:token>/", account.invitation, name="invitation"),
    path("confirm-email/<uidb64>/<token>/", account.email_confirm, name="email-confirm"),
    path("confirm-email/resend/", account.email_confirm_resend, name="email-confirm-resend"),
    # Organization
    path("", account.home, name="home"),
    path("organizations/new/", account.organization_new, name="organization-new"),
    path("organizations/switch/", account.organization_switch, name="organization-switch"),
    path("settings/members/", account.members, name="members"),
    path("settings/members/<int:user_id>/role/", account.member_role, name="member-role"),
    path("settings/members/<int:user_id>/remove/", account.member_remove, name="member-remove"),
    path("settings/invitations/<int:invitation_id>/revoke/", account.invitation_revoke, name="invitation-revoke"),
    # Models and deployments
    path("models/", catalog.catalog, name="catalog"),
    path("models/<slug:slug>/", catalog.model_detail, name="model-detail"),
    path("deploy/", deployments.deployment_new, name="deployment-new"),
    path("deployments/", deployments.deployment_list, name="deployments"),
    path("deployments/_rows/", deployments.deployment_rows, name="deployment-rows"),
    path("deployments/<str:name>/", deployments.deployment_detail, name="deployment-detail"),
    path("deployments/<str:name>/metrics.json", deployments.deployment_metrics, name="deployment-metrics"),
    path("deployments/<str:name>/status/", deployments.deployment_status, name="deployment-status"),
    path("deployments/<str:name>/settings/", deployments.deployment_settings, name="deployment-settings"),
    path("deployments/<str:name>/start/", deployments.deployment_start, name="deployment-start"),
    path("deployments/<str:name>/stop/", deployments.deployment_stop, name="deployment-stop"),
    path("deployments/<str:name>/delete/", deployments.deployment_delete, name="deployment-delete"),
    # Using them
    path("playground/", playground.playground, name="playground"),
    path("playground/cost/", playground.reply_cost, name="playground-cost"),
    path("api-keys/", keys.api_keys, name="api-keys"),
    path("api-keys/<int:key_id>/revoke/", keys.api_key_revoke, name="api-key-revoke"),
    path("responses/", logs.response_log, name="responses"),
    path("responses/<str:response_id>/", logs.response_detail, name="response-detail"),
    path("responses/<str:response_id>/delete/", logs.response_delete, name="response-delete"),
    path("batches/", logs.batch_list, name="batches"),
    path("batches/_rows/", logs.batch_rows, name="batch-rows"),
    path("batches/<str:batch_id>/cancel/", logs.batch_cancel, name="batch-cancel"),
    path("files/<str:file_id>/", logs.batch_file, name="batch-file"),
    path("usage/", usage.usage, name="usage"),
    path("billing/topups/<str:payment_intent_id>/pay/", billing.topup_pay, name="topup-pay"),
    # Operators
    path("operator/fleet/", operator.fleet, name="fleet"),
    path("operator/fleet/_workers/", operator.fleet_workers, name="fleet-workers"),
    path("operator/models/import/", operator.model_import, name="model-import"),
]
