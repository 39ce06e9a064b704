"""The OpenAPI schema lists every route the server answers, and nothing it does not: compared
with the app's routes and probed over real HTTP (uvicorn on 127.0.0.1).
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import httpx
import pytest
import torch

from torchverity.serve import create_app
from uvicorn_server import start

METHODS = ("get", "put", "post", "delete", "options", "head", "patch", "trace")


@pytest.fixture(scope="module")
def served() -> Iterator[tuple[Any, str]]:
    torch.manual_seed(0)
    app = create_app(torch.nn.Linear(4, 2), input_spec=["x:float32:-1,4"], name="linear",
                     recheck_interval=None)
    svc = start(app)
    yield app, svc.url
    svc.stop()


def _schema_operations(url: str) -> set[tuple[str, str]]:
    paths = httpx.get(url + "/openapi.json").json()["paths"]
    return {(path, method.upper()) for path, item in paths.items() for method in item
            if method in METHODS}


def _app_routes(app: Any) -> set[tuple[str, str]]:
    return {(route.path, method) for route in app.routes
            for method in getattr(route, "methods", None) or ()}


def test_the_schema_lists_exactly_the_apps_routes(served: tuple[Any, str]) -> None:
    app, url = served
    operations = _schema_operations(url)
    assert operations == _app_routes(app)
    assert {("/v2/health/live", "GET"), ("/v2/health/ready", "GET"),
            ("/openapi.json", "GET")} <= operations


def test_every_listed_operation_answers_and_no_other_method_does(
        served: tuple[Any, str]) -> None:
    _app, url = served
    operations = _schema_operations(url)
    body = {"inputs": [{"name": "x", "datatype": "FP32", "shape": [1, 4], "data": [0] * 4}]}
    for path, method in sorted(operations):
        response = httpx.request(method, url + path, json=body if method == "POST" else None)
        assert response.status_code == 200, (method, path, response.text)
        for other in ("GET", "POST", "DELETE"):
            if (path, other) not in operations:
                refused = httpx.request(other, url + path)
                assert refused.status_code == 405, (other, path)
    assert httpx.get(url + "/v2/health/unknown").status_code == 404


def test_the_oip_health_routes_document_their_answers(served: tuple[Any, str]) -> None:
    _app, url = served
    paths = httpx.get(url + "/openapi.json").json()["paths"]
    for alias, route in (("/v2/health/live", "/health"), ("/v2/health/ready", "/ready")):
        assert paths[alias]["get"]["responses"].keys() == paths[route]["get"]["responses"].keys()
    assert "503" in paths["/v2/health/ready"]["get"]["responses"]
