"""The dashboard pages: staff only (others go to the admin login), accessible markup, and the
front-end files served by the project itself."""

from __future__ import annotations

import re

import pytest
from django.contrib.staticfiles import finders
from django.test import Client
from django.urls import reverse

from tests.dashboard.conftest import make_user


@pytest.fixture
def staff_client(db) -> Client:
    client = Client()
    client.force_login(make_user("staff", staff=True))
    return client


@pytest.mark.parametrize("url", ["/dashboard/", "/dashboard/pods/pod-a/"])
def test_anonymous_and_non_staff_go_to_the_admin_login(url, db):
    client = Client()
    response = client.get(url)
    assert response.status_code == 302
    assert response["Location"].startswith(reverse("admin:login"))
    client.force_login(make_user("plain", staff=False))
    assert client.get(url).status_code == 302


def test_the_site_root_and_the_admins_view_site_link_lead_to_the_dashboard(staff_client):
    response = staff_client.get("/")
    assert (response.status_code, response["Location"]) == (302, "/dashboard/")
    admin_page = staff_client.get("/admin/").content.decode()
    assert re.search(r'<a href="([^"]*)">View site</a>', admin_page)[1] == "/dashboard/"


def test_the_fleet_page_is_an_accessible_table_with_a_filter(staff_client):
    html = staff_client.get("/dashboard/").content.decode()
    pods = html.split('<table id="pods"')[1].split("</table>")[0]
    assert pods.count('<th scope="col"') == 12
    assert '<label for="pod-filter">' in html and 'id="pod-filter"' in html
    assert 'id="totals" class="totals" aria-live="polite"' in html
    assert 'aria-sort="ascending"' in html
    # Served by the project: no script or style from another host.
    assert "/static/vendor/uplot/uPlot.iife.min.js" in html
    assert "//cdn" not in html and "https://" not in html


def test_the_fleet_page_has_tables_of_gateways_their_pd_and_their_routing_decisions(staff_client):
    html = staff_client.get("/dashboard/").content.decode()
    assert '<h2 id="gateways-heading">Gateways</h2>' in html
    markups = {}
    for table, columns in (("gateways", 13), ("pd-gateways", 10), ("routed", 8)):
        markup = markups[table] = html.split(f'<table id="{table}"')[1].split("</table>")[0]
        assert markup.count('<th scope="col"') == columns
        assert '<caption class="visually-hidden">' in markup
    assert 'id="gateways-empty"' in html  # until a frame says there are gateways
    # Prefill/decode disaggregation is hidden until a frame has a gateway that served it: its
    # table, and the pods' prefill columns (hidden by the stylesheet while the table is not .with-pd).
    assert '<div id="pd-part" hidden>' in html
    assert 'id="routed-pd-note" class="muted" hidden' in html
    assert markups["routed"].count('class="num pd-only"') == 2


def test_the_pod_page_names_the_pod_even_before_it_is_registered(staff_client):
    response = staff_client.get("/dashboard/pods/pod%2Fwith%2Fslashes/")
    assert response.status_code == 200
    html = response.content.decode()
    assert 'data-pod="pod/with/slashes"' in html
    assert "Not in the pod registry" in html


@pytest.mark.parametrize("url", ["/dashboard/", "/dashboard/pods/pod-a/"])
def test_the_charts_span_can_be_chosen_up_to_a_day(staff_client, url):
    html = staff_client.get(url).content.decode()
    assert '<label for="chart-span">Span</label>' in html
    spans = re.findall(r'<option value="(\d+)">', html.split('id="chart-span"')[1].split("</select>")[0])
    assert spans == ["600", "3600", "21600", "86400"]
    assert 'data-history-seconds="600' in html  # the span a page opens with


def test_the_charting_library_comes_from_node_modules():
    found = finders.find("vendor/uplot/uPlot.iife.min.js")
    assert found is not None, "run `make node-deps` (npm ci) first"
    assert "node_modules/uplot/dist" in found


def test_static_files_are_served_by_the_app(staff_client):
    for path in ("/static/vendor/uplot/uPlot.iife.min.js", "/static/dashboard/dashboard.js"):
        response = staff_client.get(path)
        assert response.status_code == 200, path
