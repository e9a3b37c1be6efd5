"""``hf-recattn push``: publish a checkpoint folder to the Hub with a generated model card."""

from __future__ import annotations

import argparse
import sys

from .common import SubParsers, add_command


def push(folder: str, repo_id: str, **kwargs: object) -> int:
    """Push ``folder`` to ``repo_id`` (``hub.push_checkpoint``'s options); the exit status, a failure in one line."""
    from ..hub import PushError, push_checkpoint

    try:
        url = push_checkpoint(folder, repo_id, **kwargs)
    except PushError as err:
        print(f"hf-recattn push: error: {err}", file=sys.stderr)
        return 1
    print(f"pushed {folder} to {repo_id}: {url}")
    return 0


def add_push(sub: SubParsers) -> None:
    p = add_command(sub, "push", "publish a checkpoint folder to the Hub with a generated model card",
                    "Publish an hf_recattn checkpoint (weights, config, runtime files, tokenizer, generation config, "
                    "report.json) with a model card rendered for REPO_ID, in one commit. HF_ENDPOINT and HF_TOKEN are "
                    "honoured as by every huggingface_hub client.")
    p.add_argument("checkpoint", help="a checkpoint folder (e.g. a conversion's OUTPUT/model)")
    p.add_argument("repo_id", help="namespace/name (or name: the token's namespace)")
    p.add_argument("--private", action="store_true", help="create the repo private")
    p.add_argument("--revision", default=None, help="a branch to push to (created from main when missing)")
    p.add_argument("--commit-message", default=None)
    p.add_argument("--token", default=None, help="a Hub token (default: HF_TOKEN or the stored login)")

    def run(args: argparse.Namespace) -> int:
        return push(args.checkpoint, args.repo_id, private=args.private, revision=args.revision,
                    commit_message=args.commit_message, token=args.token)

    p.set_defaults(handler=run)
