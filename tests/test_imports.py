"""The package's import graph has no cycle (function-level imports count too): a cycle
means code sits in the wrong module. The layers in pyproject.toml order the packages; this
covers the modules inside each package as well."""

from __future__ import annotations

import grimp


def test_no_module_of_ipvsproxy_imports_itself_through_others():
    graph = grimp.build_graph("ipvsproxy")
    cycles = []
    for module in sorted(graph.modules):
        for imported in sorted(graph.find_modules_directly_imported_by(module)):
            back = graph.find_shortest_chain(importer=imported, imported=module)
            if back is not None:
                cycles.append(" -> ".join((module, *back)))
    assert cycles == []
