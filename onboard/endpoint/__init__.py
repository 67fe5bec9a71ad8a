"""Checks against a running OpenAI-compatible server: the client, prompt scoring, the request
cache that lets an interrupted check resume, and many requests in flight."""

from onboard.endpoint.client import Endpoint, EndpointError, EndpointSpec

__all__ = ["Endpoint", "EndpointError", "EndpointSpec"]
