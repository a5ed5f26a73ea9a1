"""What the core's exceptions are answered with, for the fast path and the Django API alike.

========================  ======  ==============================================================
exception                 status  code
========================  ======  ==============================================================
InvalidInput              400     ``invalid_request`` (``fields`` names the field)
RequestTemplateRefused    400     ``request_template_refused`` (KVCACHE_REQUEST_TEMPLATES=false)
ChatTemplateError         400     ``invalid_chat`` (the conversation or template options)
TokenizerNotFound         404     ``model_not_found``
TemplateBudgetExceeded    422     ``template_budget_exceeded`` (CPU, memory or output budget)
TokenizerLoadError        422     ``tokenizer_load_failed``
IndexUnavailable          503     ``index_unavailable``
SandboxBusy               503     ``busy`` (every template sandbox is rendering)
anything else             None    (the caller answers 500 and logs it)
========================  ======  ==============================================================
"""

from __future__ import annotations

from kvindex import IndexUnavailable
from scoring.fastpath.schema import RequestError, invalid
from scoring.read_path import InvalidInput
from tokenization.chat_templates import ChatTemplateError, RequestTemplateRefused, TemplateBudgetExceeded
from tokenization.template_sandbox import SandboxBusy
from tokenization.tokenizers import TokenizerLoadError, TokenizerNotFound


def from_core(exc: BaseException) -> RequestError | None:
    """The answer to one of the core's exceptions (see the table); ``None`` for anything else."""
    if isinstance(exc, RequestError):
        return exc
    if isinstance(exc, InvalidInput):
        return invalid({exc.field: [str(exc).removeprefix(f"{exc.field}: ")]})
    if isinstance(exc, TemplateBudgetExceeded):
        return RequestError(422, "template_budget_exceeded", str(exc))
    if isinstance(exc, RequestTemplateRefused):
        return RequestError(400, "request_template_refused", str(exc))
    if isinstance(exc, ChatTemplateError):
        return RequestError(400, "invalid_chat", str(exc))
    if isinstance(exc, TokenizerNotFound):
        return RequestError(
            404,
            "model_not_found",
            f"unknown model {exc.model!r}: no tokenizer for it ({'; '.join(exc.tried)}). Configure a "
            "tokenizer source for it (a model config, KVCACHE_TOKENIZERS_DIR), or send token_ids to "
            "/api/v1/score",
        )
    if isinstance(exc, TokenizerLoadError):
        return RequestError(422, "tokenizer_load_failed", str(exc))
    if isinstance(exc, IndexUnavailable):
        # Not the error itself: it names the server's address. /readyz logs it (once per probe,
        # where a line per failed score would flood the log while the index is down).
        return RequestError(503, "index_unavailable", "the KV-block index cannot be reached")
    if isinstance(exc, SandboxBusy):
        return RequestError(503, "busy", str(exc))
    return None


def error_body(error: RequestError) -> dict:
    """The JSON body of an error: ``{"error": {"code", "message"[, "fields"]}}``."""
    body: dict = {"code": error.code, "message": error.message}
    if error.fields:
        body["fields"] = error.fields
    return {"error": body}
