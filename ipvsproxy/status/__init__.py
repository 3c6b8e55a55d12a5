"""`ipvsproxy status` and the agent's `/status`: what each Service port looks like on this node.

Modules: `document` (the versioned JSON document, built from the translation's explanation,
the kernel's table and counters; pure), `table` (the document as a table sized to a terminal),
`compute` (the inputs, from the agent's state or, without an agent, from the API or manifests
and the kernel, as `diff` reads them), `client` (the CLI's reading of the agent's endpoint).
The schema is docs/status.schema.json; every field is described in docs/status.md.
"""
