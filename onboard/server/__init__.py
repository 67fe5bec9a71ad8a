"""OpenAI-compatible HTTP server over the reference engine (`onboard serve`).

`app` holds the routes, `loop` the one thread that owns the engine, `protocol` the request bodies,
`responses` the response bodies, `errors` the OpenAI error shape, `metrics` the Prometheus text.
"""

from onboard.server.app import build_app, serve

__all__ = ["build_app", "serve"]
