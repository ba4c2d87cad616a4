"""The operator's admin pages for the catalog and deployments render."""

from __future__ import annotations

import pytest

from accounts.models import User
from models_catalog.models import CatalogModel, Deployment

pytestmark = pytest.mark.django_db


def test_admin_pages_render(client):
    client.force_login(User.objects.create_superuser(email="root@example.com", password="a-long-pass-phrase-42"))
    model = CatalogModel.objects.create(slug="tiny", display_name="Tiny", architecture="llama", weights_path="t.gguf")
    deployment = Deployment.objects.create(model=model, name="tiny", is_public=True)
    for url in ["/admin/models_catalog/catalogmodel/", f"/admin/models_catalog/catalogmodel/{model.pk}/change/",
                "/admin/models_catalog/deployment/", f"/admin/models_catalog/deployment/{deployment.pk}/change/",
                "/admin/models_catalog/deployment/add/"]:
        assert client.get(url).status_code == 200, url
