"""Live state of a running megatron-core job: export, import, change, rebuild after a failure.

The lines a ``pretrain_gpt``-style loop adds are in ``docs/megatron.md``
("Elastic training of a running job"); ``examples/megatron_elastic.py`` runs them.

- :class:`LiveSpec`: what the job's tree depends on (model shape, params dtype,
  DDP options); ``spec.tree(*configs)`` is the tree, with the distributed
  optimizer's state dp-sharded exactly as megatron-core holds it.
- :func:`export_state` / :func:`import_state`: this rank's state out of, and
  into, megatron-core model chunks, optimizer and scheduler.
- :func:`change`: export, ``tenplex.reconfigure``, new ``parallel_state``,
  rebuild, import; :class:`Membership` re-forms the default group when the
  world size changes.
- :func:`rebuild_after_failure`, :func:`save_checkpoint`: lost ranks rebuilt from replicas,
  the last checkpoint as fallback; survivors may go on alone.
- :class:`Snapshots`, :func:`recover_from_snapshots`: host-local snapshots that
  outlive torchrun's workers, and recovery from them after its restart.
"""

from tenplex_megatron.live.change import Changed, Parts, change, transfer
from tenplex_megatron.live.group import Membership, destroy_parallel_state, init_parallel_state
from tenplex_megatron.live.recover import Recovered, rebuild_after_failure, save_checkpoint
from tenplex_megatron.live.snapshot import Snapshots, recover_from_snapshots
from tenplex_megatron.live.spec import LiveSpec, megatron_dp_ranges
from tenplex_megatron.live.state import Imported, current_config, export_state, import_state

__all__ = ["Changed", "Imported", "LiveSpec", "Membership", "Parts", "Recovered", "change", "current_config",
           "destroy_parallel_state", "export_state", "import_state", "init_parallel_state",
           "megatron_dp_ranges", "rebuild_after_failure", "recover_from_snapshots", "save_checkpoint", "Snapshots", "transfer"]
