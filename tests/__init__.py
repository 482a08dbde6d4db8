"""tenplex's core test suite (a package, so helpers import as ``tests.helpers.x``)."""
