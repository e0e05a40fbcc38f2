"""The OpenAI-compatible HTTP server: the app, request parsing, the engine-loop thread, text tracking,
metrics."""
