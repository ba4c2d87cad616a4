"""Every write the dashboard makes beyond other apps' own services. Keyword-only arguments.

Sign-up (a user and their first organization), invitations, member roles with their permission
rules, and paying a top-up with a card token from Stripe.js.
"""

from __future__ import annotations

import secrets
from datetime import timedelta
from typing import Callable


from django.conf import settings
from django.core.exceptions import ValidationError
from django.core.mail import BadHeaderError, send_mail
from django.core.validators import validate_email
from django.db import IntegrityError, transaction
from django.utils import timezone

from accounts import services as account_services
from accounts.errors import InvalidInput
from accounts.models import CONTROL_CHARACTERS, MANAGER_ROLES, Membership, Organization, User

from . import mail_quota
from .errors import DashboardError, InvalidInvitation, NotAllowed, SignUpClosed
from .models import Invitation, hash_token


INVITATION_TTL = timedelta(days=7)
SIGNUP_CLOSED = ("Accounts on this platform are made by invitation only. Ask an organization's owner or admin "
                 "to invite you, or the platform's operator to create your account.")
OWNER, ADMIN, MEMBER = Membership.Role.OWNER, Membership.Role.ADMIN, Membership.Role.MEMBER
ROLE_RANK = {MEMBER: 0, ADMIN: 1, OWNER: 2}


def _from_accounts(exc: InvalidInput) -> DashboardError:
    return DashboardError(exc.message, field=exc.field)


def default_organization_name(*, name: str, email: str) -> str:
    who = (name or "").strip() or email.split("@")[0]
    return f"{who}'s organization"[:150]


@transaction.atomic
def sign_up(*, email: str, password: str, name: str = "", organization_name: str = "",
            invitation_token: str | None = None) -> User:
    """A new user. With an invitation they join its organization; otherwise a new organization is
    created with them as its owner (billing credits it the sign-up credit), where sign-up is open
    (``SIGNUP_OPEN``). All or nothing."""
    invitation = _open_invitation(invitation_token) if invitation_token else None
    if invitation is None and not settings.SIGNUP_OPEN:
        raise SignUpClosed(SIGNUP_CLOSED)
    try:
        # An invitation's link came by email: its address is confirmed; an open sign-up's is not yet.
        user = account_services.create_user(email=email, password=password, name=(name or "").strip(),
                                            email_verified=invitation is not None or not settings.SIGNUP_VERIFY_EMAIL)
        if invitation is not None:
            accept_invitation(raw_token=invitation_token, user=user)
        else:
            try:
                account_services.create_organization(
                    name=(organization_name or "").strip() or default_organization_name(name=name, email=user.email),
                    owner=user,
                )
            except InvalidInput as exc:  # the organization's name is the form's organization_name
                raise InvalidInput("organization_name" if exc.field == "name" else exc.field, exc.message) from None
    except InvalidInput as exc:
        raise _from_accounts(exc) from None
    return user


# Confirmation emails to one user: one a minute, CONFIRMATIONS_A_DAY a day (``mail_quota``).
CONFIRMATIONS_A_DAY = mail_quota.A_DAY


def confirmation_keys(user: User) -> tuple[str, str]:
    """The cache's counts of one user's confirmation emails (this minute's, today's)."""
    return mail_quota.keys("confirmation", mail_quota.of_user(user))


def _may_send_confirmation(user: User) -> str | None:
    """Count a confirmation email to ``user``; why not, if it may not go (None: it may)."""
    over = mail_quota.take("confirmation", mail_quota.of_user(user), a_day=CONFIRMATIONS_A_DAY)
    if over == "minute":
        return (f"A link went to {user.email} less than a minute ago: look for it (in the spam folder too), or "
                "ask again in a minute.")
    if over == "day":
        return (f"{CONFIRMATIONS_A_DAY} links went to {user.email} today, the most a day: look for them (in the "
                "spam folder too), or ask again tomorrow.")
    return None


def send_email_confirmation(*, user: User, link_for: Callable[[str, str], str]) -> None:
    """Mail ``user`` the link that confirms their address (``link_for(uid, token)``); DashboardError
    when the mail cannot be sent, or when one went less than a minute ago or CONFIRMATIONS_A_DAY
    went today."""
    from accounts.email_verification import link_parts

    if (refusal := _may_send_confirmation(user)) is not None:
        raise DashboardError(refusal)
    credit = settings.BILLING_SIGNUP_CREDIT
    why = f" and receive your ${credit:,.2f} sign-up credit" if credit > 0 else ""
    try:
        send_mail(
            subject="Confirm your email address",
            message=(f"Confirm that {user.email} is yours{why}:\n\n{link_for(*link_parts(user))}\n\n"
                     "If you did not create an account, ignore this email."),
            from_email=None,
            recipient_list=[user.email],
        )
    except (OSError, BadHeaderError) as exc:
        mail_quota.give_back("confirmation", mail_quota.of_user(user))
        raise DashboardError(f"The confirmation email could not be sent ({exc}); try again later.") from None


def confirm_email(*, uid: str, token: str) -> User:
    """Confirm the address a link names (and so grant the sign-up credit it held back); raises
    DashboardError for a link that is not, or no longer, good."""
    from accounts.email_verification import user_for

    user = user_for(uid, token)
    if user is None:
        raise DashboardError("This confirmation link is not valid any more: it was used already, or it expired. "
                             "Sign in to have a new one sent.")
    account_services.verify_email(user=user)
    return user


def create_organization(*, name: str, owner: User) -> Organization:
    try:
        return account_services.create_organization(name=name, owner=owner)
    except InvalidInput as exc:
        raise _from_accounts(exc) from None


def create_api_key(*, organization: Organization, created_by: User, name: str, scopes: list[str],
                   expires_at=None, spend_limit=None):
    """A key and its spend limit together: a key is never left without the limit it was asked
    with. Returns (api_key, secret); raises InvalidInput (its ``field`` the form's) for either."""
    from billing.errors import InvalidParameter
    from billing.services import set_api_key_spend_limit

    with transaction.atomic():
        api_key, secret = account_services.create_api_key(organization=organization, name=name, scopes=scopes,
                                                          created_by=created_by, expires_at=expires_at)
        if spend_limit is not None:
            try:
                set_api_key_spend_limit(api_key=api_key, amount_limit=spend_limit)
            except InvalidParameter as exc:
                raise InvalidInput("spend_limit", exc.message) from None
    return api_key, secret


# --- roles ------------------------------------------------------------------------------------------


def can_manage_members(role: str | None) -> bool:
    return role in MANAGER_ROLES


def _assignable(actor_role: str, role: str) -> None:
    if role not in Membership.Role.values:
        raise DashboardError(f"The role must be one of {', '.join(Membership.Role.values)}.", field="role")
    if not can_manage_members(actor_role):
        raise NotAllowed("Only owners and admins can manage members.")
    if role == OWNER and actor_role != OWNER:
        raise NotAllowed("Only an owner can make someone an owner.", field="role")


def _owners(organization: Organization) -> int:
    return Membership.objects.filter(organization=organization, role=OWNER).count()


@transaction.atomic
def change_member_role(*, organization: Organization, actor: User, member: User, role: str) -> Membership:
    """Changes ``member``'s role. Owners may assign any role; admins may not touch owners nor make
    one; the last owner keeps the role."""
    account_services.lock_organization(organization)  # two owners demoting each other: one wins
    actor_role = _role_of(organization, actor)
    _assignable(actor_role, role)
    membership = Membership.objects.filter(organization=organization, user=member).first()
    if membership is None:
        raise DashboardError("This person is not a member of the organization.")
    if membership.role == OWNER and actor_role != OWNER:
        raise NotAllowed("Only an owner can change another owner's role.")
    if membership.role == OWNER and role != OWNER and _owners(organization) <= 1:
        raise DashboardError("The organization needs at least one owner: make someone else an owner first.",
                             field="role")
    return account_services.add_member(organization=organization, user=member, role=role)


@transaction.atomic
def remove_member(*, organization: Organization, actor: User, member: User) -> int:
    """Removes ``member``; anyone may leave, owners and admins may remove others (admins not owners).
    Their API keys for the organization and the invitations they sent that are still open are
    revoked: neither may outlive their access. Returns how many keys were revoked."""
    account_services.lock_organization(organization)
    if actor.pk != member.pk:
        actor_role = _role_of(organization, actor)
        if not can_manage_members(actor_role):
            raise NotAllowed("Only owners and admins can remove members.")
        if _role_of(organization, member) == OWNER and actor_role != OWNER:
            raise NotAllowed("Only an owner can remove an owner.")
    try:
        revoked = account_services.remove_member(organization=organization, user=member)
    except InvalidInput as exc:
        raise _from_accounts(exc) from None
    Invitation.objects.filter(organization=organization, invited_by=member, accepted_at__isnull=True,
                              revoked_at__isnull=True).update(revoked_at=timezone.now())
    return revoked


def _role_of(organization: Organization, user: User) -> str | None:
    return Membership.objects.filter(organization=organization, user=user).values_list("role", flat=True).first()


# --- invitations ------------------------------------------------------------------------------------


def invite_member(*, organization: Organization, invited_by: User, email: str, role: str,
                  link_for: Callable[[str], str]) -> Invitation:
    """Invites ``email`` with ``role`` and mails the link (``link_for(token)``). Refused for members
    already in, and for a second open invitation to the same address."""
    email = (email or "").strip().lower()
    _assignable(_role_of(organization, invited_by), role)
    try:
        validate_email(email)
    except ValidationError:
        raise DashboardError("Enter a valid email address.", field="email") from None
    if Membership.objects.filter(organization=organization, user__email__iexact=email).exists():
        raise DashboardError(f"{email} is already a member of {organization.name}.", field="email")
    # An expired invitation no longer blocks a new one.
    Invitation.objects.filter(organization=organization, email__iexact=email, accepted_at__isnull=True,
                              revoked_at__isnull=True, expires_at__lte=timezone.now()).update(revoked_at=timezone.now())
    raw = secrets.token_urlsafe(32)
    inviter = invited_by.get_full_name()
    try:
        with transaction.atomic():
            invitation = Invitation.objects.create(
                organization=organization, email=email, role=role, token_hash=hash_token(raw),
                invited_by=invited_by, expires_at=timezone.now() + INVITATION_TTL,
            )
    except IntegrityError:
        raise DashboardError(f"{email} already has a pending invitation.", field="email") from None
    try:
        _count_invitation(organization, email)
    except DashboardError:
        invitation.delete()
        raise
    try:  # after the commit: a slow mail server must not hold the database's write lock (SQLite)
        send_mail(
            subject=_one_line(f"{inviter} invited you to {organization.name}"),
            message=(
                f"{inviter} invited you to join {organization.name} as {invitation.role_label}.\n\n"
                f"Accept the invitation: {link_for(raw)}\n\n"
                f"The link works for {INVITATION_TTL.days} days. If you did not expect it, ignore this email."
            ),
            from_email=None,
            recipient_list=[email],
        )
    except (OSError, BadHeaderError) as exc:  # refused, unreachable (SMTPException is one), or a bad header
        invitation.delete()  # not kept: a retry must not find it "already pending"
        mail_quota.give_back("invitation", _invitation_recipient(organization, email))
        mail_quota.give_back("invitations", mail_quota.of_organization(organization), every_s=None)
        raise DashboardError(f"The invitation email could not be sent ({exc}); nothing was saved, try again "
                             "later.", field="email") from None
    except BaseException:
        invitation.delete()  # whatever failed, no invitation is left that nobody was told about
        raise
    return invitation


# Invitations (whose subject and text carry names their sender chose): to one address from one
# organization, one a minute and INVITATIONS_A_DAY a day (revoking and inviting again counts);
# from one organization, ORGANIZATION_INVITATIONS_A_DAY a day.
INVITATIONS_A_DAY = mail_quota.A_DAY
ORGANIZATION_INVITATIONS_A_DAY = 50


def _invitation_recipient(organization: Organization, email: str) -> str:
    return f"{mail_quota.of_organization(organization)}:{email}"


def _count_invitation(organization: Organization, email: str) -> None:
    over = mail_quota.take("invitation", _invitation_recipient(organization, email), a_day=INVITATIONS_A_DAY)
    if over == "minute":
        raise DashboardError(f"An invitation went to {email} less than a minute ago; try again in a minute.",
                             field="email")
    if over == "day":
        raise DashboardError(f"{INVITATIONS_A_DAY} invitations went to {email} today, the most a day; try again "
                             "tomorrow.", field="email")
    if mail_quota.take("invitations", mail_quota.of_organization(organization), every_s=None,
                       a_day=ORGANIZATION_INVITATIONS_A_DAY) is not None:
        mail_quota.give_back("invitation", _invitation_recipient(organization, email))
        raise DashboardError(f"{organization.name} sent {ORGANIZATION_INVITATIONS_A_DAY} invitations today, the "
                             "most a day; try again tomorrow.", field="email")


def _one_line(text: str) -> str:
    """``text`` fit for an email header: a name saved before control characters were refused
    (or by other means) may still hold a line break, which Django refuses in a header."""
    return " ".join(CONTROL_CHARACTERS.sub(" ", text).split())



def _open_invitation(raw_token: str | None) -> Invitation:
    invitation = Invitation.objects.select_related("organization").filter(token_hash=hash_token(raw_token or "")).first()
    if invitation is None or not invitation.is_open:
        raise InvalidInvitation("This invitation link is not valid any more: ask for a new one.")
    return invitation


def invitation_for_token(*, raw_token: str) -> Invitation:
    """The open invitation behind a link; InvalidInvitation otherwise."""
    return _open_invitation(raw_token)


@transaction.atomic
def accept_invitation(*, raw_token: str, user: User) -> Membership:
    """Adds ``user`` to the invitation's organization with its role (a member keeps a higher role)."""
    invitation = _open_invitation(raw_token)
    invitation = Invitation.objects.select_for_update().get(pk=invitation.pk)
    if not invitation.is_open:
        raise InvalidInvitation("This invitation link is not valid any more: ask for a new one.")
    if invitation.email.lower() != user.email.lower():
        raise InvalidInvitation(f"This invitation is for {invitation.email}: log in with that address to accept it.")
    try:  # an invitation carries its sender's authority: not more than they still have
        _assignable(_role_of(invitation.organization, invitation.invited_by), invitation.role)
    except DashboardError:
        raise InvalidInvitation("Whoever sent this invitation can no longer grant it: ask for a new one.") from None
    existing = Membership.objects.filter(organization=invitation.organization, user=user).first()
    if existing is not None and ROLE_RANK[existing.role] >= ROLE_RANK[invitation.role]:
        membership = existing
    else:
        membership = account_services.add_member(organization=invitation.organization, user=user, role=invitation.role)
    invitation.accepted_at, invitation.accepted_by = timezone.now(), user
    invitation.save(update_fields=["accepted_at", "accepted_by"])
    if not user.email_verified:  # the invitation's link was mailed to this address
        account_services.verify_email(user=user)
    return membership


def revoke_invitation(*, organization: Organization, actor: User, invitation_id: int) -> None:
    """Revokes an open invitation of ``organization``; InvalidInvitation when there is none by that
    id (unknown, another organization's, already accepted or revoked)."""
    if not can_manage_members(_role_of(organization, actor)):
        raise NotAllowed("Only owners and admins can manage invitations.")
    revoked = Invitation.objects.filter(pk=invitation_id, organization=organization, accepted_at__isnull=True,
                                        revoked_at__isnull=True).update(revoked_at=timezone.now())
    if not revoked:
        raise InvalidInvitation("There is no such pending invitation: it may have been accepted or revoked already.")
