from django import forms
from django.contrib import admin, messages
from django.contrib.admin.forms import AdminAuthenticationForm
from django.contrib.auth.admin import UserAdmin as DjangoUserAdmin
from django.contrib.auth.forms import AdminUserCreationForm, UserChangeForm

from .login_throttle import ThrottledLogin
from .models import ApiKey, Membership, Organization, User
from .services import revoke_api_key


class AdminLoginForm(ThrottledLogin, AdminAuthenticationForm):
    """The admin site's sign-in, throttled as the dashboard's (staff accounts are the ones worth guessing)."""


admin.site.login_form = AdminLoginForm


class UserCreationForm(AdminUserCreationForm):
    class Meta:
        model = User
        fields = ("email",)

    def clean_email(self):
        email = self.cleaned_data["email"].strip().lower()
        if User.objects.filter(email__iexact=email).exists():
            raise forms.ValidationError("A user with this email address already exists.")
        return email


class UserEditForm(UserChangeForm):
    class Meta:
        model = User
        fields = "__all__"


class MembershipInline(admin.TabularInline):
    model = Membership
    extra = 0
    autocomplete_fields = ["user"]


@admin.register(User)
class UserAdmin(DjangoUserAdmin):
    add_form = UserCreationForm
    form = UserEditForm
    ordering = ["email"]
    list_display = ["email", "name", "is_staff", "is_active", "date_joined", "last_login"]
    list_filter = ["is_staff", "is_superuser", "is_active"]
    search_fields = ["email", "name"]
    readonly_fields = ["date_joined", "last_login"]
    fieldsets = (
        (None, {"fields": ("email", "password")}),
        ("Profile", {"fields": ("name",)}),
        ("Permissions", {"fields": ("is_active", "is_staff", "is_superuser", "groups", "user_permissions")}),
        ("Dates", {"fields": ("last_login", "date_joined")}),
    )
    add_fieldsets = ((None, {"classes": ("wide",), "fields": ("email", "usable_password", "password1", "password2")}),)


@admin.register(Organization)
class OrganizationAdmin(admin.ModelAdmin):
    list_display = ["name", "slug", "created_at"]
    search_fields = ["name", "slug"]
    readonly_fields = ["created_at"]
    inlines = [MembershipInline]


@admin.register(Membership)
class MembershipAdmin(admin.ModelAdmin):
    list_display = ["user", "organization", "role", "created_at"]
    list_filter = ["role"]
    search_fields = ["user__email", "organization__name"]
    autocomplete_fields = ["user", "organization"]


@admin.action(description="Revoke the selected API keys")
def revoke_keys(modeladmin, request, queryset):
    for api_key in queryset:
        revoke_api_key(api_key=api_key)
    modeladmin.message_user(request, f"Revoked {queryset.count()} key(s).", messages.SUCCESS)


@admin.register(ApiKey)
class ApiKeyAdmin(admin.ModelAdmin):
    """Keys are created by their users (dashboard, CLI); the admin can look and revoke, not mint."""

    list_display = ["name", "display_prefix", "organization", "scopes", "created_at", "last_used_at",
                    "expires_at", "revoked_at"]
    list_filter = ["revoked_at"]
    search_fields = ["name", "prefix", "organization__name"]
    readonly_fields = ["organization", "created_by", "origin", "prefix", "scopes", "created_at", "last_used_at",
                       "revoked_at"]
    exclude = ["secret_hash"]
    actions = [revoke_keys]

    def has_add_permission(self, request):
        return False
