"""Training the bundled demo pair (issue 19): a small Kimi-K2-architecture target and its DFlash drafter,
trained on CPython's standard library.  Sits above runtime/ (it loads what it wrote through the real
loader to check it); nothing in core/, build_pipeline/ or runtime/ imports it.

  corpus.py     stdlib .py files -> deduplicated train / held-out eval shards (deterministic)
  tokenizer.py  byte-level BPE (`tokenizers`) with Kimi's chat markers as special tokens
  recipe.py     the sizes and hyper-parameters (one frozen dataclass), the size budget check
  target.py     the target: transformers' DeepseekV3ForCausalLM, its loss, router balancing, INT4 export
  drafter.py    a trainable DFlash drafter with the runtime's exact semantics, its loss and export
  loop.py       the resumable loop: seeded batches per step, checkpoints, progress, loss log and plot
  measure.py    tau and tokens/s of a (target, drafter) pair through the real Engine

Entry point: scripts/train_demo.py (recipe and commands in its docstring).
"""
