"""OpenAI-style errors: the exception every bad request becomes, and the JSON Schema check
that request schemas (response_format, tool parameters) go through."""

from __future__ import annotations

from typing import Any


class ApiError(Exception):
    """An error the client caused (or a busy server), answered as OpenAI does."""

    def __init__(self, status: int, message: str, *, type: str = "invalid_request_error",
                 param: str | None = None, code: str | None = None):
        super().__init__(message)
        self.status, self.message, self.type, self.param, self.code = status, message, type, param, code

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}


def bad_request(message: str, param: str | None = None, code: str | None = None) -> ApiError:
    return ApiError(400, message, param=param, code=code)


def check_json_schema(schema: Any, where: str) -> None:
    """A 400 naming `where` when `schema` is not valid JSON Schema (draft 2020-12's metaschema)."""
    import jsonschema

    try:
        jsonschema.Draft202012Validator.check_schema(schema)
    except jsonschema.SchemaError as exc:
        path = "".join(f"[{p!r}]" for p in exc.absolute_path)
        raise bad_request(f"'{where}' is not valid JSON Schema: {exc.message[:300]}"
                          f"{' at ' + path if path else ''}", where, "invalid_schema") from None
