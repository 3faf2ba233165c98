"""Field types and base models shared by every wire type (pydantic only).

Strict models refuse unknown fields, so a typo ("max_token") is a loud 422
rather than a silent default; reply models write NaN and infinity as strings.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import BaseModel, BeforeValidator, ConfigDict, Field, Strict

FinishReason = Literal["stop", "length", "abort"]
CommitPolicy = Literal["wait", "abort", "keep", "resume"]


def _no_bool(v: object) -> object:
    # pydantic would read JSON true/false as 1/0; the schema says number.
    if isinstance(v, bool):
        raise ValueError("a boolean is not a number")
    return v


Int = Annotated[int, BeforeValidator(_no_bool)]
Float = Annotated[float, BeforeValidator(_no_bool)]
TokenIds = Annotated[list[Annotated[int, Field(ge=0), BeforeValidator(_no_bool)]],
                     Field(min_length=1)]
Bool = Annotated[bool, Strict()]  # true or false, not 1 or "yes"
# Constraints before the validator, or the schema of `Port | None` shows raw ge/le.
Port = Annotated[int, Field(ge=1, le=65535), BeforeValidator(_no_bool)]
Seconds = Annotated[float, Field(gt=0, le=3600), BeforeValidator(_no_bool)]  # a timeout
Positive = Annotated[float, Field(gt=0), BeforeValidator(_no_bool)]
NonNegative = Annotated[int, Field(ge=0), BeforeValidator(_no_bool)]


def not_null(schema: dict[str, Any]) -> None:
    # An optional field whose explicit null is refused: document it without null.
    branches = [b for b in schema.pop("anyOf", []) if b.get("type") != "null"]
    if branches:
        schema.update(branches[0])
    schema.pop("default", None)


class StrictModel(BaseModel):
    # Unknown fields are an error, so a typo ("max_token") fails loudly with 422
    # instead of silently falling back to a default.
    model_config = ConfigDict(extra="forbid")


class ReplyModel(BaseModel):
    # JSON has no NaN or infinity. A diverged model's logprobs go out as the
    # strings "NaN", "Infinity", "-Infinity", which pydantic (the client) parses
    # back into floats, instead of a null that breaks `list[float]`.
    model_config = ConfigDict(ser_json_inf_nan="strings")

