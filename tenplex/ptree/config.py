"""Parallel configs: dp, tp, pp, cp, ep, etp and vpp, megatron-core 0.16's rank order.

Ranks follow ``parallel_state.initialize_model_parallel`` (see
:mod:`tenplex.ptree.grid`): a dense grid ``TP x CP x DP x PP`` and an expert
grid ``ETP x EP x EDP x PP`` over the same ranks, in the order
``tp-cp-ep-dp-pp`` (first axis fastest). For ``dp=2, tp=2, pp=2``::

    rank:  0 1 2 3 4 5 6 7
    tp:    0 1 0 1 0 1 0 1
    dp:    0 0 1 1 0 0 1 1
    pp:    0 0 0 0 1 1 1 1
"""

from __future__ import annotations

import operator
import re
from dataclasses import dataclass
from functools import cached_property
from typing import NamedTuple

from tenplex.errors import ConfigError
from tenplex.limits import MAX_DEGREE, MAX_WORLD, short
from tenplex.ptree import grid, pipeline

__all__ = ["Coord", "ParallelConfig", "AXES", "COORD_AXES"]

AXES = ("tp", "dp", "pp")
"""The axes every config's ``order`` names (``cp`` and ``ep`` are named where > 1)."""

COORD_AXES = ("dp", "tp", "pp", "cp", "ep", "etp", "edp")
"""The fields of a :class:`Coord`."""

_DEGREES = ("dp", "tp", "pp", "cp", "ep", "etp", "vpp")


class Coord(NamedTuple):
    """A rank's coordinates on the dense and the expert grid.

    ``dp``, ``tp``, ``pp`` and ``cp`` place the rank on the dense grid;
    ``ep``, ``etp`` and ``edp`` (expert parallel, expert tensor parallel and
    expert data parallel) on the expert grid; ``pp`` is shared. A
    :meth:`ParallelConfig.coord` fills every field; :meth:`ParallelConfig.rank`
    reads only the dense ones, so ``Coord(dp, tp, pp)`` still names a rank.
    """

    dp: int
    tp: int
    pp: int
    cp: int = 0
    ep: int = 0
    etp: int = 0
    edp: int = 0

    @property
    def dense_dp_first(self) -> bool:
        """Whether the rank is first in its dense data-parallel group (dp x cp ranks hold the same
        dense shards): the rank that saves their shared state, as megatron-core saves
        distributed-optimizer state on data-parallel rank 0 of the group with context parallel."""
        return self.dp == 0 and self.cp == 0


@dataclass(frozen=True)
class ParallelConfig:
    """A parallel config: degrees, rank order and layer-to-stage assignment.

    Attributes:
        dp: data-parallel degree (replicas), >= 1.
        tp: tensor-parallel degree, >= 1.
        pp: pipeline-parallel degree (stages), >= 1.
        order: megatron's order tokens from fastest- to slowest-varying in
            the rank number; it names ``tp``, ``dp`` and ``pp`` and may name
            ``cp`` and ``ep``. Stored normalized: ``cp`` and ``ep`` are kept
            only where their degree is > 1 (elsewhere they do not change any
            rank), so ``dp=2,tp=2,pp=2`` has order ``("tp", "dp", "pp")``.
            Default: megatron's ``tp-cp-ep-dp-pp``.
        stage_layers: layers per pipeline stage, or ``None`` for an even
            split. Uneven lists are allowed, e.g. ``(3, 5)`` for 8 layers on
            2 stages; each stage holds at least one layer.
        cp: context-parallel degree. Weights are replicated over cp.
        ep: expert-parallel degree: experts are dealt out in contiguous
            blocks over ep ranks.
        etp: expert-tensor-parallel degree; ``None`` means ``tp``.
        vpp: virtual pipeline chunks per stage (interleaved schedule); 1
            means none (megatron's ``None``).

    The world size is ``dp * tp * cp * pp``; the expert data-parallel degree
    is ``edp = world / (etp * ep * pp)``.

    Raises:
        ConfigError: naming the constraint: a degree below 1, a bad order, a
            ``stage_layers`` whose length is not ``pp``, ``etp * ep * pp``
            not dividing the world, ``vpp > 1`` with ``pp = 1``, or an order
            under which the dense and expert pipeline groups differ.

    Example:
        >>> c = ParallelConfig.parse("dp=2,tp=2,pp=2")
        >>> c.coord(5)
        Coord(dp=0, tp=1, pp=1, cp=0, ep=0, etp=1, edp=0)
        >>> c.rank(Coord(dp=0, tp=1, pp=1))
        5
    """

    dp: int = 1
    tp: int = 1
    pp: int = 1
    order: tuple[str, ...] = grid.DEFAULT_ORDER
    stage_layers: tuple[int, ...] | None = None
    cp: int = 1
    ep: int = 1
    etp: int | None = None
    vpp: int = 1

    def __post_init__(self) -> None:
        if self.etp is None:
            object.__setattr__(self, "etp", self.tp)
        for name in _DEGREES:
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or not 1 <= value <= MAX_DEGREE:
                raise ConfigError(f"ParallelConfig: {name} must be an integer >= 1 and <= {MAX_DEGREE} "
                                  f"(tenplex.limits.MAX_DEGREE), got {short(value)}")
        if self.dp * self.tp * self.cp * self.pp > MAX_WORLD:
            raise ConfigError(f"ParallelConfig: world size dp*tp*cp*pp = {self.dp * self.tp * self.cp * self.pp} "
                              f"is above {MAX_WORLD} (tenplex.limits.MAX_WORLD)")
        full = grid.full_order(self.order)
        keep = {"tp", "dp", "pp"} | {a for a in ("cp", "ep") if getattr(self, a) > 1}
        object.__setattr__(self, "order", tuple(t for t in full if t in keep))
        if self.stage_layers is not None:
            try:
                layers = tuple(operator.index(n) for n in self.stage_layers)
            except TypeError:
                layers = ()
            if len(layers) != self.pp or any(n < 1 for n in layers):
                raise ConfigError(f"ParallelConfig: stage_layers must list pp={self.pp} positive "
                                  f"layer counts, got {self.stage_layers!r}")
            object.__setattr__(self, "stage_layers", layers)
        self._check_grids()

    def _check_grids(self) -> None:
        expert = self.etp * self.ep * self.pp
        if self.world_size % expert:
            raise ConfigError(f"{self}: etp*ep*pp={expert} does not divide the world size "
                              f"{self.world_size} (dp*tp*cp*pp)")
        if self.vpp > 1 and self.pp == 1:
            raise ConfigError(f"{self}: vpp={self.vpp} needs pp > 1 (megatron-core interleaves "
                              "virtual chunks over pipeline stages)")
        if self.pp > 1 and self.order[-1] != "pp" and self.edp != self.dp:
            raise ConfigError(f"{self}: with pp last in order or edp == dp only (megatron-core "
                              f"asserts this), got order {'-'.join(self.order)} and edp={self.edp}")
        if self.pp > 1 and self._strides["dense"]["pp"] != self._strides["expert"]["pp"]:
            raise ConfigError(f"{self}: the dense and expert grids put pipeline stages on "
                              f"different ranks under order {'-'.join(self.order)}")

    # -- degrees ---------------------------------------------------------------
    @property
    def world_size(self) -> int:
        """Number of ranks: ``dp * tp * cp * pp``."""
        return self.dp * self.tp * self.cp * self.pp

    @property
    def edp(self) -> int:
        """Expert data-parallel degree: ``world_size / (etp * ep * pp)``."""
        return self.world_size // (self.etp * self.ep * self.pp)

    def sizes(self) -> dict[str, int]:
        """The degree of every coordinate axis (see :data:`COORD_AXES`)."""
        return {"dp": self.dp, "tp": self.tp, "pp": self.pp, "cp": self.cp, "ep": self.ep,
                "etp": self.etp, "edp": self.edp}

    # -- ranks and coordinates ---------------------------------------------------
    @cached_property
    def grid_order(self) -> tuple[str, ...]:
        """All five of megatron's order tokens in rank order (``order`` with cp and ep placed)."""
        return grid.full_order(self.order)

    @cached_property
    def _grid_sizes(self) -> dict[str, dict[str, int]]:
        args = (self.tp, self.cp, self.ep, self.dp, self.pp, self.etp, self.edp)
        return {g: grid.grid_sizes(g, *args) for g in ("dense", "expert")}

    @cached_property
    def _strides(self) -> dict[str, dict[str, int]]:
        return {g: grid.strides(self.grid_order, s) for g, s in self._grid_sizes.items()}

    def coord(self, rank: int) -> Coord:
        """The coordinates of ``rank`` on both grids.

        Raises:
            ConfigError: if ``rank`` is not in ``[0, world_size)``.
        """
        try:
            rank = operator.index(rank)
        except TypeError:
            raise ConfigError(f"{self}: rank: expected an int in [0, {self.world_size}), found "
                              f"{type(rank).__name__} {short(rank)}") from None
        if not 0 <= rank < self.world_size:
            raise ConfigError(f"{self}: rank {rank} is outside [0, {self.world_size})")
        order, sizes = self.grid_order, self._grid_sizes
        d = grid.decompose(rank, order, sizes["dense"])
        e = grid.decompose(rank, order, sizes["expert"])
        return Coord(d["dp"], d["tp"], d["pp"], d["cp"], e["ep"], e["tp"], e["dp"])

    def rank(self, coord: Coord) -> int:
        """The rank at ``coord``'s dense coordinates (``dp``, ``tp``, ``pp``, ``cp``).

        Raises:
            ConfigError: if a coordinate is out of range.
        """
        sizes = self._grid_sizes["dense"]
        values = {"tp": coord.tp, "cp": coord.cp, "ep": 0, "dp": coord.dp, "pp": coord.pp}
        for axis in ("tp", "cp", "dp", "pp"):
            if not 0 <= values[axis] < sizes[axis]:
                raise ConfigError(f"{self}: {axis}={values[axis]} is outside [0, {sizes[axis]})")
        return grid.compose(values, self.grid_order, sizes)

    def stride(self, axis: str) -> int:
        """How much the rank grows when ``axis``'s coordinate grows by one.

        ``tp``, ``cp``, ``dp`` and ``pp`` are dense-grid axes; ``etp``,
        ``ep`` and ``edp`` expert-grid axes.
        """
        if axis not in COORD_AXES:
            raise ConfigError(f"unknown axis {axis!r}; expected one of {COORD_AXES}")
        token = {"etp": "tp", "edp": "dp"}.get(axis, axis)
        g = "expert" if axis in ("etp", "ep", "edp") else "dense"
        return self._strides[g][token]

    def dp_cp_rank(self, coord: Coord) -> int:
        """``coord``'s index in megatron's dp-cp group (the dense distributed optimizer's group)."""
        values = {"cp": coord.cp, "dp": coord.dp}
        return grid.group_index(values, ("cp", "dp"), self.grid_order, self._grid_sizes["dense"])

    @cached_property
    def etp_follows_dp_cp_groups(self) -> bool:
        """True if every rank of a dp-cp group has the same etp coordinate.

        Megatron-core keeps expert parameters in the dense distributed-optimizer
        buffer when ``ep = 1`` (``allreduce`` is only False for experts with
        ep > 1), sharded over the dp-cp group; that is only a layout of the
        experts' optimizer state when the group's ranks hold the same expert
        shard: ``etp = 1``, or ``etp = tp`` on the same ranks.
        """
        if self.etp == 1:
            return True
        seen: dict = {}
        for rank in range(self.world_size):
            c = self.coord(rank)
            if seen.setdefault((c.tp, c.pp), c.etp) != c.etp:
                return False
        return True

    # -- pipeline ----------------------------------------------------------------
    def layers_per_stage(self, num_layers: int) -> tuple[int, ...]:
        """The number of layers on each stage for a model of ``num_layers``.

        Raises:
            ConfigError: if pp does not fit the layers: an even split needs
                ``pp`` to divide ``num_layers``, an uneven one must sum to it.
        """
        return pipeline.stage_counts(num_layers, self.pp, self.stage_layers, str(self))

    def check_layers(self, num_layers: int) -> None:
        """Raise ConfigError unless ``pp``, ``stage_layers`` and ``vpp`` fit ``num_layers``."""
        pipeline.chunk_starts(self.layers_per_stage(num_layers), self.vpp)

    def chunk_of_layer(self, layer: int, num_layers: int) -> tuple[int, int]:
        """``(stage, virtual chunk)`` of global layer index ``layer``."""
        return pipeline.chunk_of(layer, self.layers_per_stage(num_layers), self.vpp)

    def stage_of_layer(self, layer: int, num_layers: int) -> int:
        """The pipeline stage that holds global layer index ``layer``."""
        return self.chunk_of_layer(layer, num_layers)[0]

    def chunk_layers(self, stage: int, chunk: int, num_layers: int) -> range:
        """The global layer indices of virtual chunk ``chunk`` of ``stage``."""
        counts = self.layers_per_stage(num_layers)
        start = pipeline.chunk_starts(counts, self.vpp)[stage][chunk]
        return range(start, start + counts[stage] // self.vpp)

    def first_layer(self, stage: int, num_layers: int, chunk: int = 0) -> int:
        """Global index of the first layer of ``chunk`` on ``stage`` (chunk-local index 0)."""
        return self.chunk_layers(stage, chunk, num_layers).start

    # -- text and JSON -------------------------------------------------------------
    def __str__(self) -> str:
        text = f"dp={self.dp},tp={self.tp},pp={self.pp}"
        for name, default in (("cp", 1), ("ep", 1), ("etp", self.tp), ("vpp", 1)):
            if getattr(self, name) != default:
                text += f",{name}={getattr(self, name)}"
        if self.stage_layers is not None:
            text += ",stages=" + ":".join(str(n) for n in self.stage_layers)
        return text

    def to_json(self) -> dict:
        """JSON; a config with only dp, tp and pp gives the same JSON as before cp/ep/etp/vpp."""
        obj: dict = {"dp": self.dp, "tp": self.tp, "pp": self.pp, "order": list(self.order)}
        if self.stage_layers is not None:
            obj["stage_layers"] = list(self.stage_layers)
        for name, default in (("cp", 1), ("ep", 1), ("etp", self.tp), ("vpp", 1)):
            if getattr(self, name) != default:
                obj[name] = getattr(self, name)
        return obj

    @classmethod
    def from_json(cls, obj: dict) -> "ParallelConfig":
        """Rebuild a config from :meth:`to_json` output (also JSON without cp/ep/etp/vpp).

        Raises:
            ConfigError: on a missing, unknown or malformed field.
        """
        try:
            unknown = set(obj) - {"dp", "tp", "pp", "order", "stage_layers", *_DEGREES}
            if unknown:
                raise ConfigError(f"ParallelConfig: unknown fields {sorted(unknown)} in {obj!r}")
            extra = {k: obj[k] for k in ("cp", "ep", "etp", "vpp") if k in obj}
            return cls(dp=obj["dp"], tp=obj["tp"], pp=obj["pp"],
                       order=tuple(obj.get("order", grid.DEFAULT_ORDER)),
                       stage_layers=tuple(obj["stage_layers"]) if obj.get("stage_layers") else None,
                       **extra)
        except (KeyError, TypeError, AttributeError) as exc:
            raise ConfigError(f"ParallelConfig: cannot read {obj!r}: {exc!r}") from exc

    @classmethod
    def parse(cls, text: str) -> "ParallelConfig":
        """Parse ``"dp=2,tp=4,pp=2,cp=1,ep=2,etp=1,vpp=2"``; missing degrees default to 1.

        ``etp`` defaults to ``tp``; ``stages=3:5`` gives an uneven
        layer-to-stage assignment.

        Raises:
            ConfigError: on an empty text (a ``--to ""`` from an unset variable must not mean
                one rank), an item that is not ``key=value``, an unknown key, a repeated key,
                or a value that is not a decimal integer (layer counts ``a:b:...`` for ``stages``);
                a degree out of range (see the constructor).
        """
        values: dict = {}
        where = f"parallel config {short(text)}"
        items = [part.strip() for part in text.split(",") if part.strip()]
        if not items:
            raise ConfigError(f"{where}: expected at least one degree, e.g. 'tp=2' ('dp=1' for one rank)")
        for item in items:
            match = re.fullmatch(r"(\w+)\s*=\s*(.*)", item)
            if not match:
                raise ConfigError(f"{where}: expected key=value, got {short(item)}")
            key, value = match.groups()
            if key not in _DEGREES and key != "stages":
                raise ConfigError(f"{where}: unknown key {short(key)}; expected dp=, tp=, pp=, cp=, ep=, "
                                  "etp=, vpp= (integers) or stages=a:b:...")
            if key in values or (key == "stages" and "stage_layers" in values):
                raise ConfigError(f"{where}: {key} is given twice")
            if key == "stages":  # ASCII digits, at most 9 per count (int() refuses over 4300 digits)
                if not re.fullmatch(r"[0-9]{1,9}(:[0-9]{1,9})*", value):
                    raise ConfigError(f"{where}: stages: expected layer counts a:b:..., found {short(value)}")
                values["stage_layers"] = tuple(int(v) for v in value.split(":"))
            elif re.fullmatch(r"[0-9]{1,18}", value):  # the constructor checks the range
                values[key] = int(value)
            else:
                raise ConfigError(f"{where}: {key}: expected an integer from 1 to {MAX_DEGREE}, "
                                  f"found {short(value)}")
        return cls(**values)
