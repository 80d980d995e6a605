"""Workarounds for bugs in the libraries we build on, one module per upstream library: `torchax`, `jax`,
`libtpu` and `diffusers`, and `warning_filters` (library warnings known to be harmless, hidden by their exact text).

Each workaround names the bug and the version it was seen in, and has a canary in
`tests/test_upstream_bugs.py` that fails once upstream fixes it; the failure says what to delete.
docs/workarounds.md lists them all. Nothing here imports JAX at module level.
"""
