"""Checkpoint formats behind one protocol: detect, describe, open a source, write, verify.

See :mod:`tenplex.formats.protocol` for the call order and the records,
:mod:`tenplex.formats.registry` for how formats are found, and
:mod:`tenplex.formats.store` for the tenplex store as a format.
"""

from tenplex.formats.protocol import Description, Format, Part, VerifyResult, WriteResult
from tenplex.formats.registry import detect, formats, get_format
from tenplex.formats.store import TENPLEX, TenplexFormat, write_store

__all__ = ["Format", "Description", "WriteResult", "VerifyResult", "Part", "TENPLEX", "TenplexFormat",
           "formats", "get_format", "detect", "write_store"]
