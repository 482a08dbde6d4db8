"""The tenplex store joins the format conformance suite."""

import torch

from tenplex.formats import TenplexFormat
from tenplex.formats.conformance import FormatConformance


WORD = "model/embedding/word_embeddings/weight"


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


def test_without_any_format_plugin_the_errors_say_how_to_add_one(monkeypatch, tmp_path):
    """tenplex on PYTHONPATH, or installed without tenplex-megatron, knows only its store: a Megatron
    folder or ``--format hf`` is then "unknown", and the error says that no plugin is installed and how
    to install one (found on a GPU machine where the packages were on PYTHONPATH)."""
    import pytest

    from tenplex.errors import ConfigError, ManifestError
    from tenplex.formats import registry

    with pytest.raises(ManifestError) as installed:
        registry.detect(str(tmp_path))
    assert "no format plugin is installed" not in str(installed.value)  # tenplex-megatron is installed here
    monkeypatch.setattr(registry, "entry_points", lambda group: [])
    with pytest.raises(ManifestError, match="no format plugin is installed .*pip install -e integrations/megatron"):
        registry.detect(str(tmp_path))
    with pytest.raises(ConfigError, match="format 'hf': unknown; expected one of tenplex; no format plugin"):
        registry.get_format("hf")


def test_a_reshard_builds_one_sharding_per_config(tmp_path, monkeypatch):
    """Geometry is built once per config per operation: the reader's for the source, the planner's
    for the target; the store executor and the writer take them from the plan."""
    import tenplex
    from tenplex.ptree import sharding as sharding_module
    from tenplex.ptree.config import ParallelConfig
    from tenplex.ptree.shards import materialize
    from tenplex.store.writer import save

    suite = FormatConformance()
    tree, src = suite.make_tree(), ParallelConfig(dp=2, tp=2)
    state = suite.make_state(tree, src)
    save(str(tmp_path / "a"), tree, src, {r: materialize(tree, state, src, r) for r in range(src.world_size)})
    built = []
    real = sharding_module.Sharding.__init__

    def counting(self, tree, config):
        built.append(config)
        real(self, tree, config)

    monkeypatch.setattr(sharding_module.Sharding, "__init__", counting)
    to = ParallelConfig(dp=1, tp=1, pp=2)
    tenplex.reshard(str(tmp_path / "a"), str(tmp_path / "b"), to)
    assert sorted(map(str, built)) == sorted([str(src), str(to)]), built


def test_a_shared_store_is_the_sharers_and_checks_each_file_before_its_first_read_here(tmp_path):
    """``share``/``open_shared`` (a reshard under torchrun): another process reads the manifest itself
    and refuses one that is not the sharer's; it checks a shard file's size and header only before its
    own first read of that file, so it reads no byte of the files it does not need."""
    import json

    import pytest

    from tenplex.errors import CorruptShardError, ManifestError
    from tenplex.ptree.config import ParallelConfig
    from tests.helpers.torchrun_reshard import gpt_store

    src, other = str(tmp_path / "src"), str(tmp_path / "other")
    gpt_store(src, ParallelConfig(dp=1, tp=2, pp=1), layers=1, hidden=64)
    gpt_store(other, ParallelConfig(dp=1, tp=2, pp=1), layers=1, hidden=64, seed=1)
    fmt = TenplexFormat()
    opened = fmt.open_source(src)  # the sharing process: every file checked
    shared = json.loads(json.dumps(fmt.share(opened)))  # it travels as JSON
    back = fmt.open_shared(src, shared)
    assert back.bytes_read == 0
    rec0 = back.record(WORD, 0)
    rec1 = back.record(WORD, 1)
    assert rec0.file != rec1.file
    header = tmp_path / "src" / rec1.file
    data = bytearray(header.read_bytes())
    data[20] ^= 0xFF  # inside the header's JSON: its block's digest no longer matches
    header.write_bytes(bytes(data))
    assert torch.equal(back.read(rec0), opened.read(rec0))  # file 0: checked and read here
    with pytest.raises(CorruptShardError, match="checksum mismatch in block 0"):
        back.read(rec1)  # file 1 is checked at its first read here, and fails
    with pytest.raises(ManifestError, match="every process must see the same store"):
        fmt.open_shared(other, shared)
    for bad in ([], {"manifest": 3}, None, {"manifest": "0" * 1_000_000}):
        with pytest.raises(ManifestError, match="shared source: expected"):
            fmt.open_shared(src, bad)
