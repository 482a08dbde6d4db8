"""Layer-to-(stage, virtual chunk) assignment, as megatron-core 0.16 assigns layers.

Without interleaving (``vpp = 1``) stage ``s`` holds a contiguous run of
``L_s`` layers. With ``vpp`` virtual chunks per stage, each stage's ``L_s``
layers are cut into ``vpp`` chunks of ``L_s / vpp`` layers, and the global
layer sequence runs chunk-major: chunk 0 of stages 0, 1, ..., pp-1, then
chunk 1 of every stage, and so on. For 8 layers, pp = 2, vpp = 2::

    stage 0: [0, 1] [4, 5]
    stage 1: [2, 3] [6, 7]

This is ``get_transformer_layer_offset`` and ``get_num_layers_to_build``
(``transformer/transformer_layer.py``, ``transformer/transformer_block.py``),
including uneven first and last stages
(``num_layers_in_first_pipeline_stage`` / ``..._last_...``): megatron gives
every middle stage the same count, tenplex allows any counts ``L_s``.
Layer indices stay global; a chunk's layers are contiguous.
"""

from __future__ import annotations

from tenplex.errors import ConfigError

__all__ = ["stage_counts", "chunk_starts", "chunk_of"]


def stage_counts(num_layers: int, pp: int, stage_layers: tuple[int, ...] | None,
                 where: str) -> tuple[int, ...]:
    """Layers on each stage.

    Raises:
        ConfigError: an even split needs ``pp`` to divide ``num_layers``; an
            uneven one must sum to it.
    """
    if stage_layers is not None:
        if sum(stage_layers) != num_layers:
            raise ConfigError(f"{where}: stage_layers {list(stage_layers)} sum to "
                              f"{sum(stage_layers)}, expected num_layers={num_layers}")
        return stage_layers
    if num_layers % pp:
        hint = ""
        if num_layers >= pp:  # the remainder on the first and last stages, which Megatron-LM can express
            q, r = divmod(num_layers, pp)  # (--decoder-first/last-pipeline-num-layers): 3:2:2:3 for 10 on 4
            counts = [q] * pp
            counts[0] += r - r // 2
            counts[-1] += r // 2
            hint = "; give each stage's layers, e.g. stages=" + ":".join(map(str, counts))
        raise ConfigError(f"pp={pp} does not divide num_layers={num_layers}{hint}")
    return (num_layers // pp,) * pp


def chunk_starts(counts: tuple[int, ...], vpp: int) -> tuple[tuple[int, ...], ...]:
    """``starts[s][v]``: the first global layer of chunk ``v`` of stage ``s``.

    Raises:
        ConfigError: if ``vpp`` does not divide some stage's layer count.
    """
    for stage, count in enumerate(counts):
        if count % vpp:
            raise ConfigError(f"vpp={vpp} does not divide the {count} layers of stage {stage} "
                              f"(layers per stage {list(counts)})")
    starts = [[0] * vpp for _ in counts]
    position = 0
    for v in range(vpp):
        for s, count in enumerate(counts):
            starts[s][v] = position
            position += count // vpp
    return tuple(tuple(row) for row in starts)


def chunk_of(layer: int, counts: tuple[int, ...], vpp: int) -> tuple[int, int]:
    """``(stage, chunk)`` of global layer ``layer``."""
    total = sum(counts)
    if not 0 <= layer < total:
        raise ConfigError(f"layer {layer} is outside [0, num_layers={total})")
    starts = chunk_starts(counts, vpp)
    for s, count in enumerate(counts):
        for v in range(vpp):
            if starts[s][v] <= layer < starts[s][v] + count // vpp:
                return s, v
    raise AssertionError("unreachable: the chunks tile the layers")
