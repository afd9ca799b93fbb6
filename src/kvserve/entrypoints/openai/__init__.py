"""An OpenAI-compatible HTTP server: ``/v1/completions``, ``/v1/chat/completions`` and friends."""
