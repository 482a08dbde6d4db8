"""The tenplex store joins the format conformance suite."""

from tenplex.formats import TenplexFormat
from tenplex.formats.conformance import FormatConformance


class TestTenplexFormat(FormatConformance):
    format = TenplexFormat()

    def metadata_file(self, path: str) -> str:
        return f"{path}/manifest.json"


class _Careless(TenplexFormat):
    """A format that forgets to check anything: the suite must catch it."""

    @staticmethod
    def verify(path, **options):
        return None


def test_the_suite_catches_a_verify_that_checks_nothing(tmp_path):
    import pytest

    suite = type("Probe", (FormatConformance,), {"format": _Careless(),
                                                  "metadata_file": lambda self, p: f"{p}/manifest.json"})()
    tree, config = suite.make_tree(), suite.source_config
    from tenplex.ptree.shards import materialize
    from tenplex.store.reader import StoreReader
    from tenplex.store.writer import save

    state = suite.make_state(tree, config)
    save(str(tmp_path / "s"), tree, config, {r: materialize(tree, state, config, r)
                                             for r in range(config.world_size)})
    written = str(tmp_path / "w")
    suite.format.write(StoreReader(str(tmp_path / "s")), written, suite.target_config)
    with pytest.raises(pytest.fail.Exception, match="DID NOT RAISE"):
        suite.test_verify_finds_a_flipped_byte(written)


def test_a_plugin_that_does_not_import_is_named_not_fatal(monkeypatch, tmp_path):
    """A stale entry point (its module gone) leaves the other formats working and is named where asked for."""
    import importlib.metadata as md

    import pytest

    from tenplex.errors import ConfigError, ManifestError
    from tenplex.formats import registry

    stale = md.EntryPoint(name="stale", value="no_such_module_xyz:FORMAT", group=registry.ENTRY_POINTS)
    real = registry.entry_points
    monkeypatch.setattr(registry, "entry_points", lambda group: [*real(group=group), stale])
    assert "tenplex" in registry.formats() and "stale" not in registry.formats()
    with pytest.raises(ConfigError, match="'stale' is installed but does not load .*no_such_module_xyz"):
        registry.get_format("stale")
    with pytest.raises(ManifestError, match="plugin stale does not load"):
        registry.detect(str(tmp_path))
