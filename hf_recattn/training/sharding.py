"""FSDP2 under transformers' Trainer (ZeRO-3: each process holds its share of the parameters, their gradients and
the optimizer states), on GPUs and on the CPU.

It is asked for the way transformers and accelerate ask for it: TrainingArguments ``fsdp`` / ``fsdp_config``
(version 2), or ``accelerate launch`` with an FSDP config file (which sets ``ACCELERATE_USE_FSDP`` and the ``FSDP_*``
variables in every process). On GPUs accelerate then shards the model itself (``fully_shard`` on each decoder
layer). On the CPU it does not: accelerate switches only its multi-GPU modes to FSDP (``AcceleratorState.__init__``
in accelerate/state.py lists MULTI_GPU, MULTI_NPU, MULTI_XPU, ... but not MULTI_CPU), so a CPU run would silently
be DDP. ``FsdpTrainer`` makes the same switch for MULTI_CPU after building the Trainer's accelerator; from there on
it is accelerate's own FSDP2 path (wrapping, gradient reduction, checkpoints, resume), with torch's ``fully_shard``
on a CPU device mesh over gloo.

A sharded module has FSDP's class (``FSDPRecAttnForCausalLM``) and DTensor parameters. ``PlainCopy`` gives the
trained model back as a plain module: a copy made before sharding with its parameters on the meta device (no
memory), filled after training with the gathered full weights.
"""

from __future__ import annotations

import copy
import os
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch
from torch import nn
from torch.distributed.tensor import DTensor, distribute_tensor
from transformers import Trainer

from . import parallel

#: where an FSDP request came from when it is accelerate launch's FSDP config (its environment)
ACCELERATE_CONFIG = "the accelerate config's distributed_type: FSDP (ACCELERATE_USE_FSDP)"


# ----- the request ------------------------------------------------------------------------------------------------
def from_environment() -> bool:
    """Whether ``accelerate launch`` started this process with an FSDP config."""
    return os.environ.get("ACCELERATE_USE_FSDP", "false").lower() in ("1", "true", "yes")


def requested(args: Any) -> bool:
    """Whether a Trainer with these TrainingArguments shards with FSDP: their ``fsdp``, or accelerate's config."""
    return getattr(args, "fsdp_plugin_args", None) is not None or from_environment()


def check_request(option: str, version: int) -> None:
    """Refuse an FSDP request that cannot shard, before any work; ``option`` names where it came from."""
    if parallel.world_size() < 2:
        raise ValueError(f"{option}: FSDP shards the model over several processes, and this run has one; start it "
                         "with torchrun --nproc_per_node N (or accelerate launch), or leave FSDP out")
    if version != 2:
        raise ValueError(f"{option}: FSDP version {version} is not supported; use version 2 (fully_shard): "
                         "fsdp_config: {version: 2}, or fsdp_version: 2 in an accelerate config")


def fsdp_arguments(fsdp: bool) -> dict[str, Any]:
    """The TrainingArguments a yes/no FSDP option stands for: FSDP2 with accelerate's defaults (each decoder layer
    its own unit), or none (a fresh dict: TrainingArguments fills in its ``fsdp_config``)."""
    return {"fsdp": True, "fsdp_config": {"version": 2}} if fsdp else {}


def check_flag(fsdp: bool, option: str) -> None:
    """``check_request`` for a yes/no FSDP option (``fsdp_arguments``) or accelerate's FSDP config in the
    environment; nothing when neither asks for FSDP."""
    if fsdp:
        check_request(option, 2)
    elif from_environment():
        check_request(ACCELERATE_CONFIG, int(os.environ.get("FSDP_VERSION", "1")))


def check_arguments(args: Any, option: str) -> None:
    """``check_request`` for TrainingArguments (``option``: the name of their ``fsdp`` setting) or accelerate's
    FSDP config in the environment; nothing when neither asks for FSDP."""
    if getattr(args, "fsdp_plugin_args", None) is not None:
        check_request(option, int(args.fsdp_plugin_args["fsdp_version"]))
    else:
        check_flag(False, option)


def check_resume(checkpoint: Path, sharded: bool) -> None:
    """A Trainer checkpoint resumes only the way it was written: with FSDP (accelerate's optimizer file) or
    without (Trainer's); the other way round would not find its optimizer state."""
    written = (checkpoint / "optimizer.bin").is_file() or (checkpoint / "optimizer_0").is_dir()
    if written != sharded:
        how = "with FSDP" if written else "without FSDP"
        raise ValueError(f"{checkpoint}: written {how}; resume it {how} (or delete it to start that part again)")


# ----- the Trainer ------------------------------------------------------------------------------------------------
class FsdpTrainer(Trainer):
    """A Trainer whose FSDP request shards on the CPU too (``is_fsdp_enabled`` then holds everywhere)."""

    def create_accelerator_and_postprocess(self) -> None:
        super().create_accelerator_and_postprocess()
        from accelerate.state import PartialState
        from accelerate.utils import DistributedType, FullyShardedDataParallelPlugin

        state = self.accelerator.state
        if state.distributed_type != DistributedType.MULTI_CPU or not requested(self.args):
            return
        # what AcceleratorState.__init__ does for the multi-GPU modes (the plugin from the arguments or environment)
        plugin = FullyShardedDataParallelPlugin(**(self.args.fsdp_plugin_args or {}))
        if state.mixed_precision != "no":
            plugin.set_mixed_precision(state.mixed_precision)
        state.fsdp_plugin = plugin
        state.distributed_type = DistributedType.FSDP
        PartialState._shared_state["distributed_type"] = DistributedType.FSDP
        self.is_fsdp_enabled = True


# ----- tensors ----------------------------------------------------------------------------------------------------
def full_tensor(tensor: torch.Tensor) -> torch.Tensor:
    """The whole tensor: a sharded one gathered from every process (all of them must call), a plain one as it is."""
    return tensor.full_tensor() if isinstance(tensor, DTensor) else tensor


def copy_full(param: torch.Tensor, value: torch.Tensor) -> None:
    """Copy the whole tensor ``value`` into ``param``: all of it, or this process's share of a sharded one."""
    value = value.to(param.dtype)
    with torch.no_grad():
        if isinstance(param, DTensor):
            value = distribute_tensor(value.to(param.device), param.device_mesh, param.placements, src_data_rank=None)
        param.copy_(value)


def full_state_dict(model: nn.Module, everywhere: bool) -> dict[str, torch.Tensor]:
    """A sharded ``model``'s whole state dict, gathered (every process takes part): on every process and on the
    model's device, or (``everywhere`` false) on the main process only, in CPU memory ({} on the others)."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

    return get_model_state_dict(model, options=StateDictOptions(full_state_dict=True, cpu_offload=not everywhere))


# ----- the plain model after training -----------------------------------------------------------------------------
class PlainCopy:
    """A copy of ``model`` made before it is sharded: the same modules, buffers and attributes, its parameters on the
    meta device (tied ones still tied). ``fill(state)`` gives it the trained weights and returns it."""

    def __init__(self, model: nn.Module) -> None:
        memo: dict[int, Any] = {
            id(p): nn.Parameter(torch.empty_like(p, device="meta"), requires_grad=p.requires_grad)
            for p in model.parameters()
        }
        self.module = copy.deepcopy(model, memo)

    def fill(self, state: Mapping[str, torch.Tensor]) -> nn.Module:
        """The copy with the whole weights of ``state`` (every parameter and persistent buffer by name), on their
        device; the tensors in ``state`` become its parameters."""
        params = dict(self.module.named_parameters())  # tied parameters once
        missing = sorted(set(params) - set(state))
        if missing:
            raise ValueError(f"the gathered weights lack {missing[:4]}")
        for name, param in params.items():
            torch.utils.swap_tensors(param, nn.Parameter(state[name], requires_grad=param.requires_grad))
        with torch.no_grad():
            for name, buffer in self.module.named_buffers():
                if name in state:
                    buffer.copy_(state[name])
        device = next(iter(params.values())).device if params else None
        return self.module.to(device) if device is not None else self.module
