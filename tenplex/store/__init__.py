"""Where state rests: fsspec roots, safetensors shards, a JSON manifest, atomic commits."""

from tenplex.store.manifest import FORMAT, MANIFEST, FileRecord, Manifest, TensorRecord
from tenplex.store.reader import StoreReader, open_manifest
from tenplex.store.url import StoreRoot
from tenplex.store.writer import StoreWriter, save

__all__ = ["FORMAT", "MANIFEST", "FileRecord", "Manifest", "StoreReader", "StoreRoot",
           "StoreWriter", "TensorRecord", "open_manifest", "save"]
