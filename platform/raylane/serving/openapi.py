"""OpenAPI description of the routes whose body FastAPI does not parse.

The infer routes read the raw body themselves (JSON or binary tensors, with or without a
Content-Type), and the generation routes parse theirs to answer a client's mistake in their own
error format, so FastAPI cannot describe the request from a signature: the request schema is
declared here and added to the document's components, so /docs and schema-driven clients see it.
"""

from __future__ import annotations

from typing import Any

from fastapi import FastAPI
from pydantic import BaseModel

REF = "#/components/schemas/{model}"


def request_body(model: str, description: str) -> dict[str, Any]:
    """`openapi_extra` of a route that reads its JSON body itself: a `model` body."""
    schema = {"$ref": REF.format(model=model)}
    return {
        "requestBody": {
            "required": True,
            "description": description,
            "content": {"application/json": {"schema": schema}},
        }
    }


def infer_request_body() -> dict[str, Any]:
    """`openapi_extra` of an infer route: an InferenceRequest body."""
    return request_body(
        "InferenceRequest",
        "An OIP v2 inference request. With the binary tensor data extension the JSON is "
        "followed by raw little-endian tensor bytes, and the Inference-Header-Content-Length "
        "header gives the JSON's length.",
    )


def add_component_schemas(api: FastAPI, *models: type[BaseModel]) -> None:
    """Add `models` (and the models they use) to `api`'s OpenAPI components."""
    generate = api.openapi

    def openapi() -> dict[str, Any]:
        if api.openapi_schema:
            return api.openapi_schema
        schema = generate()
        components = schema.setdefault("components", {}).setdefault("schemas", {})
        for model in models:
            model_schema = model.model_json_schema(ref_template=REF)
            components.update(model_schema.pop("$defs", {}))
            components[model.__name__] = model_schema
        api.openapi_schema = schema
        return schema

    api.openapi = openapi
