"""GET /logout/ (a typed or bookmarked address) asks to confirm; only the POST logs out."""

from __future__ import annotations


def test_get_asks_to_confirm_and_post_logs_out(ada, acme):
    page = ada.get("/logout/")
    html = page.content.decode()
    assert page.status_code == 200 and 'action="/logout/"' in html and "csrfmiddlewaretoken" in html
    assert ada.get("/usage/").status_code == 200  # still logged in
    assert ada.post("/logout/").status_code == 302
    assert ada.get("/usage/").status_code == 302


def test_get_when_logged_out_goes_to_the_login_page(client, db):
    response = client.get("/logout/")
    assert response.status_code == 302 and response["Location"] == "/login/"
