"""Errors as the OpenAI API shapes them: {"error": {"message", "type", "param", "code"}}.

Every failure a client can see is an APIError with its HTTP status; exceptions from the
engine and from decoding are translated here, at the edge, so no handler needs to know
them and no stack trace ever reaches a client."""

from __future__ import annotations

import logging
import re

import msgspec
from starlette.requests import Request
from starlette.responses import Response

from actors.errors import EngineDeadError, EngineRequestError, InvalidRequestError

logger = logging.getLogger(__name__)


class ErrorBody(msgspec.Struct):
    message: str
    type: str
    param: str | None = None
    code: str | int | None = None  # troupe's own codes are names; vLLM's errors carry their status


class ErrorResponse(msgspec.Struct):
    error: ErrorBody


class APIError(Exception):
    """A request that ends with an error status and an OpenAI-shaped body."""

    def __init__(self, status: int, message: str, *, type: str = "invalid_request_error",
                 param: str | None = None, code: str | int | None = None,
                 headers: dict[str, str] | None = None) -> None:
        super().__init__(message)
        self.status = status
        self.body = ErrorResponse(ErrorBody(message=message, type=type, param=param, code=code))
        self.headers = headers

    def response(self) -> Response:
        return Response(msgspec.json.encode(self.body), status_code=self.status, headers=self.headers,
                        media_type="application/json")


def bad_request(message: str, param: str | None = None, code: str | None = None) -> APIError:
    return APIError(400, message, param=param, code=code)


def engine_unavailable(error: EngineDeadError) -> APIError:
    return APIError(503, f"the engine is not running: {error}", type="server_error", code="engine_dead")


def server_busy(retry_after_s: int) -> APIError:
    return APIError(503, "the server has too many requests waiting; retry later", type="server_error",
                    code="overloaded", headers={"Retry-After": str(retry_after_s)})


def internal_error() -> APIError:
    return APIError(500, "internal server error (the server log has the details)", type="server_error",
                    code="internal_error")


# msgspec names the field at fault at the end of its message: "... - at `$.messages[0].role`",
# or, for a field left out, in it: "Object missing required field `prompt`"
_FIELD_PATH = re.compile(r" - at `\$\.?([^`]*)`$")
_MISSING_FIELD = re.compile(r"missing required field `([^`]*)`")


def from_decode_error(error: msgspec.DecodeError) -> APIError:
    """A body that is not JSON, or JSON of the wrong shape."""
    text = str(error)
    if not isinstance(error, msgspec.ValidationError):
        return bad_request(f"the request body is not valid JSON: {text}", code="invalid_json")
    path, missing = _FIELD_PATH.search(text), _MISSING_FIELD.search(text)
    parts = [path.group(1) if path else "", missing.group(1) if missing else ""]
    param = ".".join(part for part in parts if part) or None
    return bad_request(f"invalid request: {text}", param=param)


def from_exception(error: BaseException) -> APIError:
    """What the client sees for an exception raised while serving its request."""
    if isinstance(error, APIError):
        return error
    if isinstance(error, InvalidRequestError):
        return bad_request(str(error), param=error.param)
    if isinstance(error, EngineDeadError):
        return engine_unavailable(error)
    if isinstance(error, EngineRequestError):  # the engine lost this request, and says why
        return APIError(500, str(error), type="server_error", code="request_lost")
    logger.error("request failed", exc_info=error)
    return internal_error()


async def handle_api_error(request: Request, error: Exception) -> Response:
    """Starlette exception handler: APIError and engine errors as OpenAI error bodies."""
    return from_exception(error).response()


async def handle_http_exception(request: Request, error: Exception) -> Response:
    """Starlette's own errors (an unknown route, a wrong method) in the OpenAI shape."""
    status = getattr(error, "status_code", 500)
    detail = getattr(error, "detail", None) or "error"
    if status == 404:
        detail = f"no route {request.method} {request.url.path}"
    code = {404: "not_found", 405: "method_not_allowed"}.get(status)
    kind = "invalid_request_error" if status < 500 else "server_error"
    return APIError(status, str(detail), type=kind, code=code, headers=getattr(error, "headers", None)).response()
