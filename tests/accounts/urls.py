"""Test-only views: the key authentication and scope permission behind real DRF views."""

from django.urls import path
from rest_framework.authentication import SessionAuthentication
from rest_framework.response import Response
from rest_framework.views import APIView

from accounts.authentication import ApiKeyAuthentication
from accounts.models import ApiKey
from accounts.permissions import require_scope


class WhoAmI(APIView):
    authentication_classes = [ApiKeyAuthentication, SessionAuthentication]
    permission_classes = [require_scope("inference")]

    def get(self, request):
        key = request.auth if isinstance(request.auth, ApiKey) else None
        return Response({
            "user": str(request.user),
            "authenticated": request.user.is_authenticated,
            "key_id": key.pk if key else None,
            "organization": key.organization.slug if key else None,
        })


class Manage(WhoAmI):
    permission_classes = [require_scope("manage")]


urlpatterns = [path("whoami", WhoAmI.as_view()), path("manage", Manage.as_view())]
