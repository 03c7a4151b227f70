"""`kdtree serve`: load the engine, start the scheduler, run the app under uvicorn, print the URL.

The engine loads as `kdtree run` loads it (Engine.load: an artifact or a checkpoint dir through
the build cache).  With tp 1 the lanes live in this process (runtime/serve/lanes.py); with tp > 1
in the rank processes (runtime/serve/ranks.py).  When the engine fails (a rank died) the scheduler
answers 503, logs one `error:` line, and the server exits with status 1.
"""

from __future__ import annotations

import threading
import time
from pathlib import Path

import uvicorn

from runtime.decode.params import default_budget
from runtime.engine.engine import Engine
from runtime.serve.app import ServeConfig, build_app
from runtime.serve.lanes import LocalLanes
from runtime.serve.metrics import Metrics
from runtime.serve.scheduler import Scheduler

DEFAULT_MAX_MODEL_LEN = 4096


def serve(path: Path, drafter: Path | None = None, host: str = "127.0.0.1", port: int = 8000, tp: int = 1,
          max_batch: int = 8, max_queue: int = 64, max_model_len: int | None = None, api_key: str | None = None,
          device: str = "cpu", spec: str | None = None, budget: int | str | None = None, graphs: bool = True,
          dtype=None, model_name: str | None = None, echo=lambda line: print(line, flush=True)) -> int:
    """Serve until interrupted (0) or until the engine fails (1).  budget None: auto on CUDA, 16 on CPU."""
    budget = default_budget(device) if budget is None else budget
    if max_batch < 1:
        raise ValueError(f"--max-batch must be >= 1, got {max_batch}")

    def model_len(cfg) -> int:
        limit = cfg.max_position_embeddings
        n = max_model_len or min(limit, DEFAULT_MAX_MODEL_LEN)
        if not 1 < n <= limit:
            raise ValueError(f"--max-model-len must be in [2, {limit}] (the model's max_position_embeddings), "
                             f"got {n}")
        return n

    if tp > 1:
        from runtime.serve.ranks import load_ranks

        engine, lanes, max_model_len = load_ranks(path, tp, device, drafter, spec, budget, graphs, dtype, max_batch,
                                                  model_len)
    else:
        engine = Engine.load(path, device=device, drafter=drafter, spec=spec, budget=budget, graphs=graphs,
                             dtype=dtype)
        max_model_len = model_len(engine.cfg)
        lanes = LocalLanes(engine, max_batch, max_model_len)
    if engine.tokenizer is None:
        engine.close()
        raise ValueError(f"{path}: no tokenizer (expected tiktoken.model or tokenizer.json): the server needs one")
    name = model_name or Path(path).name
    metrics = Metrics(name)
    server: uvicorn.Server | None = None
    failed = threading.Event()

    def on_fatal(_msg: str) -> None:
        failed.set()
        if server is not None:
            server.should_exit = True

    scheduler = Scheduler(lanes, max_batch, max_queue, metrics, on_fatal)
    cfg = ServeConfig(name, max_model_len, engine.spec_config, engine.has_drafter,
                      engine.stop_ids()[0], engine.cfg.vocab_size, api_key)
    try:
        app = build_app(cfg, engine.tokenizer, scheduler, metrics)  # a chat template that does not parse: here
        server = uvicorn.Server(uvicorn.Config(app, host=host, port=port, log_level="warning", access_log=False))
        threading.Thread(target=_announce, args=(server, name, engine, max_batch, max_model_len, echo),
                         daemon=True).start()
        scheduler.start()
        server.run()
    finally:
        scheduler.close()
        lanes.close()
        engine.close()
    return 1 if failed.is_set() else 0


def _announce(server: uvicorn.Server, name: str, engine: Engine, max_batch: int, max_model_len: int,
              echo) -> None:
    """Print the URL once the socket listens (the port, when 0 was asked, is the one the OS gave)."""
    while not server.started:
        if server.should_exit:
            return
        time.sleep(0.02)
    host, port = server.servers[0].sockets[0].getsockname()[:2]
    spec = engine.spec + (f" budget {engine.spec_config.budget_label}" if engine.spec == "ddtree" else "")
    echo(f"kdtree serve: {name} ({spec}, {engine.plan_flag or 'one rank'}, max batch {max_batch}, "
         f"max model len {max_model_len}) on http://{host}:{port}/v1")
