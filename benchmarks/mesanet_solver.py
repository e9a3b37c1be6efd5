"""How many conjugate-gradient steps MesaNet's solves run before their loop ends, in prefill and in decode.

The solver (``hf_recattn/modeling/ops_mesa.py``) runs at most ``cg_steps`` steps and, on a CPU, ends its loop once
every system of the batch has converged (the skipped steps would add exact zeros). How early that happens depends
on how well conditioned the systems are, which the forget gates set: this script measures it. A SmolLM2-shaped
model (benchmarks/decode.py's shape, random weights) with MesaNet in every layer, for each ``--inits`` (``scratch``:
random gate weights, gates near 1/2; ``convert``: the half-lives a conversion starts from) and each context: a real
prefill of that many random tokens (chunks of ``--block`` tokens), then ``--decode-steps`` one-token steps. Every
call of the solver is counted: one per layer and token in decode, one per chunk group in prefill. ``--model`` measures
a saved checkpoint instead (a converted MesaNet, its tokenizer beside it) on the embedded corpus's text.

``python benchmarks/mesanet_solver.py --help`` lists the flags.
The results and their provenance go to ``--out`` (default ``benchmarks/results/mesanet_solver_cpu.json``);
``scripts/render_docs.py`` renders the docs' tables from that file with ``render_markdown``.
"""

from __future__ import annotations

import argparse
import statistics
from collections.abc import Callable

import torch
from decode import llama_model, recattn_model
from results_file import add_out_argument, run_record, write_results

from hf_recattn import RecAttnForCausalLM
from hf_recattn.data.corpus import embedded_texts, token_blocks
from hf_recattn.modeling import ops_mesa


def counting_solver(solve: Callable, record: list[int]) -> Callable:
    """``solve`` (the CG function), recording how many steps each call ran (its products minus the first)."""

    def counted(matvec: Callable, rhs: torch.Tensor, diag: torch.Tensor, steps: int) -> torch.Tensor:
        products = 0

        def counting(p: torch.Tensor) -> torch.Tensor:
            nonlocal products
            products += 1
            return matvec(p)

        x = solve(counting, rhs, diag, steps)
        record.append(max(products - 1, 0))
        return x

    return counted


def summary(steps: list[int]) -> dict[str, float]:
    """How many calls, and the fewest, median and most steps a call ran."""
    return {"solves": len(steps), "min": min(steps), "median": statistics.median(steps), "max": max(steps)}


def table_row(row: dict) -> str:
    cells = [f"{part['solves']} | {part['min']} / {part['median']:g} / {part['max']}"
             for part in (row["prefill"], row["decode"])]
    return f"| {row['model']} | {row['context']} | {cells[0]} | {cells[1]} |"


def render_markdown(results: dict) -> str:
    """The table (one row per model and context) and the notes of a results file."""
    return "\n".join([
        "| model | context | prefill solves | steps min / median / max | decode solves | steps min / median / max |",
        "|---|---:|---:|---:|---:|---:|",
        *(table_row(row) for row in results["rows"]),
        "",
        *results["notes"],
    ])


def text_ids(folder: str, length: int) -> torch.Tensor:
    """[1, length] tokens of the embedded corpus, by the checkpoint's own tokenizer."""
    from transformers import AutoTokenizer

    return token_blocks(AutoTokenizer.from_pretrained(folder), embedded_texts(), length, max_tokens=length)


def models(args: argparse.Namespace, max_positions: int) -> dict[str, tuple[RecAttnForCausalLM, torch.Tensor]]:
    """label -> (model, [1, max_positions] token ids: the prompt of the longest context and its decode tokens)."""
    if args.model:
        model = RecAttnForCausalLM.from_pretrained(args.model).eval()
        if not any(layer.self_attn.mixer.name == "mesa" for layer in model.model.layers):
            raise SystemExit(f"--model {args.model}: no layer of this checkpoint is a MesaNet mixer")
        return {args.model: (model, text_ids(args.model, max_positions))}
    weights = llama_model(max_positions).state_dict()
    ids = torch.randint(0, weights["model.embed_tokens.weight"].shape[0], (1, max_positions))
    return {init: (recattn_model({"mixer": "mesanet", "init": init}, max_positions, weights), ids)
            for init in args.inits}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--inits", nargs="+", default=["scratch", "convert"], choices=["scratch", "convert"])
    p.add_argument("--contexts", type=int, nargs="+", default=[2048, 8192])
    p.add_argument("--block", type=int, default=2048, help="prefill chunk (tokens per forward)")
    p.add_argument("--decode-steps", type=int, default=3)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--model", help="a saved hf_recattn checkpoint with MesaNet layers (instead of --inits)")
    add_out_argument(p, "mesanet_solver_cpu.json")
    args = p.parse_args(argv)
    torch.manual_seed(0)
    torch.set_num_threads(args.threads)
    record = run_record()
    max_positions = max(args.contexts) + args.decode_steps
    solver = ops_mesa.conjugate_gradient
    rows = []
    for label, (model, all_ids) in models(args, max_positions).items():
        for context in args.contexts:
            prefill_steps: list[int] = []
            decode_steps: list[int] = []
            cache = model.new_cache()
            ids = all_ids[:, :context]
            try:
                with torch.inference_mode():
                    ops_mesa.conjugate_gradient = counting_solver(solver, prefill_steps)
                    for block in ids.split(args.block, dim=1):
                        model(input_ids=block, past_key_values=cache, use_cache=True, logits_to_keep=1)
                    ops_mesa.conjugate_gradient = counting_solver(solver, decode_steps)
                    for i in range(args.decode_steps):
                        model(input_ids=all_ids[:, context + i, None], position_ids=torch.tensor([[context + i]]),
                              past_key_values=cache, use_cache=True, logits_to_keep=1)
            finally:
                ops_mesa.conjugate_gradient = solver
            rows.append({"model": label, "context": context, "prefill": summary(prefill_steps),
                         "decode": summary(decode_steps)})
            print(table_row(rows[-1]), flush=True)
    results = write_results(args.out, "mesanet_solver", record, {
        "settings": {key: value for key, value in vars(args).items() if key != "out"},
        "rows": rows,
        "notes": [f"torch {torch.__version__}, {torch.get_num_threads()} thread(s), cg_steps 30"],
    })
    print()
    print(render_markdown(results))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
