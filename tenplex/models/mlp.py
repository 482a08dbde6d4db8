"""Dense MLP blocks, laid out as Megatron's ``MLP`` (``transformer/mlp.py``)."""

from __future__ import annotations

from tenplex.ptree.layout import Expert, Layout, Split, Stage
from tenplex.ptree.tree import TensorLeaf

__all__ = ["dense_mlp"]


def dense_mlp(spec, prefix: str, stage: Stage, ffn: int,
              expert: Expert | None = None) -> dict[str, TensorLeaf]:
    """A (dense or expert) MLP: fc1 column parallel (``[gate; up]`` with SwiGLU), fc2 row parallel.

    Args:
        spec: the model (a :class:`~tenplex.models.gpt.GPTSpec`).
        prefix: the MLP's path.
        stage: its pipeline membership.
        ffn: its inner size (per half, with SwiGLU).
        expert: an :class:`~tenplex.ptree.layout.Expert`: split over expert tp.
    """
    dt, h = spec.dtype, spec.hidden
    unit = "moe_ffn_hidden_size" if expert is not None else "ffn_hidden_size"
    fc1_rows = 2 * ffn if spec.swiglu else ffn
    fc1 = Split(0, parts=(ffn, ffn) if spec.swiglu else None, unit=unit)
    out = {f"{prefix}/fc1/weight": TensorLeaf((fc1_rows, h), dt, Layout(stage, fc1, expert=expert))}
    if spec.bias:
        out[f"{prefix}/fc1/bias"] = TensorLeaf((fc1_rows,), dt, Layout(stage, fc1, expert=expert))
    out[f"{prefix}/fc2/weight"] = TensorLeaf((h, ffn), dt,
                                             Layout(stage, Split(1, unit=unit), expert=expert))
    if spec.bias:
        out[f"{prefix}/fc2/bias"] = TensorLeaf((h,), dt, Layout(stage, expert=expert))
    return out
