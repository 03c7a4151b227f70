"""`kdtree serve`: an OpenAI-compatible HTTP server over the Engine, with continuous batching."""
