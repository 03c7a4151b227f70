"""Decoding: params and stats, prefill, the static round over persistent buffers, the session loop, CUDA graphs."""
