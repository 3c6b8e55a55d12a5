"""No wrongly-shaped field escapes the parser as anything but a warning (issue 14).

api.py promises: an object whose fields have the wrong shape is skipped with a warning that
names the object and the field; parsing never raises anything but `Malformed`. First the
shapes that raised before (each one reproduced as an operator met it: `diff --manifests`),
then hypothesis substitutes arbitrary JSON values into every field the parser reads.
"""

from __future__ import annotations

import json
from typing import Any

import pytest
from click.testing import CliRunner

from ipvsproxy.api import parse_objects
from ipvsproxy.cli import main
from tests.factories import ep, node, port, service, slice_

# ---- the shapes that raised before -------------------------------------------------------


def _lb(**spec: Any) -> Any:
    return service("web", type="LoadBalancer", ports=[port(node_port=30080)], **spec)


REGRESSIONS = {
    "sessionAffinityConfig a string": (
        service("web", sessionAffinity="ClientIP", sessionAffinityConfig="x"),
        "Service default/web: spec.sessionAffinityConfig: expected an object, got str",
    ),
    "status.loadBalancer a string": (
        {**_lb(), "status": {"loadBalancer": "x"}},
        "Service default/web: status.loadBalancer: expected an object, got str",
    ),
    "status.loadBalancer.ingress a number": (
        {**_lb(), "status": {"loadBalancer": {"ingress": 5}}},
        "Service default/web: status.loadBalancer.ingress: expected a list, got int",
    ),
    "endpoint conditions a list": (
        slice_(endpoints=[{"addresses": ["10.244.0.1"], "conditions": [{"ready": True}]}]),
        "EndpointSlice default/web-abcde: endpoints[0].conditions: expected an object, got list",
    ),
    "targetPort a non-ASCII digit": (
        service("web", ports=[port(target="²")]),
        "Service default/web: spec.ports[0].targetPort '²' is neither a port number nor a name",
    ),
}


@pytest.mark.parametrize(("obj", "warning"), REGRESSIONS.values(), ids=REGRESSIONS.keys())
def test_a_wrongly_shaped_field_is_a_warning_naming_object_and_field(obj, warning):
    good = service("other", cluster_ips=("10.96.0.99",))
    parsed = parse_objects([obj, good])
    assert parsed.warnings == (f"skipping malformed {warning}",)
    assert [s.name for s in parsed.services] == ["other"]


@pytest.mark.parametrize(("obj", "warning"), REGRESSIONS.values(), ids=REGRESSIONS.keys())
def test_diff_warns_and_plans_the_rest_instead_of_a_traceback(tmp_path, obj, warning):
    other = service("other", cluster_ips=("10.96.0.99",))
    objects = [obj, other, slice_("other", endpoints=[ep("10.244.0.1")]), node("node-a")]
    manifest = tmp_path / "objects.json"
    manifest.write_text(json.dumps({"kind": "List", "items": objects}))
    empty = tmp_path / "empty.txt"
    empty.write_text("")
    result = CliRunner().invoke(
        main,
        ["diff", "--manifests", str(manifest), "--kernel-state", str(empty)]
        + ["--hostname-override", "node-a"],
    )
    assert "Traceback" not in result.output
    assert result.exception is None or isinstance(result.exception, SystemExit), result.exception
    assert result.exit_code == 1, result.output
    assert warning in result.stderr
    assert "10.96.0.99:80" in result.stdout
