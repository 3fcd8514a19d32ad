"""The OpenAI-compatible server (`jaxspec serve`): app (the FastAPI app and `Server`), config (its
knobs and their ranges, `ServeConfig`), protocol (the OpenAI request and response schema), scheduler
(requests onto the batch engine's slots), guard (connection, body and rate limits)."""
