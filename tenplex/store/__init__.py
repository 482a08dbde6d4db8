"""Where state rests: fsspec roots, safetensors shards, a JSON manifest, atomic commits.

Modules: ``manifest`` (records) and ``manifest_parse`` (every field of an
untrusted manifest checked); ``safetensors_format`` (headers written and
checked); ``blocks`` (checksum blocks and byte runs); ``reader`` (verified
range reads); ``source`` (the ``ShardSource`` protocol the store executor
reads through); ``execute`` (the store executor), ``fetch`` (one region of
one leaf) and ``stream`` (target files, a bounded number open); ``writer``,
``values`` and ``commit`` (writing and committing); ``verify`` (streamed
checks of a whole store); ``url`` (fsspec roots).
"""

from tenplex.store.fetch import read_region
from tenplex.store.manifest import MANIFEST_SCHEMA, MANIFEST, FileRecord, Manifest, TensorRecord
from tenplex.store.reader import StoreReader, open_manifest
from tenplex.store.source import ShardSource
from tenplex.store.url import StoreRoot
from tenplex.store.writer import StoreWriter, save

__all__ = ["MANIFEST_SCHEMA", "MANIFEST", "FileRecord", "Manifest", "ShardSource", "StoreReader",
           "StoreRoot", "StoreWriter", "TensorRecord", "open_manifest", "read_region", "save"]
