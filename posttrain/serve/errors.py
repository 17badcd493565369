"""OpenAI-shaped errors: every failure a client sees is `{"error": {"message", "type", "param", "code"}}`."""

from __future__ import annotations

from typing import Any

from fastapi.responses import JSONResponse


class APIError(Exception):
    """A request the server refuses. `status` is the HTTP status; `param` names the offending field."""

    def __init__(
        self,
        message: str,
        status: int = 400,
        *,
        param: str | None = None,
        code: str | None = None,
        type: str = "invalid_request_error",
    ) -> None:
        super().__init__(message)
        self.message = message
        self.status = status
        self.param = param
        self.code = code
        self.type = type

    def body(self) -> dict[str, Any]:
        return error_body(self.message, type=self.type, param=self.param, code=self.code)

    def response(self) -> JSONResponse:
        return JSONResponse(self.body(), status_code=self.status)


def error_body(
    message: str, *, type: str = "invalid_request_error", param: str | None = None, code: str | None = None
) -> dict[str, Any]:
    return {"error": {"message": message, "type": type, "param": param, "code": code}}


def model_not_found(name: str, served: list[str]) -> APIError:
    return APIError(
        f"The model {name!r} does not exist (served models: {', '.join(served)})",
        404,
        param="model",
        code="model_not_found",
    )


def context_length_exceeded(max_model_len: int, prompt_tokens: int, max_tokens: int, param: str) -> APIError:
    return APIError(
        f"This model's maximum context length is {max_model_len} tokens. However, you requested "
        f"{prompt_tokens + max_tokens} tokens ({prompt_tokens} in the {param}, {max_tokens} in the completion). "
        f"Please reduce the length of the {param} or the completion.",
        400,
        param=param,
        code="context_length_exceeded",
    )
