"""What every Megatron writer derives from the source's value leaves: args, RNG states, optimizer meta."""

from __future__ import annotations

from typing import Any

from tenplex.ptree.config import Coord, ParallelConfig

from tenplex_megatron.model import rng
from tenplex_megatron.model.config import MegatronConfig, args_for
from tenplex_megatron.torchfiles.jsonable import from_jsonable

__all__ = ["TargetValues"]


class TargetValues:
    """The target's Megatron values, decoded.

    Args:
        values: the planned target values (``{path: value or {key: value}}``, JSON).
        cfg: the model config.
        config: the target config.

    Attributes:
        args: Megatron-LM args rewritten for ``config`` (:func:`args_for`).
        iteration, checkpoint_version, flops, scheduler, extra: as stored.
        optimizer: ``{"param_groups": [...], "step": float | None, ...}`` or None.
        had_rng: whether the source stored any RNG state.
        notes: what was derived or dropped, one line each.
    """

    def __init__(self, values: dict, cfg: MegatronConfig, config: ParallelConfig):
        self.values, self.cfg, self.config = values, cfg, config
        self.args = args_for(values.get("megatron/args"), cfg, config)
        self.iteration = values.get("megatron/iteration") or 0
        self.checkpoint_version = values.get("megatron/checkpoint_version") or 3.0
        self.flops = values.get("megatron/num_floating_point_operations_so_far") or 0
        self.scheduler = from_jsonable(values.get("megatron/opt_param_scheduler"))
        self.optimizer = from_jsonable(values.get("megatron/optimizer"))
        self.extra = from_jsonable(values.get("megatron/extra")) or {}
        self.notes: list[str] = []
        stored = values.get("megatron/rng_state") or {}
        self.had_rng = any(v is not None for v in stored.values()) if isinstance(stored, dict) else False
        self._rng = {k: from_jsonable(v) for k, v in stored.items()} if isinstance(stored, dict) else {}

    @property
    def dp_random_init(self) -> bool:
        """Megatron-LM's ``data_parallel_random_init`` (each dp rank's RNG state in every list)."""
        return bool(getattr(self.args, "data_parallel_random_init", False))

    def _expert_rank(self, tp_rank: int, pp_rank: int, dp_cp_rank: int) -> tuple[int, int]:
        """``(ep, etp)`` of the target rank at (tp, pp, dp-cp rank ``dp * cp + cp``: megatron-core's
        dp-cp group, cp inside dp)."""
        cp = self.config.cp
        c = self.config.coord(self.config.rank(Coord(dp_cp_rank // cp, tp_rank, pp_rank, dp_cp_rank % cp)))
        return c.ep, c.etp

    def rng_states(self, per_dp: bool = False) -> dict[str, list]:
        """``{"tp=T,pp=P": [rank states]}`` for every target coordinate; new ones derived from the seed.

        With ``per_dp`` each list holds every dp-cp rank's own state (for
        :func:`~tenplex_megatron.formats.dist.keys.rng_objects`); otherwise one, which every dp rank
        restores (or with :attr:`dp_random_init` one per dp rank)."""
        coords = [(t, p) for p in range(self.config.pp) for t in range(self.config.tp)]
        kept = {k: v for k, v in self._rng.items() if v is not None}
        states, notes = rng.fill_states(kept, coords, self.config.dp, seed=int(getattr(self.args, "seed", 1234)),
                                        dp_random_init=self.dp_random_init,
                                        kind=rng.device_kind(list(kept.values())),
                                        per_rank=self.config.dp * self.config.cp if per_dp else 1,
                                        expert_rank=self._expert_rank)
        self.notes.extend(n for n in notes if n not in self.notes)
        return states

    def param_groups(self) -> list[dict]:
        groups = (self.optimizer or {}).get("param_groups") or [{"wd_mult": 1.0}, {"wd_mult": 0.0}]
        return [{**g, "betas": tuple(g["betas"])} if isinstance(g.get("betas"), list) else g for g in groups]

    def expert_param_groups(self) -> list[dict]:
        """The expert optimizer's groups (ep > 1): the source's, or, from an ep = 1 source, its
        weight-decay groups with ``is_expert_parallel=True`` (megatron-core matches groups by
        ``(wd_mult, lr_mult, is_expert_parallel, is_decoupled_lr)``, ``optimizer.py``)."""
        stored = (self.optimizer or {}).get("expert_param_groups")
        if stored:
            groups = stored
        else:
            groups = [dict(g, is_expert_parallel=True) for g in self.param_groups()
                      if float(g.get("wd_mult", 1.0)) != 0.0]
        return [{**g, "betas": tuple(g["betas"])} if isinstance(g.get("betas"), list) else g for g in groups]

    def step(self) -> Any:
        return (self.optimizer or {}).get("step")

    def grad_scaler(self) -> dict:
        """``{"grad_scaler": state}`` when the source's optimizer had one (fp16), else ``{}``."""
        scaler = (self.optimizer or {}).get("grad_scaler")
        return {} if scaler is None else {"grad_scaler": scaler}
