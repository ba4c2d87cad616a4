"""The fleet page (staff): every deployment, and the workers answering on the broker."""

from __future__ import annotations

from models_catalog.services import create_deployment


def test_the_fleet_lists_every_organizations_deployments(client, acme, globex, catalog):
    model, public = catalog
    user, _ = acme
    user.is_staff = True
    user.save()
    create_deployment(organization=globex[1], model=model, name="globex-secret")
    client.force_login(user)
    page = client.get("/operator/fleet/").content.decode()
    assert "globex-secret" in page and "Globex" in page and public.name in page


def test_the_workers_fragment_answers_without_workers(client, acme, settings):
    user, _ = acme
    user.is_staff = True
    user.save()
    client.force_login(user)
    response = client.get("/operator/fleet/_workers/")
    assert response.status_code == 200
