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


def test_a_catalog_models_slug_cannot_be_renamed_in_the_admin(client):
    """Usage records and queued billing events name the model by its slug."""
    client.force_login(User.objects.create_superuser(email="root@example.com", password="a-long-pass-phrase-42"))
    model = CatalogModel.objects.create(slug="tiny", display_name="Tiny", architecture="llama", weights_path="t.gguf")
    form = {"slug": "renamed", "display_name": "Tiny 2", "description": "", "license": "", "is_active": "on",
            "price_input_per_mtok": "0", "price_cached_input_per_mtok": "0", "price_output_per_mtok": "0",
            "price_per_request": "0", "price_per_replica_hour": "0", "deployments-TOTAL_FORMS": "0", "deployments-INITIAL_FORMS": "0"}
    response = client.post(f"/admin/models_catalog/catalogmodel/{model.pk}/change/", form)
    assert response.status_code == 302, response.content.decode()[:2000]
    model.refresh_from_db()
    assert (model.slug, model.display_name) == ("tiny", "Tiny 2")
