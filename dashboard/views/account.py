"""Sign-up, the overview, organizations (create, switch), members and invitations."""

from __future__ import annotations

from django.conf import settings
from django.contrib import messages
from django.contrib.auth import login
from django.contrib.auth.decorators import login_required
from django.http import Http404
from django.shortcuts import redirect, render
from django.urls import reverse
from django.views.decorators.http import require_http_methods, require_POST

from accounts.models import User
from accounts.selectors import organizations_for_user

from .. import selectors, services
from ..errors import DashboardError, InvalidInvitation
from ..forms import InviteForm, OrganizationForm, RoleForm, SignUpForm
from ..links import absolute_url
from ..organizations import choose_organization
from .common import organization_required, safe_next


def _form_error(form, exc: DashboardError) -> None:
    field = exc.field if exc.field in form.fields else None
    form.add_error(field, exc.message)


@require_http_methods(["GET", "POST"])
def signup(request):
    if request.user.is_authenticated and request.method == "GET" and not request.GET.get("invitation"):
        return redirect("home")
    token = request.POST.get("invitation") or request.GET.get("invitation") or ""
    invitation = ended = None
    if token:
        try:
            invitation = services.invitation_for_token(raw_token=token)
        except InvalidInvitation as exc:
            ended, token = exc.message, ""
    if invitation is None and not settings.SIGNUP_OPEN:  # the service refuses it too
        if ended:
            messages.error(request, ended)
        return render(request, "registration/signup.html", {"closed": services.SIGNUP_CLOSED}, status=403)
    if request.method == "POST" and ended:
        # Revoked, expired or used while the form was open: they asked to join, so nothing is
        # created (no organization of their own behind their back); the form stays, without it.
        form = SignUpForm({**request.POST.dict(), "invitation": ""})
        form.is_valid()
        form.add_error(None, f"{ended} Nothing was created; you may create an account with an organization of "
                             "your own instead.")
        return render(request, "registration/signup.html", {"form": form}, status=400)
    if request.method == "POST":
        form = SignUpForm(request.POST)
        if form.is_valid():
            data = form.cleaned_data
            try:
                user = services.sign_up(email=data["email"], password=data["password"], name=data["name"],
                                        organization_name=data["organization_name"], invitation_token=token or None)
            except DashboardError as exc:
                _form_error(form, exc)
            else:
                login(request, user, backend="django.contrib.auth.backends.ModelBackend")
                organization = organizations_for_user(user=user).first()
                if organization is not None:
                    choose_organization(request, organization)
                if user.email_verified:
                    messages.success(request, f"Welcome! {organization.name} is ready"
                                              + (" with free credit to try it out." if not invitation else "."))
                else:  # every page's banner says where the link went
                    messages.success(request, f"Welcome! {organization.name} is ready.")
                    _send_confirmation(request, user, said=False)
                return redirect("home")
    else:
        if ended:
            messages.error(request, ended)
        form = SignUpForm(initial={"email": invitation.email if invitation else "", "invitation": token})
    return render(request, "registration/signup.html", {"form": form, "invitation": invitation})


def _send_confirmation(request, user, *, said: bool = True) -> None:
    def link_for(uid: str, token: str) -> str:
        return absolute_url(request, reverse("email-confirm", args=[uid, token]))

    try:
        services.send_email_confirmation(user=user, link_for=link_for)
    except DashboardError as exc:
        messages.error(request, exc.message)
    else:
        if said:
            messages.info(request, f"We sent a link to {user.email}: open it to confirm your address"
                                   + (" and receive your sign-up credit." if settings.BILLING_SIGNUP_CREDIT > 0 else "."))


@require_http_methods(["GET"])
def email_confirm(request, uidb64: str, token: str):
    """The link in the confirmation email: it works signed in or not, as a password reset's does."""
    try:
        user = services.confirm_email(uid=uidb64, token=token)
    except DashboardError as exc:
        messages.error(request, exc.message)
    else:
        messages.success(request, f"Thank you: {user.email} is confirmed.")
    return redirect("home")


@login_required
@require_POST
def email_confirm_resend(request):
    if request.user.email_verified:
        messages.info(request, "Your email address is confirmed already.")
    else:
        _send_confirmation(request, request.user)
    return redirect(safe_next(request))


@organization_required
def home(request):
    data = selectors.overview(organization=request.organization)
    steps = [
        {"done": data["key_count"] > 0, "title": "Create an API key", "text": "Your code authenticates with it.",
         "url": reverse("api-keys"), "action": "Create key"},
        {"done": data["deployment_count"] > 0, "title": "Deploy a model",
         "text": "Your own endpoint with its batching and scaling settings.", "url": reverse("deployment-new"),
         "action": "Deploy"},
        {"done": data["has_usage"], "title": "Send your first request",
         "text": "Chat in the playground or call the API.", "url": reverse("playground"), "action": "Open playground"},
        {"done": data["has_topup"], "title": "Add credit", "text": "Top up with a card when the free credit runs low.",
         "url": reverse("billing"), "action": "Top up"},
    ]
    return render(request, "dashboard/home.html", {**data, "steps": steps,
                                                   "steps_done": sum(1 for s in steps if s["done"])})


@login_required
@require_http_methods(["GET", "POST"])
def organization_new(request):
    form = OrganizationForm(request.POST or None)
    if request.method == "POST" and form.is_valid():
        try:
            organization = services.create_organization(name=form.cleaned_data["name"], owner=request.user)
        except DashboardError as exc:
            _form_error(form, exc)
        else:
            choose_organization(request, organization)
            messages.success(request, f"{organization.name} is ready. You are its owner.")
            return redirect("home")
    return render(request, "dashboard/organization_new.html", {"form": form})


@login_required
@require_POST
def organization_switch(request):
    try:
        organization = organizations_for_user(user=request.user).filter(pk=int(request.POST.get("organization", ""))).first()
    except ValueError:
        organization = None
    if organization is None:
        raise Http404("No such organization.")
    choose_organization(request, organization)
    messages.info(request, f"Switched to {organization.name}.")
    # Pages of one organization's objects make no sense in another: go to the section's list.
    target = safe_next(request, reverse("home"))
    for section in ("/deployments/", "/api-keys/"):
        if target.startswith(section):
            target = section
    return redirect(target)


@organization_required
@require_http_methods(["GET", "POST"])
def members(request):
    organization = request.organization
    invite_form = InviteForm(request.POST or None, actor_role=request.role)
    can_manage = services.can_manage_members(request.role)
    refused = request.method == "POST" and not can_manage
    if refused:  # a member has no invite form on the page, where its errors would show
        messages.error(request, "Only owners and admins can invite people: ask one of them.")
    elif request.method == "POST":
        if invite_form.is_valid():
            try:
                invitation = services.invite_member(
                    organization=organization, invited_by=request.user, email=invite_form.cleaned_data["email"],
                    role=invite_form.cleaned_data["role"],
                    link_for=lambda token: absolute_url(request, reverse("invitation", args=[token])),
                )
            except DashboardError as exc:
                _form_error(invite_form, exc)
            else:
                messages.success(request, f"Invitation sent to {invitation.email}.")
                return redirect("members")
    data = selectors.members_page(organization=organization, user=request.user)
    # Not ``memberships``: that name is the organization switcher's (the context processor's).
    return render(request, "dashboard/members.html", {
        "members": data["memberships"], "invitations": data["invitations"],
        "invite_form": invite_form, "role_form": RoleForm(),
        "can_manage": can_manage, "is_owner": request.role == "owner", "leave_refusal": data["leave_refusal"],
    }, status=403 if refused else 200)


def _member(request, user_id: int) -> User:
    user = User.objects.filter(pk=user_id, memberships__organization=request.organization).first()
    if user is None:
        raise Http404("No such member.")
    return user


@organization_required
@require_POST
def member_role(request, user_id: int):
    member = _member(request, user_id)
    form = RoleForm(request.POST)
    if not form.is_valid():
        messages.error(request, "Choose a role.")
        return redirect("members")
    try:
        services.change_member_role(organization=request.organization, actor=request.user, member=member,
                                    role=form.cleaned_data["role"])
    except DashboardError as exc:
        messages.error(request, exc.message)
    else:
        messages.success(request, f"{member.email} is now {form.cleaned_data['role']}.")
    return redirect("members")


@organization_required
@require_POST
def member_remove(request, user_id: int):
    member = _member(request, user_id)
    try:
        revoked = services.remove_member(organization=request.organization, actor=request.user, member=member)
    except DashboardError as exc:
        messages.error(request, exc.message)
        return redirect("members")

    def revoked_keys(who: str) -> str:
        if not revoked:
            return ""
        return f" {revoked} API key{'s' if revoked != 1 else ''} {who} created {'were' if revoked != 1 else 'was'} revoked."

    if member.pk == request.user.pk:
        messages.success(request, f"You left {request.organization.name}.{revoked_keys('you')}")
        return redirect("home")
    messages.success(request, f"{member.email} was removed from {request.organization.name}.{revoked_keys('they')}")
    return redirect("members")


@organization_required
@require_POST
def invitation_revoke(request, invitation_id: int):
    try:
        services.revoke_invitation(organization=request.organization, actor=request.user, invitation_id=invitation_id)
    except DashboardError as exc:
        messages.error(request, exc.message)
    else:
        messages.success(request, "Invitation revoked.")
    return redirect("members")


@require_http_methods(["GET", "POST"])
def invitation(request, token: str):
    """The link in an invitation email: accept it (logged in with the invited address), or sign up
    / log in first."""
    try:
        invitation = services.invitation_for_token(raw_token=token)
    except InvalidInvitation as exc:
        return render(request, "registration/invitation.html", {"error": exc.message}, status=404)
    if request.method == "POST":
        if not request.user.is_authenticated:
            return redirect(f"{reverse('login')}?next={request.path}")
        try:
            membership = services.accept_invitation(raw_token=token, user=request.user)
        except InvalidInvitation as exc:
            messages.error(request, exc.message)
        else:
            choose_organization(request, membership.organization)
            messages.success(request, f"You joined {membership.organization.name}.")
            return redirect("home")
    account_exists = User.objects.filter(email__iexact=invitation.email).exists()
    return render(request, "registration/invitation.html", {
        "invitation": invitation, "token": token, "account_exists": account_exists,
        "email_matches": request.user.is_authenticated and request.user.email.lower() == invitation.email.lower(),
    })
