"""The ``hf`` format, a :class:`tenplex.formats.Format` (entry point ``hf``).

Format options (:mod:`tenplex.formats.protocol`): ``hf_arch`` (``--hf-arch``),
``dtype`` (``--dtype``), ``max_shard_size`` (``--max-shard-size``, bytes),
besides ``model_config``, ``threads``, ``progress`` and ``checksums``. It writes
in parts (``parts = True``: ``write(..., part=)``, ``commit``, ``abort``; see
:mod:`tenplex_megatron.formats.hf.parts`), for ``tenplex reshard`` under torchrun.
"""

from __future__ import annotations


from tenplex.formats.protocol import Description, VerifyResult, WriteResult
from tenplex.ptree.config import ParallelConfig

from tenplex_megatron.formats.options import model_config as _overrides
from tenplex_megatron.formats.records import description, verified, written

__all__ = ["HF"]


class _HF:
    """Hugging Face model directories: ``config.json`` with ``model*.safetensors`` (and an index)."""

    name = "hf"
    fixed_config = ParallelConfig()
    """An HF model directory holds whole tensors: tp = pp = ep = 1."""

    @staticmethod
    def detect(path: str) -> bool:
        from tenplex_megatron.formats.hf.hfdir import is_hf_dir

        return is_hf_dir(path)

    @staticmethod
    def why_not(path: str) -> str | None:
        """For a directory with ``config.json`` that ``detect`` refused: its weights are neither safetensors
        nor ``pytorch_model.bin`` (TensorFlow, Flax, GGUF), or missing
        (:func:`~tenplex_megatron.formats.hf.hfdir.hf_fault`)."""
        from tenplex_megatron.formats.hf.hfdir import hf_fault

        return hf_fault(path)

    @staticmethod
    def describe(path: str, **options) -> Description:
        from tenplex_megatron.formats.hf.read import describe_hf

        return description(_HF.name, describe_hf(path, _overrides(options)).desc)

    @staticmethod
    def open_source(path: str, **options):
        from tenplex_megatron.formats.hf.read import open_hf

        return open_hf(path, _overrides(options))

    @staticmethod
    def write(source, path: str, to: ParallelConfig | None = None, **options) -> WriteResult:
        """Export ``source`` to ``path`` (``to`` is ignored: an HF model is tp = pp = ep = 1)."""
        from tenplex_megatron.formats.hf.export import export_hf

        r = export_hf(source, path, hf_arch=options.get("hf_arch"), dtype=options.get("dtype"),
                      max_shard_size=options.get("max_shard_size"), threads=options.get("threads", 8),
                      progress=options.get("progress"), part=options.get("part"))
        return written(r, source.bytes_read)

    parts = True

    @staticmethod
    def commit(path: str, to: ParallelConfig | None, parts: list, part, **options) -> WriteResult:
        """Commit a write in parts: check every part's files, write the index and config, rename into place."""
        from tenplex_megatron.formats.hf.parts import commit_hf

        return written(commit_hf(path, parts, part.token), 0)

    @staticmethod
    def abort(path: str, part, everything: bool = False) -> None:
        """Remove the run's temporary folder (``everything``); a part removes its own files as it fails."""
        from tenplex_megatron.formats.hf.parts import abort_hf

        if everything:
            abort_hf(path, part.token)

    @staticmethod
    def verify(path: str, **options) -> VerifyResult:
        from tenplex_megatron.formats.hf.hfdir import verify_hf

        return verified(verify_hf(path, checksums=options.get("checksums", False), progress=options.get("progress")),
                        "every safetensors header and tensor size")


HF = _HF()
