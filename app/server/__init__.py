"""Thermocline's OpenAI-compatible HTTP server (`thermocline serve`, the window's "Local server").

- `protocol`: OpenAI request bodies -> checked plain values; OpenAI-style error bodies.
- `gate`: one generation at a time on the engine, a bounded queue, cancellation.
- `api`: the Starlette application (routes, auth, SSE streaming).
- `runner`: uvicorn on a thread, for the window and the tests.

The server drives the engine through the same `Engine.stream` API the CLI and the window use;
nothing here touches tensors.
"""
