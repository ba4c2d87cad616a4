"""The Batches page: an organization's Batch API jobs with their progress and files, a cancel,
and file downloads; another organization's stay out of sight."""

from __future__ import annotations

import json
from datetime import timedelta

import pytest
from django.utils import timezone

from gateway import services
from gateway.models import Batch

pytestmark = pytest.mark.django_db


def _batch(organization, *, lines: int = 3, done: int = 1, status: str = "in_progress") -> Batch:
    source = services.create_file(organization_id=organization.pk, purpose="batch", filename="in.jsonl",
                                  content=b'{"custom_id": "a"}\n')
    now = timezone.now()
    batch = Batch.objects.create(
        pk=f"batch_{source.pk[5:]}", organization=organization, endpoint="/v1/chat/completions", model="smollm2",
        input_file_id=source.pk, requests=json.dumps([{"custom_id": f"c{i}", "body": {}} for i in range(lines)]),
        total=lines, completion_window="24h", created_at=now, in_progress_at=now, expires_at=now + timedelta(hours=24),
        status=status)
    for line in range(done):
        services.record_outcome(batch_id=batch.pk, line=line, request_id=f"r{line}", status_code=200,
                                body={"usage": {"prompt_tokens": 4, "completion_tokens": 6}})
    return batch


def test_the_page_shows_each_batch_with_its_progress_and_polls_while_one_runs(ada, acme, globex):
    _, organization = acme
    running = _batch(organization)
    theirs = _batch(globex[1])
    html = ada.get("/batches/").content.decode()
    assert f'data-batch="{running.pk}"' in html and theirs.pk not in html
    assert 'data-progress="1/3"' in html and "1 done of 3" in html
    assert 'hx-get="/batches/_rows/"' in html  # it polls: a batch runs
    assert "Cancel" in html
    rows = ada.get("/batches/_rows/")
    assert rows.status_code == 200  # htmx polls on
    assert f'data-batch="{running.pk}"' in rows.content.decode() and "<html" not in rows.content.decode()
    assert theirs.pk not in rows.content.decode()


def test_a_batch_is_cancelled_from_the_page_and_its_files_download(ada, acme, globex):
    _, organization = acme
    batch = _batch(organization)
    response = ada.post(f"/batches/{batch.pk}/cancel/", follow=True)
    assert "is cancelling" in response.content.decode()
    assert Batch.objects.get(pk=batch.pk).status == "cancelling"
    ended = services.finish_batch(batch_id=batch.pk)
    html = ada.get("/batches/").content.decode()
    assert 'hx-get="/batches/_rows/"' not in html  # nothing runs: no polling
    assert ada.get("/batches/_rows/").status_code == 286  # and a page still polling is told to stop
    download = ada.get(f"/files/{ended.output_file_id}/")
    assert download.status_code == 200 and download["Content-Disposition"].startswith("attachment;")
    assert json.loads(b"".join(download).decode().splitlines()[0])["custom_id"] == "c0"
    theirs = _batch(globex[1])
    assert ada.get(f"/files/{theirs.input_file_id}/").status_code == 404
    assert ada.post(f"/batches/{theirs.pk}/cancel/").status_code == 404
    assert Batch.objects.get(pk=theirs.pk).status == "in_progress"


def test_an_expired_output_file_is_gone_at_once(ada, acme, settings):
    _, organization = acme
    batch = _batch(organization, lines=1)
    ended = services.finish_batch(batch_id=batch.pk)
    assert ada.get(f"/files/{ended.output_file_id}/").status_code == 200
    from gateway.models import UploadedFile

    UploadedFile.objects.filter(pk=ended.output_file_id).update(
        created_at=timezone.now() - timedelta(days=settings.BATCH_OUTPUT_RETENTION_DAYS, seconds=1))
    assert ada.get(f"/files/{ended.output_file_id}/").status_code == 404
    assert ada.get(f"/files/{batch.input_file_id}/").status_code == 200  # an upload does not expire


def test_a_deleted_file_shows_as_gone_not_as_a_broken_link(ada, acme):
    _, organization = acme
    ended = services.finish_batch(batch_id=_batch(organization, lines=1).pk)
    assert services.delete_file(organization_id=organization.pk, file_id=ended.input_file_id)
    html = ada.get("/batches/").content.decode()
    assert f'href="/files/{ended.input_file_id}/"' not in html and "Input (gone)" in html
    assert f'href="/files/{ended.output_file_id}/"' in html  # the others still download


def test_the_pages_need_a_signed_in_member(client):
    for path in ("/batches/", "/batches/_rows/", "/files/file-x/"):
        assert client.get(path).status_code == 302


def test_no_batch_yet_says_how_to_start_one(ada):
    html = ada.get("/batches/").content.decode()
    assert "No batches yet" in html and "hx-get" not in html


def test_a_member_cancels_the_batches_their_keys_started_and_no_other(acme):
    from django.test import Client

    from accounts.services import add_member, create_api_key
    from tests.dashboard.conftest import sign_up

    owner, organization = acme
    member, _ = sign_up("Mel", "Mel's own")
    add_member(organization=organization, user=member, role="member")
    theirs, owners = _batch(organization), _batch(organization)
    for batch, user in ((theirs, member), (owners, owner)):
        key, _ = create_api_key(organization=organization, name=f"{user.pk}-key", scopes=["inference"], created_by=user)
        Batch.objects.filter(pk=batch.pk).update(api_key=key)
    client = Client()
    client.force_login(member)
    client.post("/organizations/switch/", {"organization": organization.pk})
    rows = client.get("/batches/_rows/").content.decode()
    assert f"/batches/{theirs.pk}/cancel/" in rows and f"/batches/{owners.pk}/cancel/" not in rows
    assert client.post(f"/batches/{owners.pk}/cancel/").status_code == 403
    assert Batch.objects.get(pk=owners.pk).status == "in_progress"
    client.post(f"/batches/{theirs.pk}/cancel/")
    assert Batch.objects.get(pk=theirs.pk).status == "cancelling"
