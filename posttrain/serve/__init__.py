"""An OpenAI-compatible HTTP server over the rollout engine (`posttrain serve`; see docs/serve.md)."""

from posttrain.serve.app import build_app
from posttrain.serve.async_engine import AsyncEngine, ServedModel
from posttrain.serve.errors import APIError
from posttrain.serve.loading import build_served_models, load_served_models

__all__ = ["AsyncEngine", "ServedModel", "APIError", "build_app", "build_served_models", "load_served_models"]
