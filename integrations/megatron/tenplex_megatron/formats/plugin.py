"""The ``megatron-legacy`` and ``megatron-dist`` formats, as :class:`tenplex.formats.Format` objects.

Registered through the ``tenplex.formats`` entry-point group (see
:mod:`tenplex.formats.protocol` for the protocol). Both formats are read in
place: ``describe`` reads metadata only (pickles, DCP's ``.metadata``,
``common.pt``); ``open_source`` gives a shard source the planner and the
store executor read by byte ranges; ``write`` writes any Megatron source
(a tenplex store converted from Megatron, or a checkpoint of either
format) a few target files at a time; ``verify`` checks the files on disk.
Both write in parts too (``parts = True``: ``write(..., part=)``, ``commit``,
``abort``; see :mod:`tenplex_megatron.formats.parts`), for ``tenplex reshard``
under torchrun, and share an opened source (``share``, ``open_shared``; see
:mod:`tenplex_megatron.formats.shared`), so that only one process of the job reads
the source's metadata.
"""

from __future__ import annotations

import os

from tenplex.errors import ConfigError
from tenplex.formats.protocol import Description, VerifyResult, WriteResult
from tenplex.ptree.config import ParallelConfig

from tenplex_megatron.formats.dist.keys import is_dist
from tenplex_megatron.formats.options import model_config as _model_config
from tenplex_megatron.formats.records import description as _description, verified, written as _written
from tenplex_megatron.formats.legacy.read import is_legacy, save_root_fault

# The readers and writers are imported where they are used: loading the plugin (every CLI
# call) then costs no torch.distributed.checkpoint import (~0.7 s) unless a command needs it.

__all__ = ["LEGACY", "DIST"]

CRC = "every record's CRC-32"
"""What ``verify`` checks of a ``torch.save`` archive."""


def _iteration(options: dict) -> int | str | None:
    """The ``--iteration`` option: which iteration folder of a ``--save`` root to read (default: the
    tracker's, as Megatron-LM's ``--load``); an int or ``"release"``.

    Raises:
        ConfigError: for anything else.
    """
    it = options.get("iteration")
    if it is None or it == "release":
        return it
    if isinstance(it, str) and it.isdigit():
        it = int(it)
    if not isinstance(it, int) or isinstance(it, bool) or it < 0:
        raise ConfigError(f"--iteration {it!r}: expected a non-negative iteration number or 'release'")
    return it


class _Legacy:
    """Megatron-LM's per-rank ``iter_NNNNNNN/mp_rank_TT[_PPP]/model_optim_rng.pt`` checkpoints."""

    name = "megatron-legacy"

    @staticmethod
    def detect(path: str) -> bool:
        return os.path.isdir(path) and is_legacy(path)

    @staticmethod
    def why_not(path: str) -> str | None:
        """For a ``--save`` root (it has the tracker file) that no format claimed, what is wrong: the
        tracker names a missing folder or is not a number (:func:`~tenplex_megatron.formats.folders.locate`),
        or the folder holds neither ``mp_rank_*`` folders nor a ``torch_dist`` ``metadata.json``."""
        return save_root_fault(path)

    @staticmethod
    def describe(path: str, **options) -> Description:
        from tenplex_megatron.formats.legacy.read import describe_legacy

        return _description(_Legacy.name, describe_legacy(path, _model_config(options),
                                                          iteration=_iteration(options)).desc)

    @staticmethod
    def open_source(path: str, **options):
        from tenplex_megatron.formats.legacy.read import open_legacy

        return open_legacy(path, _model_config(options), options.get("threads", 8), _iteration(options))

    @staticmethod
    def share(source) -> dict:
        """The opened source as JSON, for :meth:`open_shared` on another process (no pickle)."""
        from tenplex_megatron.formats.legacy.shared import share_legacy

        return share_legacy(source)

    @staticmethod
    def open_shared(path: str, shared, **options):
        """The source :meth:`share` described, read without the rank files' pickles (``shared`` is checked)."""
        from tenplex_megatron.formats.legacy.shared import open_shared_legacy

        return open_shared_legacy(path, shared)

    @staticmethod
    def write(source, path: str, to: ParallelConfig, **options) -> WriteResult:
        from tenplex_megatron.formats.legacy.write import write_legacy

        r = write_legacy(source, path, to, options.get("threads", 8), options.get("progress"),
                         names=options.get("names"), part=options.get("part"))
        return _written(r, source.bytes_read)

    parts = True

    @staticmethod
    def commit(path: str, to: ParallelConfig, parts: list, part, **options) -> WriteResult:
        """Commit a write in parts: check every part's files, rename the folder, write the tracker."""
        from tenplex_megatron.formats.parts import commit_parts

        return _written(commit_parts(path, parts, part.token), 0)

    @staticmethod
    def abort(path: str, part, everything: bool = False) -> None:
        """Remove the run's temporary folder (``everything``); a part removes its own files as it fails."""
        from tenplex_megatron.formats.parts import abort_parts

        if everything:
            abort_parts(path, part.token)

    @staticmethod
    def verify(path: str, **options) -> VerifyResult:
        from tenplex_megatron.formats.legacy.verify import verify_legacy

        return verified(verify_legacy(path, _model_config(options), checksums=options.get("checksums", False),
                                       threads=options.get("threads", 8), progress=options.get("progress"),
                                       iteration=_iteration(options)), CRC)


class _Dist:
    """megatron-core ``dist_checkpointing`` (``torch_dist``) directories."""

    name = "megatron-dist"

    @staticmethod
    def detect(path: str) -> bool:
        return os.path.isdir(path) and is_dist(path)

    @staticmethod
    def describe(path: str, **options) -> Description:
        from tenplex_megatron.formats.dist.read import describe_dist

        return _description(_Dist.name, describe_dist(path, _model_config(options), _iteration(options)).desc)

    @staticmethod
    def open_source(path: str, **options):
        from tenplex_megatron.formats.dist.source import open_dist

        return open_dist(path, _model_config(options), _iteration(options))

    @staticmethod
    def share(source) -> dict:
        """The opened source as JSON, for :meth:`open_shared` on another process (no pickle)."""
        from tenplex_megatron.formats.dist.shared import share_dist

        return share_dist(source)

    @staticmethod
    def open_shared(path: str, shared, **options):
        """The source :meth:`share` described, read without ``.metadata`` or headers (``shared`` is checked)."""
        from tenplex_megatron.formats.dist.shared import open_shared_dist

        return open_shared_dist(path, shared)

    @staticmethod
    def write(source, path: str, to: ParallelConfig, **options) -> WriteResult:
        from tenplex_megatron.formats.dist.write import write_dist

        r = write_dist(source, path, to, options.get("threads", 8), options.get("progress"),
                       names=options.get("names"), part=options.get("part"))
        return _written(r, source.bytes_read)

    parts = True

    @staticmethod
    def commit(path: str, to: ParallelConfig, parts: list, part, **options) -> WriteResult:
        """Commit a write in parts: check every part's files, merge ``.metadata``, rename, write the tracker."""
        from tenplex_megatron.formats.dist.write import commit_dist

        return _written(commit_dist(path, parts, part.token), 0)

    abort = staticmethod(_Legacy.abort)

    @staticmethod
    def reshard(src: str, dst: str, to: ParallelConfig, **options) -> WriteResult | None:
        """Direct dist-to-dist reshard (DCP items copied, vocab rows and args adjusted), or None."""
        from tenplex_megatron.formats.dist.direct import reshard_dist

        r = reshard_dist(src, dst, to, _model_config(options), _iteration(options), options.get("names"))
        return None if r is None else _written(r, r["bytes_read"], direct=True)

    @staticmethod
    def verify(path: str, **options) -> VerifyResult:
        from tenplex_megatron.formats.dist.verify import verify_dist

        return verified(verify_dist(path, _model_config(options), checksums=options.get("checksums", False),
                                     threads=options.get("threads", 8), progress=options.get("progress"),
                                     iteration=_iteration(options)), CRC)


LEGACY = _Legacy()
DIST = _Dist()
