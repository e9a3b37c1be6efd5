"""``hf-recattn serve MODEL [options]``: transformers' own OpenAI-compatible server (``transformers serve``), run
in this process with hf_recattn registered, so a RecAttn checkpoint loads with the installed package's classes.

The options are ``transformers serve``'s. Those that cannot drive a recurrent cache are refused before anything
loads (``REFUSED``). Bad requests get an HTTP 400 naming the fault instead of the server's bare 500: a ValueError
raised while a request is handled (what transformers and hf_recattn raise for bad arguments: a prompt or
``max_tokens`` beyond the model's positions, an invalid generation option) and a malformed chat (``messages`` that
is not a list of objects with a string ``role``). The server keeps serving.
"""

from __future__ import annotations

import argparse
import contextlib
import json
from collections.abc import Iterator
from typing import Any

from ..extras import require
from ..modeling.serving import CONTINUOUS_BATCHING_REFUSED
from .common import SubParsers, add_command

#: transformers serve options refused for RecAttn models, with the reason
REFUSED = {
    "--continuous-batching": CONTINUOUS_BATCHING_REFUSED,
    "--cb-": "the --cb-* options tune continuous batching; " + CONTINUOUS_BATCHING_REFUSED,
    "--compile": "--compile decodes through transformers' static KV cache, which cannot hold recurrent states; "
    "hf_recattn models decode with their own RecAttnCache (model.compile_decode() compiles its steps)",
}


class ServeError(ValueError):
    """An option that stops ``hf-recattn serve`` before it starts."""


def check_options(options: list[str]) -> None:
    """Refuse the options of ``REFUSED`` (``--no-continuous-batching`` and the like are fine)."""
    for option in options:
        name = option.split("=", 1)[0]
        for refused, reason in REFUSED.items():
            if name == refused or (refused.endswith("-") and name.startswith(refused)):
                raise ServeError(f"{name}: {reason}")


def chat_fault(body: Any) -> str | None:
    """What is wrong with a chat completion request's ``messages``, or None."""
    messages = body.get("messages") if isinstance(body, dict) else None
    if not isinstance(messages, list) or not messages:
        return "'messages' must be a non-empty list of {'role': ..., 'content': ...} objects"
    for i, message in enumerate(messages):
        if not isinstance(message, dict):
            return f"messages[{i}] must be an object, got {type(message).__name__}"
        if not isinstance(message.get("role"), str):
            return f"messages[{i}] needs a string 'role'"
        content = message.get("content")
        if content is not None and not isinstance(content, (str, list)):
            return f"messages[{i}].content must be a string or a list of parts, got {type(content).__name__}"
    return None


def _error(status: int, message: str) -> Any:
    from fastapi.responses import JSONResponse

    return JSONResponse({"error": {"message": message, "type": "invalid_request_error"}}, status_code=status)


def add_request_checks(app: Any) -> Any:
    """Add the 400 answers of this module's docstring to transformers' FastAPI ``app``."""
    from fastapi import Request

    @app.exception_handler(ValueError)
    async def _bad_value(_request: Request, exc: ValueError) -> Any:
        return _error(400, str(exc))

    @app.middleware("http")
    async def _check_chat(request: Request, call_next: Any) -> Any:
        if request.method == "POST" and request.url.path.rstrip("/") == "/v1/chat/completions":
            try:
                body = json.loads(await request.body())
            except ValueError as err:
                return _error(400, f"the request body is not JSON: {err}")
            fault = chat_fault(body)
            if fault is not None:
                return _error(400, fault)
        return await call_next(request)

    return app


@contextlib.contextmanager
def request_checks() -> Iterator[None]:
    """While active, transformers' server app is built with ``add_request_checks``."""
    from transformers.cli.serving import server

    build = server.build_server

    def build_with_checks(*args: Any, **kwargs: Any) -> Any:
        return add_request_checks(build(*args, **kwargs))

    server.build_server = build_with_checks
    try:
        yield
    finally:
        server.build_server = build


def _prepare(options: list[str]) -> Any:
    """Check the options and the serve extra; return transformers' command line app with the class resolvable."""
    check_options(options)
    require("serve", "hf-recattn serve")
    import transformers.cli.serving.model_manager  # noqa: F401  (the module that looks the class up)
    from transformers.cli.transformers import app

    from ..modeling.serving import expose_architecture

    expose_architecture("RecAttnForCausalLM")
    return app


def serve(model: str, options: list[str]) -> int:
    """Run ``transformers serve MODEL OPTIONS`` in this process until it stops; its exit status."""
    app = _prepare(options)
    with request_checks():
        try:
            app(["serve", model, *options], prog_name="hf-recattn")
        except SystemExit as done:
            return done.code if isinstance(done.code, int) else 0 if done.code is None else 1
    return 0


def serve_in_background(model: str, options: list[str]) -> Any:
    """The same server running in a thread of this process: transformers' ``Serve``; ``.kill_server()`` stops it."""
    app = _prepare(options)
    with request_checks():
        return app(["serve", model, *options, "--non-blocking"], prog_name="hf-recattn", standalone_mode=False)


def add_serve(sub: SubParsers) -> None:
    p = add_command(sub, "serve", "an OpenAI-compatible endpoint for a checkpoint: transformers serve, with "
                    "hf_recattn's classes", "Run transformers' own server (`transformers serve MODEL OPTIONS`) in "
                    "this process with hf_recattn registered. OPTIONS are transformers serve's (--host, --port, "
                    "--device, --dtype, ...); --continuous-batching, --cb-* and --compile are refused. See "
                    "docs/serving.md.")
    p.add_argument("model", help="a checkpoint folder or Hub id, served for every request")
    p.add_argument("options", nargs=argparse.REMAINDER, help="transformers serve options")
    p.set_defaults(handler=lambda args: serve(args.model, args.options))
