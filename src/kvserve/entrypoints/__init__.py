"""Ways in: the command line and the OpenAI-compatible HTTP server (``openai/``)."""
