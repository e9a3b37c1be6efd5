"""``hf-recattn`` commands run one after another in each process of a torchrun / accelerate launch, for
tests/test_fsdp.py, watching how the trained parameters are held.

``python fsdp_worker.py NOTES_FILE COMMAND [--- COMMAND ...]``, each COMMAND ``[STOP] ARGS...``: runs
``hf_recattn.cli.main(ARGS)``; a leading integer STOP interrupts that command (a KeyboardInterrupt, as Ctrl-C) just
before its STOP-th optimizer step, which a rerun then resumes. Before every optimizer step the worker notes, per
optimizer, the parameters it updates: how many, how many are DTensors, how many elements this process holds of how
many in all. The zero learning-rate step with which torch creates a resumed optimizer's state before loading it is
not counted (the tests' schedules have no zero learning rate). Each process writes ``NOTES_FILE`` with its rank in
the name: per command, its exit code and its optimizers' notes in the order they first stepped.
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path
from typing import Any

import torch
from torch.distributed.tensor import DTensor
from torch.optim.optimizer import register_optimizer_step_pre_hook

from hf_recattn.cli import main

STATE: dict[str, Any] = {"notes": [], "steps": 0, "stop": None}


def _note(optimizer: torch.optim.Optimizer, args: Any, kwargs: Any) -> None:
    if all(float(group["lr"]) == 0.0 for group in optimizer.param_groups):
        return  # the step with which torch's set_optimizer_state_dict creates the state it then loads
    STATE["steps"] += 1
    if STATE["steps"] == STATE["stop"]:
        raise KeyboardInterrupt
    params = [p for group in optimizer.param_groups for p in group["params"]]
    held = [p.to_local() if isinstance(p, DTensor) else p for p in params]
    note = getattr(optimizer, "_worker_note", None)
    if note is None:  # kept on the optimizer: a freed optimizer's id() may come back for the next one
        note = optimizer._worker_note = {"steps": 0}
        STATE["notes"].append(note)
    note.update(params=len(params), dtensors=sum(isinstance(p, DTensor) for p in params),
                local=sum(p.numel() for p in held), total=sum(p.numel() for p in params))
    note["steps"] += 1


def _commands(argv: list[str]) -> list[tuple[int | None, list[str]]]:
    commands, current = [], []
    for arg in [*argv, "---"]:
        if arg != "---":
            current.append(arg)
            continue
        stop = int(current.pop(0)) if current and current[0].isdigit() else None
        commands.append((stop, current))
        current = []
    return commands


if __name__ == "__main__":
    register_optimizer_step_pre_hook(_note)
    record = []
    for stop, args in _commands(sys.argv[2:]):
        STATE.update(notes=[], steps=0, stop=stop)
        code = main(args)
        record.append({"code": code, "optimizers": STATE["notes"]})
    path = Path(sys.argv[1])
    path.with_name(f"{path.stem}-rank{os.environ.get('RANK', '0')}{path.suffix}").write_text(json.dumps(record))
