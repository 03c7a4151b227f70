"""What the build and the runtime share: config parsing, the strict safetensors reader, the name
table, the streaming loader and quant formats, the parallel plan, the tokenizer, errors.

Lowest layer: imports nothing from plugins/, build_pipeline/ or runtime/."""
