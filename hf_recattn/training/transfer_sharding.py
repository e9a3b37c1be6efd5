"""Attention transfer (stage 1 of conversion) under FSDP: what is sharded, and the plain student afterwards.

Stage 1 runs each trained layer's attention on its own (``RecAttnAttention.attend`` on the teacher's inputs), never
the decoder layers, so the decoder layers as units (accelerate's default) would never gather their weights.
Instead each trained layer's ``self_attn`` is an FSDP2 unit with ``attend`` as its forward
(``register_fsdp_forward_method``): its mixer parameters (trained, with their gradients and Adam states) and its
q/k/v/o projections (the student's frozen copies, trained only when ``stage1.projections`` names them) are sharded
over the processes. The rest of the student (embeddings, MLPs, norms), which stage 1 never runs, is left whole on
every process, unsharded and untouched, as is the teacher (not a submodule of the trained objective). Each layer's
gradients stay in its own unit, so ``stage1.max_grad_norm`` clips them per layer on the shards (the norm summed over
the processes).

The later steps (the retrieval heads, stage 2, evaluation) need the whole student on every process: ``restore``
gathers each trained attention into a plain copy made before sharding and puts it back in the student.
"""

from __future__ import annotations

from torch import nn

from . import parallel
from .forms import decoder_layers
from .sharding import PlainCopy, full_tensor

#: what ``fully_shard`` sets on every module its unit manages (our root: the untouched rest of the student)
FSDP_MARKS = ("_is_fsdp_managed_module", "_fsdp_use_orig_params")


class ShardedAttention:
    """The trained layers' attentions of ``student``: plain copies made now (before ``fastest_forms`` switches any
    mixer's form), ``shard`` them in place for training, ``restore`` the plain ones with the trained weights."""

    def __init__(self, student: nn.Module, layers: list[int]) -> None:
        self.student, self.layers = student, list(layers)
        self.copies = {i: PlainCopy(decoder_layers(student)[i].self_attn) for i in self.layers}

    def shard(self, objective: nn.Module) -> None:
        """Each trained attention an FSDP2 unit on a mesh of every process (on the student's device type), then
        ``objective`` the root unit, which manages none of the remaining parameters."""
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import fully_shard, register_fsdp_forward_method

        device = next(self.student.parameters()).device
        mesh = init_device_mesh(device.type, (parallel.world_size(),))
        units = [decoder_layers(self.student)[i].self_attn for i in self.layers]
        for unit in units:
            fully_shard(unit, mesh=mesh)
            register_fsdp_forward_method(unit, "attend")
        inside = {id(p) for unit in units for p in unit.parameters()}
        fully_shard(objective, mesh=mesh, ignored_params={p for p in objective.parameters() if id(p) not in inside})

    def restore(self) -> None:
        """Every process takes part: each trained attention's whole weights gathered into its plain copy, which
        replaces the sharded one in the student; the rest of the student loses the marks of the root unit."""
        for i in self.layers:
            layer = decoder_layers(self.student)[i]
            state = {name: full_tensor(tensor) for name, tensor in layer.self_attn.state_dict().items()}
            layer.self_attn = self.copies[i].fill(state)
        for module in self.student.modules():  # else transformers' generate would wait for the other processes
            for mark in FSDP_MARKS:
                vars(module).pop(mark, None)
