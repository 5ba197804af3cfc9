"""Build the engine worker and the app from ``kvmetal serve`` options, and run them.

``build_server(args)`` returns (worker, app) with the engine started; ``run`` serves
until SIGINT/SIGTERM and then stops the engine (which flushes the prefix store).
``BackgroundServer`` runs the same thing on a thread, for tests and the load script.
"""
from __future__ import annotations

import contextlib
import json
import logging
import threading
import time
from pathlib import Path

from .memory import blocks_under_cap, format_bytes, parse_memory
from .protocol import Defaults

log = logging.getLogger("kvmetal.serve")


def _cache_bits(args) -> tuple:
    """(k_bits, v_bits): ``--k-bits``/``--v-bits`` win over mlx-lm's ``--kv-bits`` (both K and V)."""
    k_bits = args.k_bits if args.k_bits is not None else args.kv_bits
    v_bits = args.v_bits if args.v_bits is not None else args.kv_bits
    return k_bits, v_bits


def build_server(args):
    """Load the model on the engine thread, size the pool, start the worker; returns (worker, app)."""
    from ..integrations.engine import Engine
    from ..integrations.mlx_lm import layer_specs
    from .app import ServeState, create_app
    from .prefix_store import PrefixStore, model_identity
    from .worker import EngineWorker

    model_dir = Path(args.model)
    cap = parse_memory(args.kv_memory) if args.kv_memory else None
    k_bits, v_bits = _cache_bits(args)
    loaded = {}

    def build():
        from mlx_lm import load

        config = {"chat_template": args.chat_template} if args.chat_template else {}
        model, tokenizer = load(str(model_dir), tokenizer_config=config)
        loaded["tokenizer"] = tokenizer
        num_blocks = None
        if cap is not None:
            specs = layer_specs(model)
            num_blocks = blocks_under_cap(specs, cap, block_size=args.block_size, k_bits=k_bits, v_bits=v_bits)
        engine = Engine(model, block_size=args.block_size, num_blocks=num_blocks, k_bits=k_bits, v_bits=v_bits,
                        prefix_sharing=not args.no_prefix_sharing, keep_finished=False)
        loaded["num_blocks"] = num_blocks
        return engine

    store_factory = None
    if args.prompt_cache_dir:
        def store_factory(engine):
            return PrefixStore(args.prompt_cache_dir, model_identity(model_dir), engine.cache)

    context = None
    if args.backend:
        from ..backends import use_backend

        context = lambda: use_backend(args.backend)  # noqa: E731
    worker = EngineWorker(build, prefix_store_factory=store_factory, kv_cap_bytes=cap, context=context)
    worker.start()
    engine = worker.engine
    if cap is not None:
        log.info("KV cap %s: %d blocks of %d tokens per group pool (%s held)", format_bytes(cap),
                 loaded["num_blocks"], args.block_size, format_bytes(engine.cache.nbytes))
    if worker.store is not None:
        log.info("prompt cache %s: %d blocks loaded", worker.store.root, worker.store.loaded_blocks)
    context_limit = None
    with contextlib.suppress(OSError, ValueError):
        context_limit = json.loads((model_dir / "config.json").read_text()).get("max_position_embeddings")
    template_kwargs = json.loads(args.chat_template_args) if args.chat_template_args else {}
    defaults = Defaults(max_tokens=args.max_tokens, temperature=args.temp, top_p=args.top_p, top_k=args.top_k,
                        min_p=args.min_p)
    state = ServeState(worker, loaded["tokenizer"], args.model, defaults, context_limit, template_kwargs)
    return worker, create_app(state)


def run(args) -> int:
    import uvicorn

    worker, app = build_server(args)
    try:
        uvicorn.Server(uvicorn.Config(app, host=args.host, port=args.port, log_level=args.log_level.lower(),
                                      timeout_graceful_shutdown=5)).run()
    finally:
        worker.stop()
    return 0


class BackgroundServer:
    """``kvmetal serve`` on a thread of this process (tests, the load script).

    ``start()`` returns once the port accepts requests; ``stop()`` shuts HTTP down,
    then the engine (flushing ``--prompt-cache-dir``)."""

    def __init__(self, args):
        self.args = args
        self.worker = None
        self._server = None
        self._thread = None

    @property
    def url(self) -> str:
        return f"http://{self.args.host}:{self.args.port}"

    def start(self, timeout: float = 60) -> "BackgroundServer":
        import uvicorn

        self.worker, app = build_server(self.args)
        config = uvicorn.Config(app, host=self.args.host, port=self.args.port, log_level="warning",
                                timeout_graceful_shutdown=2)
        self._server = uvicorn.Server(config)
        self._server.install_signal_handlers = lambda: None  # not the main thread
        self._thread = threading.Thread(target=self._server.run, name="kvmetal-http", daemon=True)
        self._thread.start()
        deadline = time.monotonic() + timeout
        while not self._server.started:
            if not self._thread.is_alive() or time.monotonic() > deadline:
                self.worker.stop()
                raise RuntimeError(f"kvmetal serve did not start on {self.url}")
            time.sleep(0.02)
        return self

    def stop(self) -> None:
        if self._server is not None:
            self._server.should_exit = True
            self._thread.join(timeout=30)
        if self.worker is not None:
            self.worker.stop()

    def __enter__(self):
        return self.start()

    def __exit__(self, *exc):
        self.stop()
        return False
