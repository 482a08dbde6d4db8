"""Parallel configs: (dp, tp, pp), rank order and the layer-to-stage assignment.

Megatron orders ranks with tp fastest, then dp, then pp (its default
``order="tp-cp-ep-dp-pp"`` with cp = ep = 1), so for ``dp=2, tp=2, pp=2``::

    rank:  0 1 2 3 4 5 6 7
    tp:    0 1 0 1 0 1 0 1
    dp:    0 0 1 1 0 0 1 1
    pp:    0 0 0 0 1 1 1 1
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import NamedTuple

from tenplex.errors import ConfigError

__all__ = ["Coord", "ParallelConfig", "AXES"]

AXES = ("tp", "dp", "pp")
"""The parallel axes tenplex knows. Room is left for ``cp`` and ``ep``."""


class Coord(NamedTuple):
    """A rank's coordinates: data-parallel, tensor-parallel and pipeline index."""

    dp: int
    tp: int
    pp: int


@dataclass(frozen=True)
class ParallelConfig:
    """A (dp, tp, pp) parallel config with a rank order and stage assignment.

    Attributes:
        dp: data-parallel degree (replicas), >= 1.
        tp: tensor-parallel degree, >= 1.
        pp: pipeline-parallel degree (stages), >= 1.
        order: the axes from fastest- to slowest-varying in the rank number;
            a permutation of ``("tp", "dp", "pp")``. Megatron's default is
            ``("tp", "dp", "pp")``.
        stage_layers: layers per pipeline stage, or ``None`` for an even
            split. Uneven lists are allowed, e.g. ``(3, 5)`` for 8 layers on
            2 stages; each stage holds at least one layer.

    Raises:
        ConfigError: on a degree below 1, a bad order, or a ``stage_layers``
            whose length is not ``pp``.

    Example:
        >>> c = ParallelConfig.parse("dp=2,tp=2,pp=2")
        >>> c.coord(5)
        Coord(dp=0, tp=1, pp=1)
        >>> c.rank(Coord(dp=0, tp=1, pp=1))
        5
    """

    dp: int = 1
    tp: int = 1
    pp: int = 1
    order: tuple[str, ...] = AXES
    stage_layers: tuple[int, ...] | None = None

    def __post_init__(self) -> None:
        for name in AXES:
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ConfigError(f"ParallelConfig: {name} must be an integer >= 1, got {value!r}")
        if tuple(sorted(self.order)) != tuple(sorted(AXES)):
            raise ConfigError(
                f"ParallelConfig: order must be a permutation of {AXES}, got {self.order!r}"
            )
        object.__setattr__(self, "order", tuple(self.order))
        if self.stage_layers is not None:
            layers = tuple(int(n) for n in self.stage_layers)
            if len(layers) != self.pp or any(n < 1 for n in layers):
                raise ConfigError(
                    f"ParallelConfig: stage_layers must list pp={self.pp} positive layer "
                    f"counts, got {self.stage_layers!r}"
                )
            object.__setattr__(self, "stage_layers", layers)

    @property
    def world_size(self) -> int:
        """Number of ranks: ``dp * tp * pp``."""
        return self.dp * self.tp * self.pp

    def sizes(self) -> dict[str, int]:
        return {"dp": self.dp, "tp": self.tp, "pp": self.pp}

    def coord(self, rank: int) -> Coord:
        """The coordinates of ``rank``.

        Raises:
            ConfigError: if ``rank`` is not in ``[0, world_size)``.
        """
        if not 0 <= rank < self.world_size:
            raise ConfigError(f"{self}: rank {rank} is outside [0, {self.world_size})")
        sizes = self.sizes()
        values = {}
        for axis in self.order:
            rank, values[axis] = divmod(rank, sizes[axis])
        return Coord(values["dp"], values["tp"], values["pp"])

    def rank(self, coord: Coord) -> int:
        """The rank at ``coord``.

        Raises:
            ConfigError: if a coordinate is out of range.
        """
        rank = 0
        for axis in reversed(self.order):
            size, value = getattr(self, axis), getattr(coord, axis)
            if not 0 <= value < size:
                raise ConfigError(f"{self}: {axis}={value} is outside [0, {size})")
            rank = rank * size + value
        return rank

    def stride(self, axis: str) -> int:
        """How much the rank grows when ``axis``'s coordinate grows by one."""
        sizes = self.sizes()
        stride = 1
        for name in self.order:
            if name == axis:
                return stride
            stride *= sizes[name]
        raise ConfigError(f"unknown axis {axis!r}")

    def layers_per_stage(self, num_layers: int) -> tuple[int, ...]:
        """The number of layers on each stage for a model of ``num_layers``.

        Raises:
            ConfigError: if pp does not fit the layers: an even split needs
                ``pp`` to divide ``num_layers``, an uneven one must sum to it.
        """
        if self.stage_layers is not None:
            if sum(self.stage_layers) != num_layers:
                raise ConfigError(
                    f"{self}: stage_layers {list(self.stage_layers)} sum to "
                    f"{sum(self.stage_layers)}, expected num_layers={num_layers}"
                )
            return self.stage_layers
        if num_layers % self.pp:
            raise ConfigError(f"pp={self.pp} does not divide num_layers={num_layers}")
        return (num_layers // self.pp,) * self.pp

    def stage_of_layer(self, layer: int, num_layers: int) -> int:
        """The pipeline stage that holds global layer index ``layer``."""
        if not 0 <= layer < num_layers:
            raise ConfigError(f"layer {layer} is outside [0, num_layers={num_layers})")
        end = 0
        for stage, count in enumerate(self.layers_per_stage(num_layers)):
            end += count
            if layer < end:
                return stage
        raise AssertionError("unreachable: layers_per_stage sums to num_layers")

    def first_layer(self, stage: int, num_layers: int) -> int:
        """Global index of the first layer on ``stage`` (stage-local index 0)."""
        return sum(self.layers_per_stage(num_layers)[:stage])

    def __str__(self) -> str:
        text = f"dp={self.dp},tp={self.tp},pp={self.pp}"
        if self.stage_layers is not None:
            text += ",stages=" + ":".join(str(n) for n in self.stage_layers)
        return text

    def to_json(self) -> dict:
        obj: dict = {"dp": self.dp, "tp": self.tp, "pp": self.pp, "order": list(self.order)}
        if self.stage_layers is not None:
            obj["stage_layers"] = list(self.stage_layers)
        return obj

    @classmethod
    def from_json(cls, obj: dict) -> "ParallelConfig":
        try:
            return cls(
                dp=obj["dp"],
                tp=obj["tp"],
                pp=obj["pp"],
                order=tuple(obj.get("order", AXES)),
                stage_layers=tuple(obj["stage_layers"]) if obj.get("stage_layers") else None,
            )
        except (KeyError, TypeError) as exc:
            raise ConfigError(f"ParallelConfig: cannot read {obj!r}: {exc}") from exc

    @classmethod
    def parse(cls, text: str) -> "ParallelConfig":
        """Parse ``"dp=2,tp=4,pp=2"``; missing degrees default to 1.

        ``stages=3:5`` gives an uneven layer-to-stage assignment.

        Raises:
            ConfigError: on an unknown key, a repeated key or a bad value.
        """
        values: dict = {}
        for item in filter(None, (part.strip() for part in text.split(","))):
            match = re.fullmatch(r"(\w+)\s*=\s*([\d:]+)", item)
            if not match:
                raise ConfigError(f"parallel config {text!r}: expected key=value, got {item!r}")
            key, value = match.groups()
            if key in values:
                raise ConfigError(f"parallel config {text!r}: {key} is given twice")
            if key in AXES and value.isdigit():
                values[key] = int(value)
            elif key == "stages":
                values["stage_layers"] = tuple(int(v) for v in value.split(":") if v)
            else:
                raise ConfigError(
                    f"parallel config {text!r}: unknown key or bad value {item!r}; "
                    "expected dp=, tp=, pp= (integers) or stages=a:b:..."
                )
        return cls(**values)
